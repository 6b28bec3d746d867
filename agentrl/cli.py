"""The `agentrl` command line: thin launchers, heavy imports inside each command.

    agentrl --help
    agentrl init-model tiny runs/models/tiny
    agentrl run --config recipes/quickstart.yaml --learner.optim.lr 1e-6
    agentrl show transcripts runs/quickstart --worst

Every command that takes `--config` also takes dotted overrides of any field
(`--section.key VALUE` or `--section.key=VALUE`); the config is validated before
anything starts. `agentrl --help` must stay fast: import torch, transformers, zmq
and friends only inside the command that needs them. The commands around environments
(`env check`, `sandbox`, `sandbox-server`, `retriever`) are in `cli_env.py`, the tools (`init-model`,
`bench`, `plan`) in `cli_tools.py`; what all command
modules share (config loading, `USES`, one-line errors) in `cli_common.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from agentrl import cli_common, cli_env, cli_tools
from agentrl.cli_common import CONFIG_HELP, OVERRIDES, ConfigOpt, fail, load, user_error
from agentrl.tiny_model import PRESETS as MODEL_PRESETS  # plain data: no heavy import

app = typer.Typer(
    name="agentrl",
    help="Reinforcement learning for multi-turn, tool-calling LLM agents.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the traceback behind an error message.")
    ] = False,
) -> None:
    cli_common.DEBUG = debug


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
    raise fail(
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
        raise user_error(exc) from None


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
        raise fail(f"--backend: {str(exc).removeprefix('inference.type: ')}") from None
    model_path = model or cfg.inference.model_path or cfg.learner.model_path
    if not Path(model_path).is_dir():
        raise fail(
            f"--model: {model_path} is not a checkpoint directory (make one: agentrl init-model tiny DIR)"
        )
    try:
        code = kind.serve(model_path, host, port, cfg.inference)
    except RuntimeError as exc:  # the backend is not installed here, or it exited while starting
        raise fail(str(exc)) from None
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
        raise fail("--model: give the reward model's checkpoint (or set reward.model)")
    check_model_path("--model", model_path, preset="tiny-rm" if cfg.reward.kind == "classifier" else "tiny")
    from agentrl.rewards.scorer import WrongModelType, load_scorer
    from agentrl.rewards.server import run_server

    try:
        scorer = load_scorer(model_path, cfg.reward, device)
    except WrongModelType as exc:
        raise fail(str(exc)) from None
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
        raise fail(f"queue.type={cfg.queue.type!r} needs no agentrl server (Redis is the server)")
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
        raise fail(str(exc)) from None
    typer.echo(f"agentrl queue: serving on {server.endpoint} (run {server.run_id})", err=True)
    endpoint = None
    if cfg.prometheus.queue_port is not None:
        from agentrl.observe.prometheus import QueueCollector, serve

        endpoint = serve(QueueCollector(server), cfg.prometheus.queue_port, cfg.run_dir, "queue")

    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if endpoint is not None:
            endpoint.stop()
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
            raise fail(f"--launcher: choose local or ray, not {launcher!r}")
        ctx.args.append(f"--launcher.type={launcher}")
    cfg = load(config, ctx)
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.rollers.env_check import check_run_budget
    from agentrl.rollers.main import tokenizer_path

    try:  # the env loads and its prompts fit the roller's budget (`agentrl env check`, cheap part)
        check_run_budget(cfg, tokenizer_path(cfg))
    except ValueError as exc:
        raise user_error(exc) from None
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
        raise fail(str(exc)) from None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = read_state(run_dir)
        if state.get("scale_id") == request["id"]:
            typer.echo(f"agentrl scale: {state.get('scale')}")
            return
        time.sleep(0.5)
    raise fail(f"the launcher of {run_dir} did not apply the request in 60 s (see its output)", code=1)


@app.command()
def status(run_dir: RunDirOpt) -> None:
    """Each process of a running (or the last) `agentrl run`: node, state, restarts; the learner's
    version and the queue's counts."""
    from rich.console import Console

    from agentrl.launch.control import status_table

    try:
        Console().print(status_table(run_dir))
    except FileNotFoundError as exc:
        raise fail(str(exc)) from None


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
        raise fail("--worst and --best exclude each other")
    try:
        records = read_transcripts(run_dir)
    except FileNotFoundError as exc:
        raise fail(str(exc)) from None
    chosen = select(records, step, "worst" if worst else "best" if best else None, limit)
    if not chosen:
        steps = sorted({r["step"] for r in records})
        raise fail(f"no transcripts for step {step} in {run_dir}; steps written: {steps}")
    render(chosen, Console())


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def warmstart(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Supervised warm start on the env's demonstrations; writes <run_dir>/warmstart."""
    cfg = load(config, ctx)
    if cfg.learner.warmstart.steps == 0:
        raise fail("learner.warmstart.steps is 0: nothing to do (set it, e.g. --learner.warmstart.steps 200)")
    check_model_path("learner.model_path", cfg.learner.model_path)
    from agentrl.learner.warmstart import warmstart as train

    try:
        train(cfg)
    except NotImplementedError as exc:
        raise fail(f"env.name: {exc}") from None
    except ValueError as exc:  # an env that does not load
        raise user_error(exc) from None


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
        raise fail("give either --recipe or --config, not both")
    if recipe:
        config = Path(__file__).resolve().parents[1] / "recipes" / f"{recipe}.yaml"
        if not config.exists():
            raise fail(f"--recipe: no recipe {recipe!r} in recipes/")
    cfg = load(config, ctx)
    if not cfg.env.name.startswith("search_r1"):
        raise fail(f"env.name: agentrl eval reports exact match for the Search-R1 envs, not {cfg.env.name!r}")
    from agentrl.launch.local import serve_for
    from agentrl.rollers.evaluate import evaluate_config, format_report

    with serve_for(cfg, model) as served:
        report = asyncio.run(evaluate_config(served, tasks, limit))
    typer.echo(format_report(report))


@app.command(context_settings=OVERRIDES, epilog=CONFIG_HELP)
def doctor(ctx: typer.Context, config: ConfigOpt = None) -> None:
    """Check this machine and a config: versions, devices, optional backends, the model's chat template."""
    from agentrl.doctor import run_doctor

    cfg = load(config, ctx)
    raise typer.Exit(run_doctor(cfg))


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
        raise fail(str(exc)) from None


app.add_typer(cli_env.env_app, name="env")
app.add_typer(cli_env.sandbox_app, name="sandbox")
app.command("sandbox-server")(cli_env.sandbox_server)
app.command()(cli_env.retriever)
app.command("init-model")(cli_tools.init_model)
app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(cli_tools.bench)
app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}
)(cli_tools.plan)


def main() -> None:
    app(prog_name="agentrl")


if __name__ == "__main__":
    sys.exit(main())
