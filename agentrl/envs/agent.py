"""`AgentEnv` (`env.name: agent`): train an agent program that talks to an OpenAI-compatible API.

    env:
      name: agent
      kwargs:
        agent: examples.lookup_agent:solve      # async def solve(base_url, api_key, task) -> result
        # or: command: [python, my_agent.py]    # a subprocess: OPENAI_BASE_URL, OPENAI_API_KEY,
        #                                       # the task as JSON on stdin and in $AGENTRL_TASK
        reward: examples.lookup_agent:reward    # def reward(transcript, result) -> float
        # or: verifier: toy_lookup              # that env's reward(transcript)
        # or: the agent POSTs {"reward": x} to {base_url}/agentrl/reward

The env holds no conversation of its own: for each episode the roller gives the agent the
base URL of its endpoint (`rollers/agent_endpoint.py`) and a key that belongs to that
episode alone, runs the agent under the episode's limits, and builds the episode from the
tokens the endpoint recorded (`rollers/agent_episode.py`). This class is the episode's
configuration and the user code it calls: the agent, the reward and the task generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Sequence
from typing import Any, Literal

from agentrl.envs.base import Env, Transcript, resolve
from agentrl.envs.parsers import ToolCallParser, create_parser


class AgentFailed(Exception):
    """The agent crashed, hung or went past a limit: its group is dropped (credits given back)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def load_function(spec: str, field: str) -> Callable[..., Any]:
    """The function named `module:function` (imported like `env.name` classes are)."""
    from agentrl.envs.registry import _import

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"env.kwargs.{field}: expected 'module:function', got {spec!r}")
    try:
        module = _import(module_name)
    except Exception as exc:
        raise ValueError(f"env.kwargs.{field}: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"env.kwargs.{field}: {module_name!r} has no function {attr!r}")
    return fn


class AgentEnv(Env):
    """An episode run by a user's agent program through the roller's OpenAI-compatible endpoint.

    A subclass may fix its kwargs and set `tasks_from` (an env name) as a class attribute: then the
    class itself generates tasks (`generate_tasks`), as the warm start and the env check ask."""

    tasks_from: str | None = None
    """The env (built-in name or `module:Class`) whose task generator this class uses."""

    def __init__(
        self,
        agent: str | None = None,
        command: Sequence[str] | None = None,
        reward: str | None = None,
        verifier: str | None = None,
        tasks_from: str | None = None,
        demonstrate: str | None = None,
        parser: str | ToolCallParser = "hermes",
        max_requests: int | None = None,
        max_generated_tokens: int | None = None,
        timeout_s: float | None = None,
        non_extension: Literal["segment", "drop"] = "segment",
        sampling: Literal["override", "refuse"] = "override",
        model: str = "agentrl-policy",
        sandboxed: bool = False,
        sandbox: Any = None,
    ) -> None:
        """`agent` / `command`: the program (exactly one). `reward` (`module:function` of
        `(transcript, result)`), `verifier` (an env name whose `reward(transcript)` scores) or a
        reward the agent posts: the episode's reward, first of those that is set. `tasks_from`: an
        env whose task generator and required task fields this env uses (the verifier's by
        default). `demonstrate`: `module:function` of a task giving the ideal conversation (chat
        messages, as `Env.demonstrate`) for the warm start. Limits per episode: `max_requests` (default `roller.max_turns`),
        `max_generated_tokens` (default: none beyond `roller.max_total_tokens`), `timeout_s`
        (default `roller.episode_timeout_s`). `non_extension`: what a request that rewrites the
        conversation starts — a new segment trained as its own sequence with the episode's
        reward (`segment`), or one that is not trained (`drop`). `sampling`: a request asking for
        a temperature or top_p other than the run's gets the run's values, counted (`override`),
        or a 400 error (`refuse`). `model`: the name `GET /v1/models` lists. `sandboxed`: run the
        `command` in the local sandbox `sandbox` (the run's `env.sandbox`; `agent_sandbox.py`)."""
        super().__init__()
        if (agent is None) == (command is None):
            raise ValueError("env.kwargs: give exactly one of agent (module:function) or command ([...])")
        if command is not None and (isinstance(command, str) or not command):
            raise ValueError(f"env.kwargs.command: a non-empty list of arguments, got {command!r}")
        if non_extension not in ("segment", "drop"):
            raise ValueError(f"env.kwargs.non_extension: 'segment' or 'drop', got {non_extension!r}")
        if sampling not in ("override", "refuse"):
            raise ValueError(f"env.kwargs.sampling: 'override' or 'refuse', got {sampling!r}")
        for name, value in (("max_requests", max_requests), ("max_generated_tokens", max_generated_tokens)):
            if value is not None and value < 1:
                raise ValueError(f"env.kwargs.{name}: at least 1, got {value}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"env.kwargs.timeout_s: positive, got {timeout_s}")
        self.sandbox = _sandbox(sandbox, command) if sandboxed else None
        self.agent = load_function(agent, "agent") if agent is not None else None
        self.command = list(command) if command is not None else None
        self.reward_fn = load_function(reward, "reward") if reward is not None else None
        self.verifier = _env_class(verifier, "verifier") if verifier is not None else None
        self.demonstrator = load_function(demonstrate, "demonstrate") if demonstrate is not None else None
        if tasks_from is not None:
            _env_class(tasks_from, "tasks_from")
        self.parser = create_parser(parser) if isinstance(parser, str) else parser
        self.max_requests = max_requests
        self.max_generated_tokens = max_generated_tokens
        self.timeout_s = timeout_s
        self.non_extension = non_extension
        self.sampling = sampling
        self.model = model
        self.task: dict[str, Any] = {}

    @classmethod
    def task_env(cls, kwargs: dict[str, Any]) -> type[Env] | None:
        """The env class whose tasks this agent env runs (`tasks_from`, else `verifier`)."""
        name = kwargs.get("tasks_from") or kwargs.get("verifier") or cls.tasks_from
        return _env_class(name, "tasks_from") if name else None

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
        source = cls.task_env({})
        if source is None:
            raise NotImplementedError(
                f"{cls.__name__} has no task generator: give a task file (roller.tasks), or set "
                "env.kwargs.tasks_from (or a subclass's tasks_from) to an env that generates tasks"
            )
        return source.generate_tasks(num, seed=seed, **kwargs)

    def demonstrate(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        if self.demonstrator is None:
            return super().demonstrate(task)
        return list(self.demonstrator(task))

    def reset(self, task: dict[str, Any]) -> str:
        self.task = task
        return ""

    async def run_agent(self, base_url: str, api_key: str, task: dict[str, Any]) -> Any:
        """Run the agent program once; its return value (a function's, or a subprocess's last
        stdout line as JSON, else as text). Raises `AgentFailed` if it crashes."""
        if self.agent is not None:
            try:
                return await resolve(self.agent(base_url=base_url, api_key=api_key, task=task))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise AgentFailed("agent_error", f"agent raised {type(exc).__name__}: {exc}") from exc
        if self.sandbox is not None:
            from agentrl.envs.agent_sandbox import run_sandboxed

            code, out, err = await run_sandboxed(
                self.sandbox, self.command or [], base_url, api_key, task, self.timeout_s or 3600
            )
            return _command_result(self.command or [], code, out, err)
        return await _run_command(self.command or [], base_url, api_key, task)

    async def score(self, transcript: Transcript, result: Any, posted: float | None) -> tuple[float, str]:
        """(reward, source): the user's function, else the verifier env, else the posted reward, else 0."""
        if self.reward_fn is not None:
            return float(await resolve(self.reward_fn(transcript, result))), "function"
        if self.verifier is not None:
            env = self.verifier()
            try:
                await resolve(env.reset(transcript.task))
                return float(await resolve(env.reward(transcript))), "verifier"
            finally:
                await resolve(env.close())
        if posted is not None:
            return posted, "posted"
        return 0.0, "none"


def _sandbox(sandbox: Any, command: Sequence[str] | None) -> Any:
    """The sandbox config a sandboxed agent runs in: a command's, in the local backend."""
    if command is None:
        raise ValueError("env.kwargs.sandboxed: only a command agent runs in a sandbox (an agent function "
                         "runs in the roller's process)")  # fmt: skip
    if getattr(sandbox, "type", None) != "local":
        raise ValueError(f"env.kwargs.sandboxed: needs env.sandbox.type local, got {getattr(sandbox, 'type', None)!r} "
                         "(docker and remote are not supported for agents)")  # fmt: skip
    return sandbox


def _env_class(name: str, field: str) -> type[Env]:
    from agentrl.envs.registry import load_env_class

    try:
        return load_env_class(name)
    except ValueError as exc:
        raise ValueError(f"env.kwargs.{field}: {exc}") from exc


async def _run_command(command: list[str], base_url: str, api_key: str, task: dict[str, Any]) -> Any:
    """The agent as a subprocess in its own process group (so a hung one is ended whole)."""
    payload = json.dumps(task)
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "AGENTRL_TASK": payload}
    proc = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = await proc.communicate(payload.encode())
    except BaseException:  # cancelled (wall time, a limit) or failed: end the whole group
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        raise
    return _command_result(
        command, proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
    )


def _command_result(command: list[str], code: int, out: str, err: str) -> Any:
    """A command agent's result: its last stdout line as JSON, else as text; `AgentFailed` if it
    exited non-zero."""
    if code != 0:
        raise AgentFailed("agent_error", f"agent command {command[0]!r} exited {code}: {err.strip()[-2000:]}")
    lines = out.strip().splitlines()
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except ValueError:
        return lines[-1]
