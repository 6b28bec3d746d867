"""The `agentrl` commands that make models and measure: `init-model`, `bench`, `plan` (registered
on the app in `cli.py`; heavy imports inside each)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli_common import fail
from agentrl.tiny_model import PRESETS as MODEL_PRESETS  # plain data: no heavy import

# name -> what it measures
BENCHMARKS = {
    "serve": "embedded server tokens/s at concurrency 1, 8, 32",
    "queue": "TransferQueue vs raw ZeroMQ, Redis Streams and Ray",
    "roller": "roller concurrency and per-turn overhead",
    "learner": "train step vs bare HF, packed vs padded",
    "sync": "weight push vs raw gloo broadcast and disk",
    "async": "samples/s at max_staleness 0, 1, 2, 4",
    "faults": "seconds from a kill -9 to the next trained step, and the group account",
    "launch": "the Ray launcher vs the local one: seconds to the first step, episodes/s",
    "peer": "TRL GRPOTrainer vs agentrl colocated and decoupled (k=0, k=2) samples/s",
    "reshard": "HybridEngine reshard vs one raw all-gather and vs gather-then-slice",
    "plan": "the planner's predicted samples/s vs measured runs (quick and tail envs: k 0, 1, 2; two rollers; colocated)",
    "fanin": "one queue and router under hundreds to thousands of rollers: admissions, list updates, CPU",
}


def init_model(
    preset: Annotated[
        str,
        typer.Argument(
            help="Model size: "
            + ", ".join(MODEL_PRESETS)
            + " (tiny ~0.2M parameters, mini ~1M, small ~13M, base100m ~100M; tiny-rm: a tiny reward model)."
        ),
    ],
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the checkpoint to.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Write a random-weight Qwen2-style HF checkpoint with a Qwen2.5-format tokenizer (offline)."""
    if preset not in MODEL_PRESETS:
        raise fail(f"unknown model preset {preset!r}; choose one of: {', '.join(MODEL_PRESETS)}")
    from agentrl.tiny_model import init_model as build

    out = build(preset, out_dir, seed=seed)
    typer.echo(f"wrote {preset} model to {out}")


def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Benchmark: " + ", ".join(BENCHMARKS) + ".")],
) -> None:
    """Measure ours against a baseline in the same run; ends with one JSON line of ratios.

    Each benchmark lives in `agentrl/bench/<name>.py` as `main(args: list[str]) -> int`;
    extra arguments are passed to it."""
    import importlib

    if name not in BENCHMARKS:
        raise fail(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    what = BENCHMARKS[name]
    module_name = f"agentrl.bench.{name}_" if name == "async" else f"agentrl.bench.{name}"  # a keyword
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise fail(
            f"`agentrl bench {name}` ({what}) is not built in this checkout (no module {module_name})", code=3
        ) from None
    raise typer.Exit(module.main(list(ctx.args)))


def plan(ctx: typer.Context) -> None:
    """Rank deployments of a cluster for a model and workload (`agentrl plan --help`)."""
    from agentrl.plan.cli import main as plan_main

    raise typer.Exit(plan_main(list(ctx.args)))
