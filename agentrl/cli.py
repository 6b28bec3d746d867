"""The `agentrl` command line: thin launchers, heavy imports inside each command.

    agentrl --help
    agentrl init-model tiny runs/models/tiny
    agentrl run --config recipes/quickstart.yaml --learner.optim.lr 1e-6
    agentrl show transcripts runs/quickstart --worst

Every command that takes `--config` also takes dotted overrides of any field
(`--section.key VALUE` or `--section.key=VALUE`); the config is validated before
anything starts. `agentrl --help` must stay fast: import torch, transformers, zmq
and friends only inside the command that needs them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agentrl.tiny_model import PRESETS as MODEL_PRESETS  # plain data: no heavy import

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for multi-turn, tool-calling LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
CONFIG_HELP = (
    "Config sections: learner, roller, queue, inference, weight_sync, env (with env.sandbox), reward, plus "
    "run_dir, seed, max_staleness. Override any field with --section.field VALUE (or "
    "--section.field=VALUE). Every field with its doc and default: agentrl config show [--config C] [SECTION]."
)
# what each command reads of the run config: cross-section checks run only over these
USES = {
    "learner": ("learner", "queue", "weight_sync", "inference"),
    "roller": ("roller", "env", "inference", "queue", "reward"),
    "serve-reward": ("reward",),
    "serve": ("inference", "learner"),
    "queue": ("queue", "learner"),
    "warmstart": ("learner", "roller", "env"),
    "colocated": ("learner", "roller", "env", "reward", "colocated"),
    # every section, and the launcher: it starts the servers, so none need be given
    "run": (
        "learner",
        "roller",
        "queue",
        "inference",
        "weight_sync",
        "env",
        "reward",
        "launcher",
        "colocated",
    ),
}
ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML/TOML preset (see recipes/).", show_default=False)
]

# name -> (what it measures, issue that builds it)
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
}


DEBUG = False
"""`agentrl --debug ...`: errors in the user's env or config come with their traceback."""


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback behind an error message.")
    ] = False,
) -> None:
    global DEBUG
    DEBUG = debug


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"agentrl: {message}", err=True)
    return typer.Exit(code)


def _user_error(exc: Exception, code: int = 2) -> typer.Exit:
    """A clean one-line error for a mistake in the user's env or config (raised as is with --debug)."""
    if DEBUG:
        raise exc
    return _fail(str(exc), code)


def load(config: Path | None, ctx: typer.Context) -> AgentRLConfig:
    """Load and validate the run config for this command (the sections it uses), or exit with a
    message naming the bad field."""
    from agentrl.config import ConfigError, load_config

    try:
        return load_config(config, list(ctx.args), uses=USES.get(ctx.info_name or ""))
    except ConfigError as exc:
        raise _fail(str(exc)) from None


def check_model_path(field: str, value: str, preset: str | None = None) -> None:
    """Exit with a config error naming `field` unless `value` is a checkpoint directory or looks
    like a hub id (`org/name`); transformers' own error for a missing path is a traceback about
    repo ids. The hint's preset: `preset`, else the directory's name where it is one
    (`runs/models/mini`), else tiny; a relative path says which directory it was looked up in."""
    import os
    import re

    path = Path(value).expanduser()
    if path.is_dir():
        return
    if not path.exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", value) and not value.startswith("."):
        return  # a hub id: transformers fetches it where a hub is reachable
    preset = preset or (path.name if path.name in MODEL_PRESETS else "tiny")
    where = "" if path.is_absolute() else f" (relative to the current directory {os.getcwd()})"
    raise _fail(
        f"{field}: {value} is not a checkpoint directory{where}; make one: agentrl init-model {preset} {value}"
    )


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def colocated(
    ctx: typer.Context,
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option(help="Continue from the latest checkpoint.")] = False,
) -> None:
    """One rank of a `mode: colocated` run: generate, reshard and train in turn (torchrun or Ray start
    `colocated.num_processes` of them; `agentrl run` does)."""
    cfg = load(config, ctx)
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.colocated.loop import run_rank
    from agentrl.learner.main import exit_process

    exit_process(run_rank(cfg, resume))


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def learner(
    ctx: typer.Context,
    config: ConfigOpt = None,
    resume: Annotated[bool, typer.Option(help="Continue from the latest checkpoint.")] = False,
) -> None:
    """Train the policy on groups streamed from the TransferQueue (FSDP2; torchrun for several ranks)."""
    cfg = load(config, ctx)
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.learner.main import exit_process, main

    exit_process(main(cfg, resume=resume))


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def roller(
    ctx: typer.Context,
    config: ConfigOpt = None,
    queue: Annotated[str | None, typer.Option(help="TransferQueue address, e.g. tcp://host:5555.")] = None,
    servers: Annotated[str | None, typer.Option(help="Comma-separated inference server URLs.")] = None,
) -> None:
    """Run multi-turn episodes against inference servers and stream groups to the learner."""
    import asyncio

    extra = list(ctx.args)
    if queue:  # a redis:// URL picks the Redis Streams backend, anything else is a ZeroMQ address
        extra += (
            ["--queue.type=redis", f"--queue.url={queue}"]
            if queue.startswith("redis")
            else [f"--queue.address={queue}"]
        )
    if servers:
        extra += ["--inference.servers", "[" + ", ".join(s.strip() for s in servers.split(",")) + "]"]
    ctx.args = extra
    cfg = load(config, ctx)
    # the tokenizer: the roller's own, else the served model's, else the learner's (rollers.main)
    sources = [
        ("roller.tokenizer_path", cfg.roller.tokenizer_path),
        ("inference.model_path", cfg.inference.model_path),
    ]
    check_model_path(*next(((f, v) for f, v in sources if v), ("learner.model_path", cfg.learner.model_path)))
    from agentrl.rollers.main import run_roller

    try:
        raise typer.Exit(asyncio.run(run_roller(cfg)))
    except ValueError as exc:  # bad env / task / budget / inference settings found while wiring
        raise _user_error(exc) from None


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def serve(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Option(help="Checkpoint directory to serve.")] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 30000,
    backend: Annotated[
        str,
        typer.Option(
            help="embedded (agentrl's server), vllm (a real vLLM from .venv-vllm), sglang (a real SGLang; GPU, "
            ".venv-sglang), or a backend another package registers (entry-point group agentrl.inference_backends)."
        ),
    ] = "embedded",
    config: ConfigOpt = None,
) -> None:
    """Serve a model with an inference backend: the embedded server, a real SGLang or vLLM, or a registered one."""
    from agentrl.inference.registry import backend as inference_backend

    cfg = load(config, ctx)
    try:
        kind = inference_backend(backend)
    except ValueError as exc:  # not registered: the message lists those that are
        raise _fail(f"--backend: {str(exc).removeprefix('inference.type: ')}") from None
    model_path = model or cfg.inference.model_path or cfg.learner.model_path
    if not Path(model_path).is_dir():
        raise _fail(
            f"--model: {model_path} is not a checkpoint directory (make one: agentrl init-model tiny DIR)"
        )
    try:
        code = kind.serve(model_path, host, port, cfg.inference)
    except RuntimeError as exc:  # the backend is not installed here, or it exited while starting
        raise _fail(str(exc)) from None
    raise typer.Exit(code or 0)


@app.command("serve-reward", context_settings=OVERRIDES, epilog=CONFIG_HELP)
def serve_reward(
    ctx: typer.Context,
    model: Annotated[
        str | None, typer.Option(help="Reward model checkpoint (default: reward.model).")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 30100,
    device: Annotated[str, typer.Option(help="torch device of the reward model.")] = "cpu",
    config: ConfigOpt = None,
) -> None:
    """Serve a reward model (reward.kind: classifier or judge) behind a batched POST /score."""
    cfg = load(config, ctx)
    model_path = model or cfg.reward.model
    if not model_path:
        raise _fail("--model: give the reward model's checkpoint (or set reward.model)")
    check_model_path("--model", model_path, preset="tiny-rm" if cfg.reward.kind == "classifier" else "tiny")
    from agentrl.rewards.scorer import WrongModelType, load_scorer
    from agentrl.rewards.server import run_server

    try:
        scorer = load_scorer(model_path, cfg.reward, device)
    except WrongModelType as exc:
        raise _fail(str(exc)) from None
    run_server(scorer, host, port)


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def queue(
    ctx: typer.Context,
    bind: Annotated[str, typer.Option(help="ZeroMQ address to bind.")] = "tcp://127.0.0.1:5555",
    config: ConfigOpt = None,
) -> None:
    """Run the TransferQueue server on its own (by default the learner hosts it)."""
    cfg = load(config, ctx)
    if cfg.queue.type != "zmq":
        raise _fail(f"queue.type={cfg.queue.type!r} needs no agentrl server (Redis is the server)")
    import signal

    from agentrl.queue import QueueError, create
    from agentrl.queue.auth import AuthError

    wal_dir = cfg.queue.wal_dir or str(Path(cfg.run_dir) / "queue_wal")
    try:
        server = create(cfg.queue).server(
            groups_per_step=cfg.learner.groups_per_step,
            max_staleness=cfg.max_staleness,
            per_token_staleness=cfg.learner.staleness == "token",
            bind=bind,
            wal_dir=wal_dir,
            ledger=Path(cfg.run_dir) / "queue_ledger.jsonl",
        )
        server.start()
    except (AuthError, QueueError) as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"agentrl queue: serving on {server.endpoint} (run {server.run_id})", err=True)

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def run(
    ctx: typer.Context,
    config: ConfigOpt = None,
    resume: Annotated[
        bool, typer.Option(help="Continue the run from the learner's latest checkpoint.")
    ] = False,
    launcher: Annotated[
        str | None,
        typer.Option(help="local (this machine) or ray (a running Ray cluster); default: launcher.type."),
    ] = None,
) -> None:
    """Run learner, queue, inference servers and rollers as one job, on this machine or placed by
    Ray (--launcher ray); servers and rollers that die are restarted (launcher.max_restarts), the
    learner's death ends the run. `agentrl scale` and `agentrl status` reach it by its run_dir."""
    if launcher is not None:
        if launcher not in ("local", "ray"):
            raise _fail(f"--launcher: choose local or ray, not {launcher!r}")
        ctx.args.append(f"--launcher.type={launcher}")
    cfg = load(config, ctx)
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.envs.check import check_run_budget
    from agentrl.rollers.main import tokenizer_path

    try:  # the env loads and its prompts fit the roller's budget (`agentrl env check`, cheap part)
        check_run_budget(cfg, tokenizer_path(cfg))
    except ValueError as exc:
        raise _user_error(exc) from None
    from agentrl.launch.local import run as launch

    raise typer.Exit(launch(cfg, resume=resume))


RunDirOpt = Annotated[Path, typer.Option("--run-dir", help="The running job's run_dir.")]


@app.command()
def scale(
    run_dir: RunDirOpt,
    rollers: Annotated[int | None, typer.Option(help="Roller processes to run.")] = None,
    servers: Annotated[
        int | None, typer.Option(help="Inference servers to run (new ones start on new ports; zmq queue).")
    ] = None,
) -> None:
    """Start or stop rollers and servers of a running `agentrl run` (local or Ray), learner untouched."""
    import time

    from agentrl.launch.control import read_state, request_scale

    try:
        request = request_scale(run_dir, rollers, servers)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state.get("scale_id") == request["id"]:
            typer.echo(f"agentrl scale: {state.get('scale')}")
            return
        time.sleep(0.5)
    raise _fail(f"the launcher of {run_dir} did not apply the request in 60 s (see its output)", code=1)


@app.command()
def status(run_dir: RunDirOpt) -> None:
    """Each process of a running (or the last) `agentrl run`: node, state, restarts; the learner's
    version and the queue's counts."""
    from rich.console import Console

    from agentrl.launch.control import status_table

    try:
        Console().print(status_table(run_dir))
    except FileNotFoundError as exc:
        raise _fail(str(exc)) from None


show_app = typer.Typer(help="Read what a run wrote.", no_args_is_help=True)
app.add_typer(show_app, name="show")


@show_app.command("transcripts")
def show_transcripts(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (holds transcripts.jsonl).")],
    step: Annotated[
        int | None, typer.Option(help="Only this step's episodes (default: the last step).")
    ] = None,
    worst: Annotated[bool, typer.Option("--worst", help="The lowest rewards first (all steps).")] = False,
    best: Annotated[bool, typer.Option("--best", help="The highest rewards first (all steps).")] = False,
    limit: Annotated[int, typer.Option("-n", help="At most this many episodes.")] = 4,
) -> None:
    """Episodes the learner trained on, as text: the prompt, what the model wrote (its tool calls),
    what the env answered, reward and finish reason (`learner.logging.transcripts_every`)."""
    from rich.console import Console

    from agentrl.learner.transcripts import read_transcripts, render, select

    if worst and best:
        raise _fail("--worst and --best exclude each other")
    try:
        records = read_transcripts(run_dir)
    except FileNotFoundError as exc:
        raise _fail(str(exc)) from None
    chosen = select(records, step, "worst" if worst else "best" if best else None, limit)
    if not chosen:
        steps = sorted({r["step"] for r in records})
        raise _fail(f"no transcripts for step {step} in {run_dir}; steps written: {steps}")
    render(chosen, Console())


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def warmstart(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Supervised warm start on the env's demonstrations; writes <run_dir>/warmstart."""
    cfg = load(config, ctx)
    if cfg.learner.warmstart.steps == 0:
        raise _fail(
            "learner.warmstart.steps is 0: nothing to do (set it, e.g. --learner.warmstart.steps 200)"
        )
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.learner.warmstart import warmstart as train

    try:
        train(cfg)
    except NotImplementedError as exc:
        raise _fail(f"env.name: {exc}") from None
    except ValueError as exc:  # an env that does not load
        raise _user_error(exc) from None


@app.command("eval", context_settings=OVERRIDES, epilog=CONFIG_HELP)
def eval_(
    ctx: typer.Context,
    recipe: Annotated[str | None, typer.Option(help="A recipe in recipes/, e.g. search_r1.")] = None,
    config: ConfigOpt = None,
    model: Annotated[
        str | None, typer.Option(help="Checkpoint to evaluate (default: the config's model).")
    ] = None,
    tasks: Annotated[
        str | None, typer.Option(help="Held-out QA file (default: the synthetic test split).")
    ] = None,
    limit: Annotated[int | None, typer.Option(help="Evaluate at most this many tasks.")] = None,
) -> None:
    """Evaluate a policy on a held-out split: exact match per data source (Search-R1 envs).

    Uses `inference.servers` when given, else starts one embedded server on the model."""
    import asyncio

    if recipe and config:
        raise _fail("give either --recipe or --config, not both")
    if recipe:
        config = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml"
        if not config.exists():
            raise _fail(f"--recipe: no recipe {recipe!r} in recipes/")
    cfg = load(config, ctx)
    if not cfg.env.name.startswith("search_r1"):
        raise _fail(
            f"env.name: agentrl eval reports exact match for the Search-R1 envs, not {cfg.env.name!r}"
        )
    from agentrl.envs.search.evaluate import evaluate_config, format_report
    from agentrl.launch.local import serve_for

    with serve_for(cfg, model) as served:
        report = asyncio.run(evaluate_config(served, tasks, limit))
    typer.echo(format_report(report))


@app.command("init-model")
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
        raise _fail(f"unknown model preset {preset!r}; choose one of: {', '.join(MODEL_PRESETS)}")
    from agentrl.tiny_model import init_model as build

    out = build(preset, out_dir, seed=seed)
    typer.echo(f"wrote {preset} model to {out}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Benchmark: " + ", ".join(BENCHMARKS) + ".")],
) -> None:
    """Measure ours against a baseline in the same run; ends with one JSON line of ratios.

    Each benchmark lives in `agentrl/bench/<name>.py` as `main(args: list[str]) -> int`;
    extra arguments are passed to it."""
    import importlib

    if name not in BENCHMARKS:
        raise _fail(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    what = BENCHMARKS[name]
    module_name = f"agentrl.bench.{name}_" if name == "async" else f"agentrl.bench.{name}"  # a keyword
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise _fail(
            f"`agentrl bench {name}` ({what}) is not built in this checkout (no module {module_name})", code=3
        ) from None
    raise typer.Exit(module.main(list(ctx.args)))


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def doctor(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Check this machine and a config: versions, devices, optional backends, the model's chat template."""
    from agentrl.doctor import run_doctor

    cfg = load(config, ctx)
    raise typer.Exit(run_doctor(cfg))


env_app = typer.Typer(help="Check an environment before training on it.", no_args_is_help=True)
app.add_typer(env_app, name="env")


@env_app.command("check", context_settings=OVERRIDES, epilog=CONFIG_HELP)
def env_check(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The env: a built-in name or module:Class.")],
    config: ConfigOpt = None,
) -> None:
    """Check an env like a first episode would: its prompt's tokens against the roller's budget,
    its tool schemas, `demonstrate()` through the parser, the tools and `reward`, malformed calls.
    Exits 1 on a problem. The tokenizer: roller.tokenizer_path, else inference.model_path, else
    learner.model_path; give --env.kwargs for an env other than the config's own."""
    import asyncio

    from rich.console import Console

    ctx.args = [f"--env.name={name}", *ctx.args]
    cfg = load(config, ctx)
    from agentrl.envs.check import check_env, render_report
    from agentrl.rollers.main import tokenizer_path

    report = asyncio.run(check_env(cfg, tokenizer_path(cfg)))
    Console().print(render_report(report, cfg.env.name))
    raise typer.Exit(1 if report.failed else 0)


config_app = typer.Typer(help="Inspect the run configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show", context_settings=OVERRIDES)
def config_show(
    ctx: typer.Context,
    section: Annotated[
        str | None, typer.Argument(help="One section (learner, roller, queue, ...) or run-wide field.")
    ] = None,
    config: ConfigOpt = None,
) -> None:
    """Print every config field with its type, default and doc (with --config: the values it sets)."""
    from agentrl.config import ConfigError, describe, load_config

    try:
        cfg = load_config(config, list(ctx.args), uses=()) if config or ctx.args else None
        typer.echo(describe(cfg, section), nl=False)
    except ConfigError as exc:
        raise _fail(str(exc)) from None


sandbox_app = typer.Typer(
    help="Run commands in a fresh sandbox (debugging, scripted checks).", no_args_is_help=True
)
app.add_typer(sandbox_app, name="sandbox")
BackendOpt = Annotated[str, typer.Option(help="Sandbox backend: local or docker.")]


def _sandbox_config(backend: str, **fields: object):  # -> LocalSandboxConfig | DockerSandboxConfig
    """A validated sandbox config from command-line options (None values keep the defaults)."""
    from pydantic import ValidationError

    from agentrl.config import DockerSandboxConfig, LocalSandboxConfig

    kinds = {"local": LocalSandboxConfig, "docker": DockerSandboxConfig}
    if backend not in kinds:
        raise _fail(f"--backend: unknown sandbox backend {backend!r}; choose local or docker")
    given = {k: v for k, v in fields.items() if v is not None}
    for key in given.keys() - kinds[backend].model_fields.keys():
        raise _fail(f"--{key.replace('_', '-')} does not apply to the {backend} backend")
    try:
        return kinds[backend](**given)
    except ValidationError as exc:
        raise _fail(
            f"invalid sandbox option: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}"
        ) from None


@sandbox_app.command("exec")
def sandbox_exec(
    cmd: Annotated[
        list[str],
        typer.Argument(help="The command and its arguments after --; one argument runs via /bin/sh -c."),
    ],
    backend: BackendOpt = "local",
    timeout: Annotated[float | None, typer.Option(help="Wall-clock limit in seconds.")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory limit in MiB.")] = None,
    image: Annotated[str | None, typer.Option(help="Docker image, or a directory copied in (local).")] = None,
    isolation: Annotated[str | None, typer.Option(help="Local: auto, bwrap, namespaces, rlimits.")] = None,
    min_isolation: Annotated[str | None, typer.Option(help="Local: weakest isolation accepted.")] = None,
    python_packages: Annotated[
        str | None, typer.Option(help="Local: comma-separated pure-Python packages to make importable.")
    ] = None,
) -> None:
    """Run one command in a fresh sandbox; print {"exit_code", "stdout", "stderr", "timed_out", "isolation"}."""
    import asyncio
    import json

    from agentrl.envs.sandbox import SandboxError, create

    cfg = _sandbox_config(
        backend,
        timeout_s=timeout,
        memory_mb=memory_mb,
        isolation=isolation,
        min_isolation=min_isolation,
        python_packages=python_packages.split(",") if python_packages else None,
    )

    async def run_one() -> dict:
        box = create(cfg)
        try:
            await box.start(image)
            result = await box.exec(cmd if len(cmd) > 1 else cmd[0], timeout=timeout)
            return {**result.to_dict(), "isolation": box.isolation}
        finally:
            await box.close()

    try:
        typer.echo(json.dumps(asyncio.run(run_one())))
    except SandboxError as exc:
        hint = ""
        if "min_isolation" in str(exc) and min_isolation is None:
            hint = (". To run trusted code anyway: --min-isolation namespaces (gives up bubblewrap's seccomp "
                    "filter: the code may make namespaces and mounts) or --min-isolation rlimits (gives up all "
                    "isolation: host filesystem, network and processes, resource limits only).")  # fmt: skip
        raise _fail(str(exc) + hint, code=3) from None


@sandbox_app.command("info")
def sandbox_info() -> None:
    """Print, as one JSON line, the isolation this machine offers local sandboxes and whether a
    Docker engine answers (DOCKER_HOST or the local socket)."""
    import json
    import os

    from agentrl.envs.sandbox.limits import Cgroup, Limits
    from agentrl.envs.sandbox.local import available_isolation

    root = os.geteuid() == 0
    cgroup = Cgroup.create(Limits(64, 8, 1, 1))
    if cgroup is not None:
        cgroup.remove()
    info: dict = {
        "local": {
            "available": available_isolation(424242 if root else None),
            "private_uid": root,
            "cgroup": f"v{cgroup.version}" if cgroup else None,
        }
    }
    try:
        import docker

        client = docker.from_env()
        info["docker"] = {"reachable": bool(client.ping()), "version": client.version().get("Version")}
        client.close()
    except Exception as exc:  # no SDK, no engine, no permission: all mean "not usable here"
        info["docker"] = {"reachable": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
    typer.echo(json.dumps(info))


@app.command("sandbox-server")
def sandbox_server(
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8765,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    backend: BackendOpt = "local",
    api_key_env: Annotated[str, typer.Option(help="Environment variable holding the API key.")] = (
        "AGENTRL_SANDBOX_KEY"
    ),
    timeout: Annotated[float | None, typer.Option(help="Cap on one exec's wall-clock time (s).")] = None,
    memory_mb: Annotated[int | None, typer.Option(help="Memory limit of each sandbox in MiB.")] = None,
    max_processes: Annotated[int | None, typer.Option(help="Process limit of each sandbox.")] = None,
    min_isolation: Annotated[str | None, typer.Option(help="Local: weakest isolation accepted.")] = None,
    python_packages: Annotated[
        str | None, typer.Option(help="Local: comma-separated pure-Python packages to make importable.")
    ] = None,
    max_sandboxes: Annotated[int, typer.Option(help="Live sandboxes at most (429 beyond).")] = 64,
    idle_timeout: Annotated[float, typer.Option(help="Close sandboxes idle this long (s).")] = 1800.0,
) -> None:
    """Serve sandboxes over HTTP with an API key, for rollers without Docker or bubblewrap."""
    import os

    key = os.environ.get(api_key_env, "")
    if not key:
        raise _fail(f"--api-key-env: set {api_key_env} to the API key clients will send")
    cfg = _sandbox_config(
        backend,
        timeout_s=timeout,
        memory_mb=memory_mb,
        max_processes=max_processes,
        min_isolation=min_isolation,
        python_packages=python_packages.split(",") if python_packages else None,
    )
    from agentrl.envs.sandbox.server import serve

    serve(cfg, key, host, port, max_sandboxes=max_sandboxes, idle_timeout_s=idle_timeout)


@app.command()
def retriever(
    corpus: Annotated[
        Path | None, typer.Option(help="JSONL corpus: one {id, contents} per line (Search-R1 layout).")
    ] = None,
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    topk: Annotated[int, typer.Option(help="Documents per query when a request gives no topk.")] = 3,
    index_dir: Annotated[
        Path | None, typer.Option(help="Where the index is cached (default: beside the corpus).")
    ] = None,
    method: Annotated[
        str, typer.Option(help="bm25 (default) or dense (needs faiss + sentence-transformers).")
    ] = ("bm25"),
    dense_model: Annotated[str, typer.Option(help="sentence-transformers model of --method dense.")] = (
        "intfloat/e5-base-v2"
    ),
    make_synthetic: Annotated[
        Path | None,
        typer.Option(help="Write the offline synthetic corpus and QA splits to this folder (then serve it)."),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the synthetic world.")] = 0,
    num_people: Annotated[int, typer.Option(help="People (and organisations) in the synthetic world.")] = 200,
) -> None:
    """Serve Search-R1's `POST /retrieve` over a corpus (BM25 by default, index cached on disk).

    `--make-synthetic DIR` writes DIR/corpus.jsonl, train.jsonl and test.jsonl and exits,
    unless --corpus is also given (then it serves --corpus)."""
    if make_synthetic is not None:
        from agentrl.envs.search.synthetic import make_synthetic as make

        paths = make(make_synthetic, seed=seed, num_people=num_people)
        typer.echo("wrote " + ", ".join(str(p) for p in paths.values()), err=True)
        if corpus is None:
            return
    if corpus is None:
        raise _fail("--corpus: give the JSONL corpus to serve (or --make-synthetic DIR to write one)")
    from agentrl.envs.search.retriever import create_retriever
    from agentrl.envs.search.server import serve as serve_retriever

    try:
        kwargs = {"model_name": dense_model} if method == "dense" else {}
        index = create_retriever(corpus, method, index_dir, **kwargs)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    serve_retriever(index, host, port, topk=topk)


def main() -> None:
    app(prog_name="agentrl")


if __name__ == "__main__":
    sys.exit(main())
