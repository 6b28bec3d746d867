"""`agentrl bench plan`: the planner's prediction of a run against the run, side by side.

    agentrl bench plan [--steps 6] [--scenarios k0,k1,k2,k1r2] [--latency-s 0.3]

The quickstart's lookup task with a long-tailed tool (`toy_lookup_slow`: Pareto latency, median
`--latency-s`), from the quickstart's warm-started model, as `agentrl bench async` runs it. First
`agentrl plan calibrate` measures this machine's cost profile for the model (server steps, prefill,
push, the learner's step, the cores they share). Then for each scenario (`k<K>` one roller at
max_staleness K, `k<K>r<R>` R rollers) a real `agentrl run` is measured over the same window as
`bench async` (steady state after `--warmup-steps`), and the simulator predicts the same
scenario from the calibrated profile and a workload of that run's own shape: its mean prompt,
response and turns per episode (the learner's `seq/*` metrics over the window), the env's tool
latency distribution, group size, groups per step, k, rollers and their concurrency.

The baseline is the measured run; the ratio `<scenario>_predicted_vs_measured` is the prediction
over it (1.0 is exact; the target is within 20%). The JSON carries both figures and the profile.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from agentrl.bench.async_ import GROUP_SIZE, _run, _warmstart
from agentrl.bench.common import emit, print_table, steady_rate
from agentrl.log import read_metrics
from agentrl.net import free_port

TOOL_TOKENS = (
    10  # `<result> colour </result>` and the turn's template tokens, as the mini tokenizer splits them
)


def _scenario(name: str) -> tuple[int, int]:
    k, _, rollers = name.removeprefix("k").partition("r")
    return int(k), int(rollers or 1)


def _measure(name: str, run_dir: Path, model_dir: str, opts: argparse.Namespace) -> dict:
    k, rollers = _scenario(name)
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml",
        f"--run_dir={run_dir}", f"--max_staleness={k}", f"--learner.model_path={model_dir}",
        f"--learner.max_steps={opts.warmup_steps + opts.steps}", f"--learner.groups_per_step={opts.groups_per_step}",
        "--learner.warmstart.steps=0", f"--roller.group_size={GROUP_SIZE}", f"--roller.num_processes={rollers}",
        f"--roller.max_concurrent_episodes={opts.concurrency}",
        "--env.name=toy_lookup_slow", "--env.kwargs", f"{{latency_s: {opts.latency_s}}}",
        "--queue.address", f"tcp://127.0.0.1:{free_port()}",
    ]  # fmt: skip
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(f"agentrl run ({name}) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = read_metrics(run_dir / "learner.jsonl")
    window = steady_rate(records, opts.warmup_steps, opts.groups_per_step * GROUP_SIZE)
    timed = records[opts.warmup_steps :]

    def mean(key: str) -> float:
        return sum(r[key] for r in timed) / len(timed)

    shape = {
        "len": mean("seq/len_mean"),
        "generated": mean("seq/generated_mean"),
        "turns": mean("seq/turns_mean"),
    }
    return {**window, "k": k, "rollers": rollers, "shape": shape}


def _predict(measured: dict, profile, opts: argparse.Namespace) -> float:
    from agentrl.plan.sim import Deployment, simulate
    from agentrl.plan.workload import Dist, Workload

    shape = measured["shape"]
    turns = max(1.0, shape["turns"])
    prompt = max(1.0, shape["len"] - shape["generated"] - (turns - 1) * TOOL_TOKENS)
    workload = Workload(
        prompt_tokens=Dist(value=prompt),
        response_tokens=Dist(value=shape["generated"] / turns),
        turns=Dist(value=turns),
        tool_tokens=Dist(value=TOOL_TOKENS),
        tool_latency_s=Dist("pareto", median=opts.latency_s, alpha=1.5, high=10.0),
        group_size=GROUP_SIZE,
        groups_per_step=opts.groups_per_step,
        max_staleness=measured["k"],
        max_total_tokens=256,
    )
    deployment = Deployment(
        "decoupled", servers=1, rollers=measured["rollers"], roller_concurrency=opts.concurrency
    )
    steps = opts.warmup_steps + opts.steps
    runs = [
        simulate(workload, profile, deployment, steps, opts.warmup_steps, seed=s).samples_per_s
        for s in range(5)
    ]
    return sum(runs) / len(runs)


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench plan", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps, after the warm-up")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-s", type=float, default=0.3, help="median tool latency (Pareto tail)")
    parser.add_argument("--scenarios", default="k0,k1,k2,k1r2")
    parser.add_argument("--warmstart-steps", type=int, default=600)
    parser.add_argument(
        "--model-dir", help="checkpoint to start from (default: a fresh, warm-started mini model)"
    )
    opts = parser.parse_args(args)
    names = opts.scenarios.split(",")
    for name in names:
        _scenario(name)  # refuse a malformed name before anything runs

    from agentrl.plan.calibrate import calibrate
    from agentrl.tiny_model import init_model

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-plan-") as tmp:
        model_dir = opts.model_dir
        if model_dir is None:
            model_dir = str(init_model("mini", Path(tmp) / "mini"))
            if opts.warmstart_steps:
                model_dir = _warmstart(model_dir, Path(tmp) / "warm", opts.warmstart_steps)
        profile = calibrate(model_dir, Path(tmp) / "calibrate")
        profile.learner_threads = 1  # the quickstart's one learner rank
        measured = {name: _measure(name, Path(tmp) / name, model_dir, opts) for name in names}
    predicted = {name: _predict(m, profile, opts) for name, m in measured.items()}
    print_table(
        f"planner vs measured: {opts.steps} timed steps × {opts.groups_per_step} groups × {GROUP_SIZE} episodes, "
        f"tool ~{opts.latency_s}s (Pareto)",
        ["scenario", "measured samples/s", "predicted samples/s", "predicted / measured"],
        [
            [n, measured[n]["samples_per_s"], predicted[n], predicted[n] / measured[n]["samples_per_s"]]
            for n in names
        ],
    )
    metrics = {
        name: {"measured": m, "predicted_samples_per_s": predicted[name]} for name, m in measured.items()
    } | {"profile": profile.__dict__}
    ratios = {f"{n}_predicted_vs_measured": predicted[n] / measured[n]["samples_per_s"] for n in names}
    emit("plan", metrics, ratios)
    return 0
