"""`agentrl bench peer`: TRL's GRPOTrainer against agentrl, colocated and decoupled, head to head.

    agentrl bench peer [--steps 8] [--prompts-per-step 4] [--completions 8] [--length 32]
    agentrl bench peer --agentic ...   # the multi-turn tool task with slow tools (`peer_agentic`)

One run, one after the other, on the same machine: TRL 1.16 `GRPOTrainer` (in this process, CPU,
no vLLM), then `agentrl run` in `mode: colocated` (2 ranks) and decoupled at max_staleness 0 and
2. All four train the same fresh tiny model (`init-model tiny`) on the same single-turn task
(`ColourEcho`: name the colour the prompt gives) with the same reward (`colour_reward`), the same
prompts per step, completions per prompt, completion length, learning rate and steps, GRPO
advantages and no KL term. Every row trains `--warmup-steps` + `--steps` steps and samples/s is
completions trained on per second from the end of step `--warmup-steps` to the end of the last
(`common.steady_rate`, start-up and warm-up excluded for all four alike; the default warm-up, 3
steps, is k = 2's (k+1)-step backlog of groups admitted at version 0, so the asynchronous row
carries no work done before its window into it). The JSON carries each row's window samples and
seconds and the steps that bound it. The final-reward window is the mean reward of the last quarter of the steps. Ratios: `colocated_vs_trl`, `async_vs_trl` (k=2), `sync_vs_trl`.

Threads: TRL runs twice. Row `trl` trains with `--trl-threads` intra-op threads (1 by default,
what `agentrl run` gives each of its processes: the launcher caps them, torchrun sets
OMP_NUM_THREADS=1); row `trl_matched` with as many threads as the cores agentrl's runs occupy
(`--trl-matched-threads`; default: its three single-thread processes, server, learner and roller,
capped at this machine's cores), so the comparison holds whether one counts processes or cores.
The ratios are over `trl`; `*_vs_trl_matched` are over `trl_matched`. On this 2-core
machine under load TRL with torch's default (2) ran at 1.8-8.4 samples/s against 24-25 with 1
(10 steps of 16 × 16 tokens), its OpenMP threads waiting on each other at every op of a tiny model;
`--trl-threads 0` keeps torch's default.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentrl.bench.async_ import _run
from agentrl.bench.common import emit, print_table, steady_rate
from agentrl.envs.base import Env, StepResult, Transcript
from agentrl.log import read_metrics
from agentrl.net import free_port

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]


def colour_reward(text: str, colour: str) -> float:
    """1 when the completion names the colour; else the share of the colour's letters it uses
    (a random model gets a graded signal, so both trainers have something to climb)."""
    text = text.lower()
    if colour in text:
        return 1.0
    letters = set(colour)
    return 0.5 * len(letters & set(text)) / len(letters)


def _question(colour: str) -> str:
    return f"Say the colour {colour}."


class ColourEcho(Env):
    """Single turn: the prompt names a colour; the reward is `colour_reward` of the answer."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        return [{"role": "user", "content": _question(task["answer"])}]

    def step(self, action_text: str) -> StepResult:
        return StepResult(None, 0.0, True, {})

    def reward(self, transcript: Transcript) -> float:
        return colour_reward(transcript.final_text, self.task["answer"])

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
        rng = random.Random(seed)
        return [{"id": f"colour-{seed}-{i}", "answer": rng.choice(COLOURS)} for i in range(num)]


def _window(values: list[float]) -> float:
    tail = values[-max(1, len(values) // 4) :]
    return sum(tail) / len(tail) if tail else 0.0


def _trl(model_dir: str, out: Path, opts: argparse.Namespace, threads: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    steps = opts.warmup_steps + opts.steps
    tasks = ColourEcho.generate_tasks(steps * opts.prompts_per_step + 64, seed=1)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": _question(t["answer"])}],
                               "answer": t["answer"]} for t in tasks])  # fmt: skip

    def reward(completions: list, answer: list[str], **kwargs: Any) -> list[float]:
        return [colour_reward(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    if threads:
        torch.set_num_threads(threads)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.time())

    args = GRPOConfig(output_dir=str(out), num_generations=opts.completions,
                      per_device_train_batch_size=opts.prompts_per_step * opts.completions,
                      max_completion_length=opts.length, max_steps=steps, learning_rate=opts.lr,
                      beta=0.0, temperature=1.0, logging_steps=1, report_to="none", use_cpu=True,
                      save_strategy="no", disable_tqdm=True, seed=0, bf16=False)  # fmt: skip
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward, args=args,
                          train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[Clock()])  # fmt: skip
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    records = [{"step": i + 1, "time": t} for i, t in enumerate(stamps)]
    window = steady_rate(records, opts.warmup_steps, opts.prompts_per_step * opts.completions)
    return {**window, "final_reward": _window(rewards)}


def _agentrl(model_dir: str, run_dir: Path, opts: argparse.Namespace, colocated: bool, k: int) -> dict:
    recipe = "recipes/quickstart_colocated.yaml" if colocated else "recipes/quickstart.yaml"
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", recipe, f"--run_dir={run_dir}",
        f"--max_staleness={k}", f"--learner.model_path={model_dir}", "--learner.warmstart.steps=0",
        f"--learner.max_steps={opts.warmup_steps + opts.steps}", f"--learner.groups_per_step={opts.prompts_per_step}",
        f"--learner.optim.lr={opts.lr}", "--learner.loss.advantage=grpo", f"--roller.group_size={opts.completions}",
        "--roller.max_turns=1", f"--roller.max_new_tokens={opts.length}", "--roller.max_total_tokens=512",
        "--env.name=agentrl.bench.peer:ColourEcho", "--env.kwargs={}",
    ]  # fmt: skip
    if not colocated:
        args += ["--queue.address", f"tcp://127.0.0.1:{free_port()}"]
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(
            f"agentrl run ({recipe}, k={k}) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    records = read_metrics(run_dir / "learner.jsonl")
    window = steady_rate(records, opts.warmup_steps, opts.prompts_per_step * opts.completions)
    return {**window, "final_reward": _window([r.get("reward/mean", 0.0) for r in records])}


ROWS = ("trl", "trl_matched", "k0", "k2", "colocated")


def main(args: list[str]) -> int:
    if "--agentic" in args:  # the multi-turn tool task: its own rows and options
        from agentrl.bench.peer_agentic import main as agentic

        return agentic(args)
    opts = _options(args)
    from agentrl.tiny_model import init_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-peer-") as tmp:
        model_dir = str(init_model("tiny", Path(tmp) / "tiny"))
        for row in opts.rows.split(","):
            if row in ("trl", "trl_matched"):
                threads = opts.trl_threads if row == "trl" else opts.trl_matched_threads
                results[row] = _trl(model_dir, Path(tmp) / row, opts, threads)
            elif row == "colocated":
                results[row] = _agentrl(model_dir, Path(tmp) / row, opts, colocated=True, k=0)
            else:
                results[row] = _agentrl(model_dir, Path(tmp) / row, opts, colocated=False, k=int(row[1:]))
    base = results["trl"]["samples_per_s"]
    print_table(
        f"{opts.steps} timed steps (after {opts.warmup_steps} warm-up) × {opts.prompts_per_step} prompts × {opts.completions} completions of ≤{opts.length} tokens",
        ["trainer", "samples/s", "vs TRL", "final reward (last 25%)"],
        [[row, r["samples_per_s"], r["samples_per_s"] / base if base else 0.0, r["final_reward"]]
         for row, r in results.items()],
    )  # fmt: skip
    emit("peer", *_report(opts, results))
    return 0


def _options(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentrl bench peer")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=3,
                        help="untimed steps first, the same for every row (k=2's backlog: 3)")  # fmt: skip
    parser.add_argument(
        "--prompts-per-step", type=int, default=4, help="even: colocated splits them over 2 ranks"
    )
    parser.add_argument("--completions", type=int, default=8, help="completions per prompt (the group size)")
    parser.add_argument("--length", type=int, default=32, help="completion length (max new tokens)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--trl-threads", type=int, default=1,
                        help="TRL's intra-op threads (0: torch's default); agentrl's processes get 1 each")  # fmt: skip
    parser.add_argument("--trl-matched-threads", type=int, default=min(3, os.cpu_count() or 1),
                        help="TRL's threads in row trl_matched (default: agentrl's processes, capped at the cores)")  # fmt: skip
    parser.add_argument(
        "--rows", default="trl,trl_matched,k0,k2,colocated", help="which rows to run, in this order"
    )
    opts = parser.parse_args(args)
    if opts.steps < 1 or opts.warmup_steps < 1 or opts.prompts_per_step % 2:
        parser.error("--steps and --warmup-steps must be at least 1 and --prompts-per-step even")
    if opts.trl_threads < 0:
        parser.error("--trl-threads must be 0 (torch's default) or more")
    rows = opts.rows.split(",")
    if "trl" not in rows:
        parser.error("--rows must include trl (the ratios are over it)")
    if unknown := [row for row in rows if row not in ROWS]:
        parser.error(f"--rows: unknown row {unknown[0]!r} ({', '.join(ROWS)})")
    return opts


def _report(opts: argparse.Namespace, results: dict[str, dict]) -> tuple[dict, dict]:
    """Metrics (each row's rate, reward and the raw figures behind the rate) and ratios (each
    agentrl row over TRL, and over TRL on matched threads when that row ran)."""
    base = results["trl"]["samples_per_s"]
    metrics = {f"{row}_samples_per_s": r["samples_per_s"] for row, r in results.items()}
    metrics.update({f"{row}_final_reward": r["final_reward"] for row, r in results.items()})
    for row, r in results.items():  # the raw figures behind each rate, and the window they cover
        metrics.update(
            {f"{row}_window_{key}": r[key] for key in ("samples", "seconds", "from_step", "to_step")}
        )
    metrics["warmup_steps"] = opts.warmup_steps
    names = {"colocated": "colocated_vs_trl", "k2": "async_vs_trl", "k0": "sync_vs_trl"}
    ratios = {
        names[row]: r["samples_per_s"] / base if base else 0.0 for row, r in results.items() if row in names
    }
    if matched := results.get("trl_matched", {}).get("samples_per_s"):
        ratios.update({f"{names[row]}_matched": r["samples_per_s"] / matched
                       for row, r in results.items() if row in names})  # fmt: skip
        metrics["trl_matched_threads"] = opts.trl_matched_threads
    metrics["trl_threads"] = opts.trl_threads
    return metrics, ratios
