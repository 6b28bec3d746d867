"""Check an environment before it trains: its prompts against the token budget, its tools,
its demonstration and its handling of malformed calls.

    agentrl env check examples.word_tools:WordTools --config recipes/quickstart.yaml

`prompt_budget` is the cheap part, run by every roller and by `agentrl run` before the first
episode: it renders the first few tasks' prompts with the model's chat template and tools and
refuses a prompt that leaves no room for a whole turn (`roller.max_new_tokens`) within
`roller.max_total_tokens` or the model's context, naming the prompt's length, the fields and a
budget that fits. `check_env` (`agentrl env check`) adds the rest, like Gymnasium's `check_env`:
the tool schemas as the model sees them, `demonstrate()` replayed through the tool-call parser,
the tools and `reward` (it should earn more than an empty answer), and malformed calls (each
should be an error observation, not an exception or the episode's end).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.envs.base import Env, Transcript, as_step_result, resolve
from agentrl.envs.tool_env import ToolEnv
from agentrl.log import get_logger
from agentrl.rollers.config import RollerConfig

logger = get_logger(__name__)

PROMPTS_CHECKED = 4
"""Tasks whose prompts are rendered before the first episode (rendering one takes milliseconds)."""


def model_context(model_path: str | None, context_length: int | None = None) -> int | None:
    """The served model's context in tokens: `inference.context_length` when set, else the
    checkpoint's `max_position_embeddings` (None when neither is known, e.g. a hub id)."""
    if context_length:
        return context_length
    config = Path(model_path or "", "config.json")
    try:
        return int(json.loads(config.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def opening_ids(env: Env, task: dict[str, Any], renderer: Any) -> list[int]:
    """The prompt ids of `task` as the agent loop renders them (`ToolEnv.prompt`, which starts no
    sandbox, else `env.reset`)."""
    opening = env.prompt(task) if isinstance(env, ToolEnv) else await resolve(env.reset(task))
    return renderer.encode(opening) if isinstance(opening, str) else renderer.prompt_ids(opening)


def suggested_total(prompt_tokens: int, roller: RollerConfig) -> int:
    """A `roller.max_total_tokens` with room for `max_turns` whole turns, each with as much again
    for its tool result, rounded up to a multiple of 64."""
    need = prompt_tokens + roller.max_turns * 2 * roller.max_new_tokens
    return 64 * math.ceil(need / 64)


@dataclass
class Budget:
    """The longest checked prompt against the roller's budget and the model's context."""

    prompt_tokens: int
    task_id: str
    roller: RollerConfig
    context: int | None
    tools: int = 0
    warnings: list[str] = field(default_factory=list)

    @property
    def problem(self) -> str | None:
        """Why no turn fits after this prompt, naming the fields to change; None if one does."""
        p, r = self.prompt_tokens, self.roller
        what = f"the prompt of task {self.task_id!r} is {p} tokens (chat template with {self.tools} tool(s))"
        if self.context is not None and p + r.max_new_tokens > self.context:
            return (f"{what}: with roller.max_new_tokens {r.max_new_tokens} it does not fit the model's context "
                    f"of {self.context} tokens (inference.context_length or the checkpoint's "
                    "max_position_embeddings); shorten the prompt (system prompt, tool docstrings)")  # fmt: skip
        if p + r.max_new_tokens > r.max_total_tokens:
            fit = suggested_total(p, r)
            if self.context is not None:
                fit = min(fit, self.context)
            return (f"{what}, which leaves {max(0, r.max_total_tokens - p)} of roller.max_total_tokens "
                    f"{r.max_total_tokens} for a turn of roller.max_new_tokens {r.max_new_tokens}: no episode "
                    f"can generate a whole turn. Set roller.max_total_tokens to at least {p + r.max_new_tokens}, "
                    f"e.g. --roller.max_total_tokens {fit} ({r.max_turns} turns of {r.max_new_tokens} tokens, "
                    "each with as much for its tool result)")  # fmt: skip
        return None

    def check_fit(self) -> None:
        """Note (in `warnings`) budgets that fit a first turn but not the episode's."""
        p, r = self.prompt_tokens, self.roller
        if p + r.max_new_tokens <= r.max_total_tokens < p + r.max_turns * r.max_new_tokens:
            self.warnings.append(
                f"roller.max_total_tokens {r.max_total_tokens} leaves {r.max_total_tokens - p} tokens after the "
                f"{p}-token prompt, less than roller.max_turns {r.max_turns} × roller.max_new_tokens "
                f"{r.max_new_tokens}: episodes may end with finish 'context' (suggested: {suggested_total(p, r)})"
            )
        if self.context is not None and r.max_total_tokens > self.context:
            self.warnings.append(
                f"roller.max_total_tokens {r.max_total_tokens} exceeds the model's context of {self.context} "
                "tokens: the server ends generation there"
            )


async def prompt_budget(
    make_env: Callable[[], Env], tasks: Any, renderer: Any, roller: RollerConfig, context: int | None
) -> Budget:
    """The longest of the first `PROMPTS_CHECKED` tasks' prompts (`tasks[i]`) against the budget;
    `Budget.problem` says whether a turn fits, `Budget.warnings` what else does not."""
    longest: tuple[int, str] = (-1, "")
    for i in range(PROMPTS_CHECKED):
        task = tasks[i]
        env = make_env()
        try:
            n = len(await opening_ids(env, task, renderer))
        finally:
            await resolve(env.close())
        longest = max(longest, (n, str(task.get("id", i))))
    budget = Budget(longest[0], longest[1], roller, context, tools=len(renderer.tools or ()))
    budget.check_fit()
    return budget


async def require_budget(
    make_env: Callable[[], Env], tasks: Any, renderer: Any, roller: RollerConfig, context: int | None
) -> Budget:
    """`prompt_budget`, raising ValueError with its problem, logging its warnings."""
    budget = await prompt_budget(make_env, tasks, renderer, roller, context)
    if budget.problem:
        raise ValueError(f"roller.max_total_tokens: {budget.problem}")
    for warning in budget.warnings:
        logger.warning("%s", warning)
    logger.info("prompt budget: longest of %d prompts %d tokens, roller.max_total_tokens %d",
                PROMPTS_CHECKED, budget.prompt_tokens, roller.max_total_tokens)  # fmt: skip
    return budget


def check_run_budget(config: Any, tokenizer_path: str) -> Budget:
    """What `agentrl run` checks before it starts anything: the env of `config` (an
    `AgentRLConfig`) loads with its kwargs, and its prompts fit the roller's budget (ValueError
    naming the field otherwise)."""
    import asyncio

    from agentrl.envs.registry import env_factory, load_env_class, task_env_class
    from agentrl.rollers.tasks import TaskSource

    cls = load_env_class(config.env.name)
    env_config = config.env
    services = cls.services(dict(env_config.kwargs), dict(config.roller.task_kwargs), config.run_dir)
    if services:  # the launcher starts these and fills in their URLs; no prompt depends on them
        placeholders = {s.kwarg: f"http://127.0.0.1:9{s.url_path}" for s in services}
        env_config = env_config.model_copy(update={"kwargs": {**env_config.kwargs, **placeholders}})
    try:  # the env's own code may raise anything: one line naming the env, not a traceback
        make_env = env_factory(env_config)
        tasks = TaskSource(config.roller.tasks, task_env_class(config.env), config.roller.seed,
                           **config.roller.task_kwargs)  # fmt: skip
        schemas = make_env().tool_schemas
        from transformers import AutoTokenizer  # after the env's own errors, which need none of it

        from agentrl.rollers.chat import ChatRenderer

        renderer = ChatRenderer(AutoTokenizer.from_pretrained(tokenizer_path), schemas or None)
        context = model_context(tokenizer_path, config.inference.context_length)
        return asyncio.run(require_budget(make_env, tasks, renderer, config.roller, context))
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"env.name: {config.env.name}: {type(exc).__name__}: {exc} (agentrl env check "
                         f"{config.env.name} shows more)") from exc  # fmt: skip


# --------------------------------------------------------------------------- env check


@dataclass
class Finding:
    """One line of the report: what was checked, what came out, and whether it is a problem."""

    check: str
    result: str
    status: str = "ok"  # ok | warn | fail


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    schemas: list[dict[str, Any]] = field(default_factory=list)

    def add(self, check: str, result: str, status: str = "ok") -> None:
        self.findings.append(Finding(check, result, status))

    @property
    def failed(self) -> bool:
        return any(f.status == "fail" for f in self.findings)


def _overrides(cls: type) -> bool:
    return getattr(cls, "demonstrate", None) is not Env.demonstrate


async def _episode(
    make_env: Callable[[], Env], task: dict[str, Any], turns: list[str]
) -> tuple[float, dict, list]:
    """Play `turns` as the assistant's texts on a fresh env; (reward, metrics, observations). The
    episode ends where the env says done or after the last turn (reason `max_turns`)."""
    env = make_env()
    try:
        opening = await resolve(env.reset(task))
        messages = [{"role": "prompt", "content": opening}] if isinstance(opening, str) else list(opening)
        observations: list[Any] = []
        reason, text = "max_turns", ""
        for text in turns:
            messages.append({"role": "assistant", "content": text})
            step = as_step_result(await resolve(env.step(text)))
            if step.done:
                reason = "done"
                break
            obs = step.observation
            observations.append(obs)
            messages += [{"role": "observation", "content": obs}] if isinstance(obs, str) else list(obs or [])
        transcript = Transcript(task, messages, text, len(turns), reason, dict(env.metrics))
        reward = float(await resolve(env.reward(transcript)))
        return reward, dict(env.metrics), observations
    finally:
        await resolve(env.close())


def _observation_texts(observation: Any) -> list[str]:
    if isinstance(observation, str):
        return [observation]
    return [str(m.get("content", "")) for m in observation or []]


async def _replay(make_env: Callable[[], Env], task: dict[str, Any]) -> tuple[list[dict], float, str | None]:
    """(demonstration, its reward, what went wrong replaying it or None)."""
    env = make_env()
    try:
        demo = env.demonstrate(task)
    finally:
        await resolve(env.close())
    turns = [m["content"] for m in demo if m["role"] == "assistant"]
    reward, metrics, observations = await _episode(make_env, task, turns)
    got = [t for obs in observations for t in _observation_texts(obs)]
    want = [str(m.get("content", "")) for m in demo if m["role"] in ("tool", "observation")]
    if metrics.get("tool_errors") or got != want:
        errors = metrics.get("tool_errors", 0)
        return (
            demo,
            reward,
            f"{errors} tool error(s); the env answered {got} where the demonstration has {want}",
        )
    return demo, reward, None


async def _check_demonstrations(report: Report, make_env, tasks, renderer, roller, baseline: float) -> None:
    """Replay the first tasks' demonstrations through the parser, the tools and `reward`."""
    rewards, longest, turn = [], 0, 0
    for i in range(PROMPTS_CHECKED):
        try:
            demo, reward, wrong = await _replay(make_env, tasks[i])
        except Exception as exc:  # user code: any failure is the finding
            report.add("demonstrate()", f"task {i}: raised {type(exc).__name__}: {exc}", "fail")
            return
        if wrong:
            report.add("demonstration replayed", f"task {i}: {wrong}", "fail")
            return
        rewards.append(reward)
        if renderer is not None:
            from agentrl.rollers.chat import render_conversation

            longest = max(longest, len(render_conversation(renderer, demo)[0]))
            turns = [m["content"] for m in demo if m["role"] == "assistant"]
            turn = max([turn, *(len(renderer.encode(t)) + 1 for t in turns)])  # + its end-of-turn token
    calls = sum(1 for m in demo if m["role"] in ("tool", "observation"))
    report.add("demonstrations replayed", f"{len(rewards)} tasks through the parser and the tools; the last "
               f"made {calls} call(s), each answered as demonstrated")  # fmt: skip
    top = max(rewards)
    shown = ", ".join(f"{r:g}" for r in rewards)
    if top <= baseline:
        report.add("demonstration reward", f"{shown}: no more than an empty answer's {baseline:g}; a "
                   "demonstration should earn the top reward (check reward() and demonstrate())", "fail")  # fmt: skip
    elif min(rewards) < top:
        report.add("demonstration reward", f"{shown} (an empty answer: {baseline:g}): some demonstrations "
                   "earn less than the top reward (a deliberately weak teacher?)", "warn")  # fmt: skip
    else:
        report.add("demonstration reward", f"{shown} (an empty answer: {baseline:g})")
    if renderer is not None:
        fits = longest <= roller.max_total_tokens
        report.add("demonstration length", f"longest {longest} tokens; roller.max_total_tokens "
                   f"{roller.max_total_tokens}", "ok" if fits else "fail")  # fmt: skip
        fits = turn <= roller.max_new_tokens
        report.add("demonstration turns", f"longest assistant turn {turn} tokens; roller.max_new_tokens "
                   f"{roller.max_new_tokens}" + ("" if fits else " cuts it: raise roller.max_new_tokens"),
                   "ok" if fits else "fail")  # fmt: skip


MALFORMED = {
    "broken JSON": '<tool_call>\n{"name": "TOOL", "arguments": {\n</tool_call>',
    "unknown tool": '<tool_call>\n{"name": "no_such_tool", "arguments": {}}\n</tool_call>',
    "wrong arguments": '<tool_call>\n{"name": "TOOL", "arguments": {"no_such_argument": 1}}\n</tool_call>',
    "unclosed call": '<tool_call>\n{"name": "TOOL"',
}
"""Malformed tool calls a ToolEnv must answer with an error observation (TOOL: its first tool)."""


async def _check_malformed(report: Report, make_env, task, env: Env) -> None:
    tool_env = isinstance(env, ToolEnv)
    tool = env.tools[0].name if tool_env and env.tools else "tool"
    cases = MALFORMED if tool_env else {"garbage": "<<< not an action >>>", "empty": ""}
    for name, template in cases.items():
        text = template.replace("TOOL", tool)
        try:
            _, metrics, observations = await _episode(make_env, task, [text])
        except Exception as exc:  # user code: any failure is the finding
            report.add(f"malformed: {name}", f"raised {type(exc).__name__}: {exc}", "fail")
            continue
        texts = [t for obs in observations for t in _observation_texts(obs)]
        if not texts:
            report.add(f"malformed: {name}", "ended the episode", "fail" if tool_env else "ok")
        elif tool_env and not metrics.get("tool_errors"):
            report.add(f"malformed: {name}", f"not counted as a tool error: {texts[0][:70]!r}", "fail")
        else:
            report.add(f"malformed: {name}", f"error observation {texts[0][:70]!r}")


async def check_env(config: Any, tokenizer_path: str | None) -> Report:
    """Every check of `agentrl env check` on the env of `config` (an `AgentRLConfig`), with the
    model's tokenizer at `tokenizer_path` (None or unloadable: the token counts are skipped)."""
    from agentrl.envs.registry import env_factory, load_env_class, task_env_class
    from agentrl.rollers.tasks import TaskSource

    report = Report()
    try:
        cls = load_env_class(config.env.name)
        make_env = env_factory(config.env)
        env = make_env()
    except ValueError as exc:
        report.add("env", str(exc), "fail")
        return report
    kind = " (a ToolEnv)" if isinstance(env, ToolEnv) else ""
    report.add("env", f"{cls.__module__}:{cls.__qualname__}{kind}")
    try:
        tasks = TaskSource(config.roller.tasks, task_env_class(config.env), config.roller.seed,
                           **config.roller.task_kwargs)  # fmt: skip
        task = tasks[0]
    except Exception as exc:  # user code (the generator) or a bad task file: the finding
        report.add("tasks", f"{type(exc).__name__}: {exc}", "fail")
        return report
    report.add("tasks", f"{config.roller.tasks}; task 0 has keys {sorted(task)}")
    from agentrl.envs.agent import AgentEnv

    if isinstance(env, AgentEnv):  # its program drives the episode: no step() to replay
        report.add("agent", "an agent env: the episode checks (prompt budget, replayed demonstrations, "
                   "malformed turns) need its agent and a model, so they are left out", "warn")  # fmt: skip
        await resolve(env.close())
        return report
    report.schemas = list(env.tool_schemas)
    names = [s.get("function", s).get("name", "?") for s in report.schemas]
    report.add("tools", ", ".join(names) or "none")
    renderer = _renderer(tokenizer_path, report.schemas, report)
    if renderer is not None:
        context = model_context(tokenizer_path, config.inference.context_length)
        try:
            budget = await prompt_budget(make_env, tasks, renderer, config.roller, context)
        except Exception as exc:  # the env's prompt() / reset(): the finding
            report.add("prompt budget", f"rendering a prompt raised {type(exc).__name__}: {exc}", "fail")
            return report
        r = config.roller
        fits = (f"longest of {PROMPTS_CHECKED} prompts {budget.prompt_tokens} tokens; roller.max_total_tokens "
                f"{r.max_total_tokens}, max_new_tokens {r.max_new_tokens}, max_turns {r.max_turns}; model "
                f"context {context or 'unknown'}")  # fmt: skip
        report.add("prompt budget", budget.problem or fits, "fail" if budget.problem else "ok")
        for warning in budget.warnings:
            report.add("prompt budget", warning, "warn")
    try:
        baseline, _, _ = await _episode(make_env, task, [""])
        report.add("empty answer", f"reward {baseline:g}")
    except Exception as exc:  # user code: any failure is the finding
        report.add("empty answer", f"raised {type(exc).__name__}: {exc}", "fail")
        baseline = 0.0
    if _overrides(cls):
        await _check_demonstrations(report, make_env, tasks, renderer, config.roller, baseline)
    else:
        report.add("demonstrate()", "not implemented: no warm start (a random model makes no tool calls)",
                   "warn")  # fmt: skip
    await _check_malformed(report, make_env, task, env)
    await resolve(env.close())
    return report


def _renderer(tokenizer_path: str | None, schemas: list[dict], report: Report) -> Any:
    """The model's `ChatRenderer` for these tools, or None (said in `report`)."""
    if not tokenizer_path:
        report.add("tokenizer", "none given (--roller.tokenizer_path): token counts skipped", "warn")
        return None
    from transformers import AutoTokenizer

    from agentrl.rollers.chat import ChatRenderer

    try:
        return ChatRenderer(AutoTokenizer.from_pretrained(tokenizer_path), schemas or None)
    except Exception as exc:  # a missing or broken checkpoint: the finding, not a traceback
        report.add("tokenizer", f"{tokenizer_path}: {type(exc).__name__}: {str(exc)[:200]}", "fail")
        return None


def render_report(report: Report, name: str) -> Any:
    """The report as one rich renderable: a table of findings, then the tool schemas."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    marks = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
    table = Table(title=f"agentrl env check {escape(name)}", show_lines=False, expand=False)
    table.add_column("check", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("result")
    for f in report.findings:
        table.add_row(escape(f.check), marks[f.status], escape(f.result))
    parts: list[Any] = [table]
    if report.schemas:
        parts.append("[bold]tool schemas, as rendered into the prompt:[/]")
        parts += [escape(json.dumps(s)) for s in report.schemas]
    verdict = "[red]problems found[/]" if report.failed else "[green]no problems found[/]"
    parts.append(verdict)
    return Group(*parts)
