"""`agentrl bench async`: samples/s of the whole system at max_staleness 0, 1, 2, 4.

    agentrl bench async [--steps 8] [--warmup-steps K+1] [--latency-s 0.3] [--model-dir DIR]
    agentrl bench async --steps 2 --warmup-steps 1 --groups-per-step 1 --concurrency 4 --latency-s 0.01 --warmstart-steps 1
    agentrl bench async --ks 0 --colocated-share 0.5     # + colocated without / with partial rollouts

Runs `agentrl run` four times on the same machine, one after the other, identical but for
`max_staleness`, on the quickstart's lookup task whose lookups take a long-tailed time (Pareto,
as sandboxes and search engines do), from the quickstart's warm-started model (so rewards are
not zero and the price of staleness can show).

The baseline is k = 0 (the synchronous system) measured in the same invocation, and every k is
timed over the same window: each run trains `--warmup-steps` + `--steps` steps, and samples/s is
episodes trained on per second from the end of step `--warmup-steps` to the end of the last
step (`common.steady_rate`). At version 0 admission lets a run at k start (k+1) × groups_per_step
groups before the learner's first step; the default warm-up, max(k) + 1 steps, has every run
consume that backlog before its window opens, so no k carries work done outside its window into
it, and k = 0 gets the same exclusion. The JSON carries each k's window samples and seconds (the
rate's numerator and denominator) and the warm-up used. With k = 0 the
rollers wait for every weight push and the slowest tool call of each batch stalls the
learner; with k ≥ 1 generation overlaps training. Ratios `k{1,2,4}_vs_sync` are samples/s
at k over k = 0; the final mean reward at each k is in `metrics` (the price of staleness).

With `--colocated-share S`, two `mode: colocated` runs join them on the same env, model and
window (`common.steady_rate`, the same warm-up): every step waiting for all its groups, and
partial rollouts (`colocated.partial_rollout: S`: a step stops once S of its groups are done, the
rest go on after the next reshard); their samples/s and final rewards side by side, and the
ratio `colocated_partial_vs_colocated`.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from agentrl.bench.common import emit, print_table, steady_rate, stop_child
from agentrl.log import read_metrics
from agentrl.net import free_port

REPO = Path(__file__).resolve().parents[2]
GROUP_SIZE = 4


def _run(args: list[str]) -> subprocess.CompletedProcess:
    """Run an `agentrl` child to completion. If we are interrupted, the child gets one SIGTERM and time
    to stop its own children (`agentrl run` starts each in its own session): killing it outright, as
    `subprocess.run` does, would leave its server, learner and roller running. It has its own session
    so that a Ctrl-C or a signal to our process group reaches it once, through us, not twice."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        out, err = proc.communicate()
    except BaseException:
        stop_child(proc, 120)
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _one_run(
    k: int, run_dir: Path, model_dir: str, opts: argparse.Namespace, share: float | None = None
) -> dict:
    """One `agentrl run` on the long-tail env: decoupled at max_staleness `k`, or with `share`
    colocated (0: every step waits for all its groups; else `colocated.partial_rollout: share`)."""
    config = "recipes/quickstart.yaml" if share is None else "recipes/quickstart_colocated.yaml"
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", config,
        f"--run_dir={run_dir}", f"--max_staleness={k}", f"--learner.model_path={model_dir}",
        f"--learner.max_steps={opts.warmup_steps + opts.steps}", f"--learner.groups_per_step={opts.groups_per_step}",
        "--learner.warmstart.steps=0", f"--roller.group_size={GROUP_SIZE}", f"--roller.max_concurrent_episodes={opts.concurrency}",
        "--env.name=toy_lookup_slow", "--env.kwargs", f"{{latency_s: {opts.latency_s}}}",
    ]  # fmt: skip
    if share is None:
        args += ["--queue.address", f"tcp://127.0.0.1:{free_port()}"]
    elif share:
        args += [f"--colocated.partial_rollout={share}"]
    result = _run(args)
    if result.returncode != 0:
        what = f"max_staleness={k}" if share is None else f"colocated (partial_rollout {share or None})"
        raise RuntimeError(f"agentrl run at {what} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = read_metrics(run_dir / "learner.jsonl")
    window = steady_rate(records, opts.warmup_steps, opts.groups_per_step * GROUP_SIZE)
    tail = records[-max(1, len(records) // 4) :]
    return {**window, "final_reward": sum(r.get("reward/mean", 0.0) for r in tail) / len(tail)}


def _warmstart(model_dir: str, run_dir: Path, steps: int) -> str:
    args = [
        sys.executable, "-m", "agentrl", "warmstart", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={model_dir}", f"--learner.warmstart.steps={steps}",
    ]  # fmt: skip
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(f"warm start failed:\n{result.stderr[-3000:]}")
    return str(run_dir / "warmstart")


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench async")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after the warm-up")
    parser.add_argument("--warmup-steps", type=int,
                        help="untimed steps first, the same for every k (default: max k + 1)")  # fmt: skip
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-s", type=float, default=0.3, help="median tool latency (Pareto tail)")
    parser.add_argument("--model-dir", help="checkpoint to start from (default: a fresh mini model)")
    parser.add_argument("--ks", default="0,1,2,4")
    parser.add_argument("--colocated-share", type=float, default=None,
                        help="also run mode: colocated twice, without and with partial rollouts at this "
                        "share of each step's groups (colocated.partial_rollout), in the same window")  # fmt: skip
    parser.add_argument(
        "--warmstart-steps", type=int, default=600, help="supervised steps (the quickstart's weak teacher)"
    )
    opts = parser.parse_args(args)
    ks = [int(k) for k in opts.ks.split(",")]
    if 0 not in ks or opts.steps < 1:  # the ratios are over k = 0; a rate needs one timed step
        parser.error("--ks must include 0 (the synchronous baseline) and --steps must be at least 1")
    if opts.warmup_steps is None:
        opts.warmup_steps = max(ks) + 1
    if opts.warmup_steps < 1:
        parser.error("--warmup-steps must be at least 1 (the window starts at the end of a step)")

    from agentrl.tiny_model import init_model

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops the child run cleanly too
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-async-") as tmp:
        model_dir = opts.model_dir or str(init_model("mini", Path(tmp) / "mini"))
        if opts.warmstart_steps:  # a random model never calls the tool, so tool latency would not show
            model_dir = _warmstart(model_dir, Path(tmp) / "warm", opts.warmstart_steps)
        results = {k: _one_run(k, Path(tmp) / f"k{k}", model_dir, opts) for k in ks}
        colocated = {}
        if opts.colocated_share:
            for name, share in (("colocated", 0.0), ("colocated_partial", opts.colocated_share)):
                colocated[name] = _one_run(0, Path(tmp) / name, model_dir, opts, share)

    _print(opts, results, colocated)
    emit("async", *_report(opts, results, colocated))
    return 0


def _print(opts: argparse.Namespace, results: dict, colocated: dict) -> None:
    base = results[0]["samples_per_s"]
    print_table(
        f"whole system, {opts.steps} timed steps after {opts.warmup_steps} warm-up steps (every k) × "
        f"{opts.groups_per_step} groups × {GROUP_SIZE} episodes, "
        f"tool latency ~{opts.latency_s}s (Pareto)",
        ["max_staleness", "samples/s", "vs k=0", "final mean reward"],
        [
            [k, r["samples_per_s"], r["samples_per_s"] / base if base else 0.0, r["final_reward"]]
            for k, r in results.items()
        ],
    )
    if colocated:
        whole = colocated["colocated"]["samples_per_s"]
        print_table(
            f"colocated on the same env and window: every step waits for its groups, or stops at "
            f"{opts.colocated_share:g} of them (partial rollouts)",
            ["mode", "samples/s", "vs colocated", "final mean reward"],
            [[name, r["samples_per_s"], r["samples_per_s"] / whole if whole else 0.0, r["final_reward"]]
             for name, r in colocated.items()],
        )  # fmt: skip


def _report(opts: argparse.Namespace, results: dict, colocated: dict) -> tuple[dict, dict]:
    """Metrics (each run's rate, final reward and the raw figures of its window) and ratios."""
    base = results[0]["samples_per_s"]
    runs = {f"k{k}": r for k, r in results.items()} | colocated
    metrics: dict = {}
    for name, r in runs.items():
        metrics.update(
            {f"{name}_samples_per_s": r["samples_per_s"], f"{name}_final_reward": r["final_reward"]}
        )
        metrics.update(
            {f"{name}_window_{key}": r[key] for key in ("samples", "seconds", "from_step", "to_step")}
        )
    metrics["warmup_steps"] = opts.warmup_steps
    ratios = {
        f"k{k}_vs_sync": r["samples_per_s"] / base if base else 0.0 for k, r in results.items() if k != 0
    }
    if colocated and colocated["colocated"]["samples_per_s"]:
        ratios["colocated_partial_vs_colocated"] = (
            colocated["colocated_partial"]["samples_per_s"] / colocated["colocated"]["samples_per_s"]
        )
    return metrics, ratios
