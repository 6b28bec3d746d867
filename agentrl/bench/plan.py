"""`agentrl bench plan`: the planner's prediction of a run against the run, side by side.

    agentrl bench plan [--steps 20] [--envs quick,tail] [--scenarios k0,k1,k2,k1r2,colo] [--latency-s 0.3]
    agentrl bench plan --scenarios quick:k1,tail:colo        # named scenarios, `--envs` unused

Two envs, from the quickstart's warm-started model: `quick`, the quickstart's lookup task
(`toy_lookup`, its tool answers at once), and `tail`, the same task with a long-tailed tool
(`toy_lookup_slow`: Pareto latency, median `--latency-s`), as `agentrl bench async` runs it.
Each is crossed with each scenario (default: the full matrix, ten runs): `k<K>`, decoupled with
one roller at max_staleness K; `k<K>r<R>`, R rollers; `colo`, `mode: colocated`
(recipes/quickstart_colocated.yaml: its ranks generate, reshard and train in turn, on-policy).

First `agentrl plan calibrate` measures this machine's cost profile for the model (server
steps, prefill, push, the learner's step, the cores they share; with a `colo` scenario also the
colocated costs, from a short colocated run of its own: reshard and release, the colocated
learner's tokens/s, the loop's work between phases). Then for each scenario a real `agentrl run`
is measured over the same window as `bench async` (`common.steady_rate`, steady state after
`--warmup-steps`), and the simulator predicts the same scenario from the calibrated profile and
a workload of that run's own shape: its mean prompt, response and turns per episode (the
learner's `seq/*` metrics over the window), the env's tool latency distribution (0 for
`quick`), group size, groups per step, k, and the deployment: one server and the rollers with
their concurrency, or colocated with one generation replica per `colocated.tg` ranks.

The baseline is the measured run; the ratio `<scenario>_predicted_vs_measured` is the prediction
over it (1.0 is exact; the target is within 20%). The JSON carries both figures per scenario and
the profile.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentrl.bench.async_ import GROUP_SIZE, REPO, _run, _warmstart
from agentrl.bench.common import emit, print_table, steady_rate
from agentrl.log import read_metrics
from agentrl.net import free_port

TOOL_TOKENS = (
    10  # `<result> colour </result>` and the turn's template tokens, as the mini tokenizer splits them
)
DECOUPLED_CONFIG = "recipes/quickstart.yaml"
COLOCATED_CONFIG = "recipes/quickstart_colocated.yaml"
ENVS = {"quick": "toy_lookup", "tail": "toy_lookup_slow"}


@dataclass(frozen=True)
class Scenario:
    env: str  # a key of ENVS
    k: int
    rollers: int
    colocated: bool


def _scenario(name: str) -> Scenario:
    """`<env>:k<K>`, `<env>:k<K>r<R>` or `<env>:colo`; a clear error for anything else."""
    env, sep, mode = name.partition(":")
    if not sep or env not in ENVS:
        raise ValueError(f"scenario {name!r}: expected <env>:<mode> with env one of {sorted(ENVS)}")
    if mode == "colo":
        return Scenario(env, 0, 1, True)
    k, _, rollers = mode.removeprefix("k").partition("r")
    if not mode.startswith("k") or not k.isdigit() or not (rollers.isdigit() or rollers == ""):
        raise ValueError(f"scenario {name!r}: mode {mode!r} is not k<K>, k<K>r<R> or colo")
    if rollers == "0":
        raise ValueError(f"scenario {name!r}: at least one roller")
    return Scenario(env, int(k), int(rollers or 1), False)


def scenario_names(envs: str, scenarios: str) -> list[str]:
    """`--scenarios` entries naming their env as given; the others crossed with `--envs`."""
    names = []
    for entry in scenarios.split(","):
        names += [entry] if ":" in entry else [f"{env}:{entry}" for env in envs.split(",")]
    for name in names:
        _scenario(name)  # refuse a malformed name before anything runs
    return names


def _colocated_replicas() -> int:
    from agentrl.config import load_config

    cc = load_config(REPO / COLOCATED_CONFIG, []).colocated
    return cc.num_processes // cc.tg


def _env_args(env: str, opts: argparse.Namespace) -> list[str]:
    if env == "quick":
        return []  # the recipe's own env: toy_lookup
    return [f"--env.name={ENVS[env]}", "--env.kwargs", f"{{latency_s: {opts.latency_s}}}"]


def _measure(name: str, run_dir: Path, model_dir: str, opts: argparse.Namespace) -> dict:
    s = _scenario(name)
    args = [
        sys.executable, "-m", "agentrl", "run", "--config", COLOCATED_CONFIG if s.colocated else DECOUPLED_CONFIG,
        f"--run_dir={run_dir}", f"--learner.model_path={model_dir}",
        f"--learner.max_steps={opts.warmup_steps + opts.steps}", f"--learner.groups_per_step={opts.groups_per_step}",
        "--learner.warmstart.steps=0", f"--roller.group_size={GROUP_SIZE}",
        f"--roller.max_concurrent_episodes={opts.concurrency}", *_env_args(s.env, opts),
    ]  # fmt: skip
    if not s.colocated:  # colocated: the recipe's max_staleness 0, its ranks, no queue
        args += [f"--max_staleness={s.k}", f"--roller.num_processes={s.rollers}",
                 "--queue.address", f"tcp://127.0.0.1:{free_port()}"]  # fmt: skip
    result = _run(args)
    if result.returncode != 0:
        raise RuntimeError(f"agentrl run ({name}) failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    records = read_metrics(run_dir / "learner.jsonl")
    return {**_window(records, opts), "replicas": _colocated_replicas() if s.colocated else 0}


def _window(records: list[dict], opts: argparse.Namespace) -> dict:
    """The steady window's rate (`common.steady_rate`) and the run's shape over the same steps."""
    window = steady_rate(records, opts.warmup_steps, opts.groups_per_step * GROUP_SIZE)
    timed = records[opts.warmup_steps :]

    def mean(key: str) -> float:
        missing = [r["step"] for r in timed if key not in r]
        if missing:
            raise RuntimeError(f"learner.jsonl has no {key} at step(s) {missing}")
        return sum(r[key] for r in timed) / len(timed)

    shape = {
        "len": mean("seq/len_mean"),
        "generated": mean("seq/generated_mean"),
        "turns": mean("seq/turns_mean"),
    }
    return {**window, "shape": shape}


def _predict(name: str, measured: dict, profile, opts: argparse.Namespace) -> float:
    from agentrl.plan.sim import Deployment, simulate
    from agentrl.plan.workload import Dist, Workload

    s = _scenario(name)
    shape = measured["shape"]
    turns = max(1.0, shape["turns"])
    prompt = max(1.0, shape["len"] - shape["generated"] - (turns - 1) * TOOL_TOKENS)
    latency = Dist(value=0.0)  # toy_lookup answers at once
    if s.env == "tail":
        latency = Dist("pareto", median=opts.latency_s, alpha=1.5, high=10.0)
    workload = Workload(
        prompt_tokens=Dist(value=prompt),
        response_tokens=Dist(value=shape["generated"] / turns),
        turns=Dist(value=turns),
        tool_tokens=Dist(value=TOOL_TOKENS),
        tool_latency_s=latency,
        group_size=GROUP_SIZE,
        groups_per_step=opts.groups_per_step,
        max_staleness=s.k,
        max_total_tokens=256,
    )
    if s.colocated:  # one replica per generation group, each with its own roller, in the ranks
        replicas = measured["replicas"]
        deployment = Deployment(
            "colocated", servers=replicas, rollers=replicas, roller_concurrency=opts.concurrency
        )
    else:
        deployment = Deployment(
            "decoupled", servers=1, rollers=s.rollers, roller_concurrency=opts.concurrency
        )
    steps = opts.warmup_steps + opts.steps
    runs = [
        simulate(workload, profile, deployment, steps, opts.warmup_steps, seed=seed).samples_per_s
        for seed in range(5)
    ]
    return sum(runs) / len(runs)


def report(names: list[str], measured: dict, predicted: dict, profile) -> tuple[dict, dict]:
    """Metrics (per scenario: the measured window, its shape and the prediction) and ratios."""
    metrics = {
        name: {"measured": measured[name], "predicted_samples_per_s": predicted[name]} for name in names
    } | {"profile": profile.__dict__}
    ratios = {
        f"{n}_predicted_vs_measured": predicted[n] / measured[n]["samples_per_s"]
        if measured[n]["samples_per_s"]
        else 0.0
        for n in names
    }
    return metrics, ratios


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench plan", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="timed steps, after the warm-up (the tail's Pareto latencies make a short window noisy)",
    )
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency-s", type=float, default=0.3, help="median tool latency of `tail` (Pareto)")
    parser.add_argument("--envs", default="quick,tail", help=f"envs crossed with --scenarios: {sorted(ENVS)}")
    parser.add_argument("--scenarios", default="k0,k1,k2,k1r2,colo",
                        help="k<K>, k<K>r<R>, colo, each crossed with --envs; or <env>:<mode>")  # fmt: skip
    parser.add_argument("--warmstart-steps", type=int, default=600)
    parser.add_argument(
        "--colocated-calibration-steps",
        type=int,
        default=12,
        help="steps of the colocated calibration run (its learner rate varies ~2x from step to step here)",
    )
    parser.add_argument(
        "--model-dir", help="checkpoint to start from (default: a fresh, warm-started mini model)"
    )
    opts = parser.parse_args(args)
    try:
        names = scenario_names(opts.envs, opts.scenarios)
    except ValueError as e:
        parser.error(str(e))
    if opts.warmup_steps < 1 or opts.steps < 1:
        parser.error("--warmup-steps and --steps must be at least 1 (the window starts at the end of a step)")

    from agentrl.plan.calibrate import calibrate
    from agentrl.tiny_model import init_model

    with tempfile.TemporaryDirectory(prefix="agentrl-bench-plan-") as tmp:
        model_dir = opts.model_dir
        if model_dir is None:
            model_dir = str(init_model("mini", Path(tmp) / "mini"))
            if opts.warmstart_steps:
                model_dir = _warmstart(model_dir, Path(tmp) / "warm", opts.warmstart_steps)
        colocated = None
        if any(_scenario(n).colocated for n in names):  # its own short run, the bench's step shape
            overrides = (f"--learner.groups_per_step={opts.groups_per_step}", f"--roller.group_size={GROUP_SIZE}",
                         f"--roller.max_concurrent_episodes={opts.concurrency}")  # fmt: skip
            colocated = {"config": REPO / COLOCATED_CONFIG, "steps": opts.colocated_calibration_steps,
                         "overrides": overrides}  # fmt: skip
        profile = calibrate(model_dir, Path(tmp) / "calibrate", colocated=colocated)
        profile.learner_threads = 1  # the quickstart's one learner rank
        measured = {
            name: _measure(name, Path(tmp) / name.replace(":", "_"), model_dir, opts) for name in names
        }
    predicted = {name: _predict(name, m, profile, opts) for name, m in measured.items()}
    metrics, ratios = report(names, measured, predicted, profile)
    print_table(
        f"planner vs measured: {opts.steps} timed steps × {opts.groups_per_step} groups × {GROUP_SIZE} episodes; "
        f"quick: tool at once, tail: tool ~{opts.latency_s}s (Pareto)",
        ["scenario", "measured samples/s", "predicted samples/s", "predicted / measured"],
        [
            [n, measured[n]["samples_per_s"], predicted[n], ratios[f"{n}_predicted_vs_measured"]]
            for n in names
        ],
    )
    emit("plan", metrics, ratios)
    return 0
