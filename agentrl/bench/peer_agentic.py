"""`agentrl bench peer --agentic`: TRL's GRPOTrainer against agentrl on a multi-turn tool task.

    agentrl bench peer --agentic [--steps 6] [--prompts-per-step 4] [--completions 4] [--latency-s 0.1]

The baseline is TRL 1.16 `GRPOTrainer` with `environment_factory` (in this process, CPU, no vLLM),
the way TRL trains tool-calling agents: it generates a batch, then for one completion after another
runs that completion's tool calls (`_tool_call_loop`; an async tool is awaited before the next
completion's starts), then generates the next turn of the batch. agentrl runs decoupled at
max_staleness 0 and 2 (`recipes/quickstart.yaml`) and colocated (`recipes/quickstart_colocated.yaml`).

Like for like, one after the other in one invocation: every row starts from the same checkpoint (a
fresh `init-model tiny`, then `--warmstart-steps` supervised steps of `agentrl warmstart` on the
task's demonstrations, since a random model never writes a tool call), trains on the same env
(`agentrl.envs.lookup_tools`: two `lookup` calls per solved episode, the one `lookup_colour`
coroutine behind both trainers' tool, log-normal latency with median `--latency-s` and p99 ≈ 10×
it, drawn per (task, call) from the same seed), the same prompts in the same order (the roller's
built-in task stream, task i for group i; TRL's dataset is that stream, unshuffled), the same
completions per prompt, turns (`--turns` assistant turns: agentrl's `max_turns`, TRL's
`max_tool_calling_iterations` = turns - 1), tokens (`--length`: the most new tokens of an episode,
TRL's `max_completion_length` and agentrl's `max_new_tokens`; agentrl's `max_total_tokens` is the
longest prompt + `--length`), learning rate and steps, GRPO advantages, no KL, the same reward
(`lookup_reward` of the final answer).

Every row trains `--warmup-steps` + `--steps` steps; samples/s is completions trained on per second
from the end of step `--warmup-steps` to the end of the last (`common.steady_rate`, the same
exclusion for every row; the default 3 is k = 2's (k+1)-step backlog admitted at version 0). Per row
the JSON carries the window's samples and seconds (the rate's numerator and denominator), the
tool-call seconds per step (the latency drawn for the calls of the samples it trained on, averaged
over the window's steps; TRL waits them one after another, agentrl's rollers concurrently), tool
calls per sample, and the final-reward window (the mean reward of the last quarter of the steps).
Ratios: `agentic_async_vs_trl` (k = 2), `agentic_colocated_vs_trl`, `agentic_sync_vs_trl` (k = 0),
each also `*_matched` over TRL with as many threads as agentrl's processes (`--trl-matched-threads`,
as `bench peer` does), and the `_zero_latency` rows (`--zero-latency-rows`) repeat the runs with
tools that take no time, so the share of the gain that comes from overlapping tool waits shows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from agentrl.bench.async_ import _run
from agentrl.bench.common import emit, print_table, steady_rate
from agentrl.log import read_metrics
from agentrl.net import free_port

ENV = "agentrl.envs.lookup_tools:LookupToolsEnv"
ROWS = ("trl", "trl_matched", "k0", "k2", "colocated")
RATIO_NAMES = {
    "k2": "agentic_async_vs_trl",
    "colocated": "agentic_colocated_vs_trl",
    "k0": "agentic_sync_vs_trl",
}
ZERO = "_zero_latency"


def _window(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 4) :]
    return sum(tail) / len(tail) if tail else 0.0


def _env_kwargs(latency_s: float, opts: argparse.Namespace) -> str:
    return json.dumps({"latency_s": latency_s, "sigma": opts.sigma, "latency_seed": opts.latency_seed})


def _tasks(num: int) -> list[dict[str, Any]]:
    """Tasks 0..num-1 of the roller's built-in stream (roller.seed 0), the order agentrl trains them in."""
    from agentrl.envs.lookup_tools import LookupToolsEnv
    from agentrl.rollers.tasks import TaskSource

    source = TaskSource("builtin", LookupToolsEnv, 0)
    return [source[i] for i in range(num)]


def _longest_prompt(model_dir: str, tasks: list[dict[str, Any]]) -> int:
    from transformers import AutoTokenizer

    from agentrl.envs.lookup_tools import LookupToolsEnv

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = LookupToolsEnv()
    return max(
        len(tokenizer.apply_chat_template(env.prompt(t), tools=env.tool_schemas, add_generation_prompt=True,
                                          tokenize=True, return_dict=False))
        for t in tasks
    )  # fmt: skip


def _warmstart(model_dir: str, run_dir: Path, opts: argparse.Namespace) -> str:
    # one intra-op thread, as `agentrl run` gives its processes: a loaded machine stalls torch's default
    args = [
        "env", "OMP_NUM_THREADS=1", sys.executable, "-m", "agentrl", "warmstart", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={model_dir}", f"--learner.warmstart.steps={opts.warmstart_steps}",
        f"--env.name={ENV}", "--env.kwargs", _env_kwargs(0.0, opts),
    ]  # fmt: skip
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return str(run_dir / "warmstart")


def _trl(model_dir: str, out: Path, opts: argparse.Namespace, threads: int, latency_s: float) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from agentrl.envs.lookup_tools import LookupToolsTRL, lookup_reward

    steps = opts.warmup_steps + opts.steps
    tasks = _tasks(steps * opts.prompts_per_step)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": t["question"]}], "id": t["id"],
                               "table": json.dumps(t["table"]), "answers": t["answers"]} for t in tasks])  # fmt: skip

    def reward(completions: list, answers: list[list[str]], **kwargs: Any) -> list[float]:
        finals = [next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
                  for c in completions]  # fmt: skip
        return [lookup_reward(text, a) for text, a in zip(finals, answers, strict=True)]

    class Env(LookupToolsTRL):  # this run's latency; a fresh ledger
        ledger: ClassVar[dict[str, float]] = {"tool_calls": 0, "tool_seconds": 0.0}

    Env.latency_s, Env.sigma, Env.latency_seed = latency_s, opts.sigma, opts.latency_seed
    Env.__name__ = LookupToolsTRL.__name__
    if threads:
        torch.set_num_threads(threads)
    stamps: list[tuple[float, int, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append((time.time(), Env.ledger["tool_calls"], Env.ledger["tool_seconds"]))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # the tiny model's template is Qwen2.5's layout, not byte for byte: name its (Qwen) tool-call parser
    tokenizer.response_template = qwen3_template
    args = GRPOConfig(output_dir=str(out), num_generations=opts.completions,
                      per_device_train_batch_size=opts.prompts_per_step * opts.completions,
                      max_completion_length=opts.length, max_tool_calling_iterations=opts.turns - 1,
                      max_steps=steps, learning_rate=opts.lr, beta=0.0, temperature=1.0, logging_steps=1,
                      report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True, seed=0,
                      bf16=False, shuffle_dataset=False)  # fmt: skip
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=args,
                          train_dataset=data, processing_class=tokenizer, environment_factory=Env,
                          callbacks=[Clock()])  # fmt: skip
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    records = [
        {"step": i + 1, "time": t, "tool_calls": c, "tool_seconds": s} for i, (t, c, s) in enumerate(stamps)
    ]
    return _summary(records, rewards, opts)


def _summary(records: list[dict], rewards: list[float], opts: argparse.Namespace) -> dict:
    """A row from its per-step records (`time`, and the cumulative `tool_calls` / `tool_seconds`
    at each step's end): the steady window, tool seconds per window step, calls per sample."""
    samples_per_step = opts.prompts_per_step * opts.completions
    window = steady_rate(records, opts.warmup_steps, samples_per_step)
    start, end = records[opts.warmup_steps - 1], records[-1]
    steps = len(records) - opts.warmup_steps
    return {
        **window,
        "tool_seconds_per_step": (end["tool_seconds"] - start["tool_seconds"]) / steps,
        "tool_calls_per_sample": (end["tool_calls"] - start["tool_calls"]) / window["samples"],
        "final_reward": _window(rewards),
    }


def _agentrl(model_dir: str, run_dir: Path, opts: argparse.Namespace, row: str, latency_s: float) -> dict:
    colocated = row == "colocated"
    recipe = "recipes/quickstart_colocated.yaml" if colocated else "recipes/quickstart.yaml"
    k = 0 if colocated else int(row[1:])
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", recipe, f"--run_dir={run_dir}",
        f"--max_staleness={k}", f"--learner.model_path={model_dir}", "--learner.warmstart.steps=0",
        f"--learner.max_steps={opts.warmup_steps + opts.steps}", f"--learner.groups_per_step={opts.prompts_per_step}",
        f"--learner.optim.lr={opts.lr}", "--learner.loss.advantage=grpo", f"--roller.group_size={opts.completions}",
        f"--roller.max_turns={opts.turns}", f"--roller.max_new_tokens={opts.length}",
        f"--roller.max_total_tokens={opts.max_total_tokens}", f"--env.name={ENV}",
        "--env.kwargs", _env_kwargs(latency_s, opts),
    ]  # fmt: skip
    if not colocated:
        args += ["--queue.address", f"tcp://127.0.0.1:{free_port()}"]
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(f"agentrl run ({row}) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = read_metrics(run_dir / "learner.jsonl")
    samples_per_step = opts.prompts_per_step * opts.completions
    calls = seconds = 0.0
    for r in records:  # the env's per-episode means, summed over the step's episodes, cumulated
        # calls that reached the tool (a malformed one is counted as a call and an error; TRL's
        # ledger counts only the calls it made)
        calls += (r.get("episode/tool_calls", 0.0) - r.get("episode/tool_errors", 0.0)) * samples_per_step
        seconds += r.get("episode/tool_seconds", 0.0) * samples_per_step
        r["tool_calls"], r["tool_seconds"] = calls, seconds
    return _summary(records, [r.get("reward/mean", 0.0) for r in records], opts)


def report(results: dict[str, dict], opts: argparse.Namespace) -> tuple[dict, dict]:
    """The JSON's metrics and ratios from each row's summary: every rate with its raw figures, and
    each ratio over the TRL row of the same latency (`trl` or `trl_zero_latency`)."""
    metrics: dict[str, Any] = {}
    for row, r in results.items():
        for key in ("samples_per_s", "final_reward", "tool_seconds_per_step", "tool_calls_per_sample"):
            metrics[f"{row}_{key}"] = r[key]
        metrics.update(
            {f"{row}_window_{key}": r[key] for key in ("samples", "seconds", "from_step", "to_step")}
        )
    metrics.update(warmup_steps=opts.warmup_steps, latency_s=opts.latency_s, latency_sigma=opts.sigma,
                   latency_seed=opts.latency_seed, trl_threads=opts.trl_threads,
                   trl_matched_threads=opts.trl_matched_threads, turns=opts.turns, length=opts.length,
                   warmstart_steps=opts.warmstart_steps)  # fmt: skip
    ratios: dict[str, float] = {}
    for suffix in ("", ZERO):
        for base_row, tag in (("trl", ""), ("trl_matched", "_matched")):
            base = results.get(base_row + suffix, {}).get("samples_per_s")
            if not base:
                continue
            for row, name in RATIO_NAMES.items():
                if row + suffix in results:
                    ratios[name + tag + suffix] = results[row + suffix]["samples_per_s"] / base
    return metrics, ratios


def _options(args: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    parser = argparse.ArgumentParser(prog="agentrl bench peer --agentic")
    parser.add_argument("--agentic", action="store_true", help="this bench (the multi-turn tool task)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps first, the same for every row (k=2's backlog: 3)")  # fmt: skip
    parser.add_argument(
        "--prompts-per-step", type=int, default=4, help="even: colocated splits them over 2 ranks"
    )
    parser.add_argument("--completions", type=int, default=4, help="completions per prompt (the group size)")
    parser.add_argument(
        "--turns", type=int, default=3, help="assistant turns per episode (2 lookups + answer)"
    )
    parser.add_argument("--length", type=int, default=96, help="new tokens per episode (all turns)")
    parser.add_argument("--lr", type=float, default=1e-4,
                        help="low enough that the warm-started tool use survives the run (1e-3 lost it)")  # fmt: skip
    parser.add_argument("--latency-s", type=float, default=0.1, help="median tool latency (log-normal)")
    parser.add_argument("--sigma", type=float, default=0.99, help="log-normal sigma (0.99: p99 = 10x median)")
    parser.add_argument("--latency-seed", type=int, default=0)
    parser.add_argument("--warmstart-steps", type=int, default=300,
                        help="supervised steps on the demonstrations before every row (shared checkpoint)")  # fmt: skip
    parser.add_argument("--model-dir", help="start from this checkpoint (skips init-model and warm start)")
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="TRL's intra-op threads (0: torch's default); agentrl's processes get 1 each")  # fmt: skip
    parser.add_argument("--trl-matched-threads", type=int, default=min(3, os.cpu_count() or 1),
                        help="TRL's threads in row trl_matched (default: agentrl's processes, capped at the cores)")  # fmt: skip
    parser.add_argument("--rows", default=",".join(ROWS), help="rows with the tool latency, in this order")
    parser.add_argument("--zero-latency-rows", default="trl,k2",
                        help="rows repeated with tools that take no time ('' for none)")  # fmt: skip
    opts = parser.parse_args(args)
    if opts.steps < 1 or opts.warmup_steps < 1 or opts.prompts_per_step % 2 or opts.turns < 2:
        parser.error("--steps, --warmup-steps ≥ 1, --prompts-per-step even, --turns ≥ 2")
    rows = [r for r in opts.rows.split(",") if r]
    zero_rows = [r for r in opts.zero_latency_rows.split(",") if r]
    for name, chosen in (("--rows", rows), ("--zero-latency-rows", zero_rows)):
        if unknown := [r for r in chosen if r not in ROWS]:
            parser.error(f"{name}: unknown rows {unknown} (choose from {', '.join(ROWS)})")
        if chosen and "trl" not in chosen:
            parser.error(f"{name} must include trl (the ratios are over it)")
    return opts, rows, zero_rows


def main(args: list[str]) -> int:
    opts, rows, zero_rows = _options(args)
    from agentrl.tiny_model import init_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-peer-agentic-") as tmp:
        model_dir = opts.model_dir
        if model_dir is None:
            model_dir = str(init_model("tiny", Path(tmp) / "tiny"))
            if opts.warmstart_steps:  # a random model never writes a tool call: no tool time would show
                model_dir = _warmstart(model_dir, Path(tmp) / "warm", opts)
        tasks = _tasks((opts.warmup_steps + opts.steps) * opts.prompts_per_step)
        opts.max_total_tokens = _longest_prompt(model_dir, tasks) + opts.length
        runs = [(row, row, opts.latency_s) for row in rows] + [(row + ZERO, row, 0.0) for row in zero_rows]
        for name, row, latency_s in runs:
            if row in ("trl", "trl_matched"):
                threads = opts.trl_threads if row == "trl" else opts.trl_matched_threads
                results[name] = _trl(model_dir, Path(tmp) / name, opts, threads, latency_s)
            else:
                results[name] = _agentrl(model_dir, Path(tmp) / name, opts, row, latency_s)
    metrics, ratios = report(results, opts)
    _print(results, opts)
    emit("peer_agentic", metrics, ratios)
    return 0


def _print(results: dict[str, dict], opts: argparse.Namespace) -> None:
    def vs_trl(name: str) -> float:
        base = results["trl" + (ZERO if name.endswith(ZERO) else "")]["samples_per_s"]
        return results[name]["samples_per_s"] / base if base else 0.0

    print_table(
        f"{opts.steps} timed steps (after {opts.warmup_steps} warm-up) × {opts.prompts_per_step} prompts × "
        f"{opts.completions} completions, ≤{opts.turns} turns / {opts.length} new tokens, "
        f"tool latency log-normal median {opts.latency_s}s σ {opts.sigma}",
        ["row", "samples/s", "vs TRL (same latency)", "tool s/step", "tool calls/sample", "final reward (last 25%)"],
        [[name, r["samples_per_s"], vs_trl(name), r["tool_seconds_per_step"], r["tool_calls_per_sample"],
          r["final_reward"]] for name, r in results.items()],
    )  # fmt: skip
