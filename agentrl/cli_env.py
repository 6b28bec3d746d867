"""`agentrl env check`, `agentrl sandbox exec|info`, `agentrl sandbox-server` and `agentrl retriever`:
the commands around environments (checking one, its sandboxes, its retrieval service).
`agentrl/cli.py` registers them; as there, heavy imports happen inside each command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agentrl.cli_common import CONFIG_HELP, OVERRIDES, ConfigOpt, fail, load

env_app = typer.Typer(help="Check an environment before training on it.", no_args_is_help=True)


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
    from agentrl.rollers.env_check import check_env, render_report
    from agentrl.rollers.main import tokenizer_path

    report = asyncio.run(check_env(cfg, tokenizer_path(cfg)))
    Console().print(render_report(report, cfg.env.name))
    raise typer.Exit(1 if report.failed else 0)


sandbox_app = typer.Typer(
    help="Run commands in a fresh sandbox (debugging, scripted checks).", no_args_is_help=True
)
BackendOpt = Annotated[str, typer.Option(help="Sandbox backend: local or docker.")]


def _sandbox_config(backend: str, **fields: object):  # -> LocalSandboxConfig | DockerSandboxConfig
    """A validated sandbox config from command-line options (None values keep the defaults)."""
    from pydantic import ValidationError

    from agentrl.envs.sandbox.config import DockerSandboxConfig, LocalSandboxConfig

    kinds = {"local": LocalSandboxConfig, "docker": DockerSandboxConfig}
    if backend not in kinds:
        raise fail(f"--backend: unknown sandbox backend {backend!r}; choose local or docker")
    given = {k: v for k, v in fields.items() if v is not None}
    for key in given.keys() - kinds[backend].model_fields.keys():
        raise fail(f"--{key.replace('_', '-')} does not apply to the {backend} backend")
    try:
        return kinds[backend](**given)
    except ValidationError as exc:
        raise fail(f"invalid sandbox option: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}") from None


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
        raise fail(str(exc) + hint, code=3) from None


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
        raise fail(f"--api-key-env: set {api_key_env} to the API key clients will send")
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
        raise fail("--corpus: give the JSONL corpus to serve (or --make-synthetic DIR to write one)")
    from agentrl.envs.search.retriever import create_retriever
    from agentrl.envs.search.server import serve as serve_retriever

    try:
        kwargs = {"model_name": dense_model} if method == "dense" else {}
        index = create_retriever(corpus, method, index_dir, **kwargs)
    except ValueError as exc:
        raise fail(str(exc)) from None
    serve_retriever(index, host, port, topk=topk)
