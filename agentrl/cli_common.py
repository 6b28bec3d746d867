"""What every `agentrl` command module shares: the config help and override settings, each
command's config sections (`USES`), loading the config, and one-line errors (`--debug` shows the
traceback). Imports only typer at module level, as the command modules do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from agentrl.config import AgentRLConfig

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


DEBUG = False
"""`agentrl --debug ...`: errors in the user's env or config come with their traceback."""


def fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"agentrl: {message}", err=True)
    return typer.Exit(code)


def user_error(exc: Exception, code: int = 2) -> typer.Exit:
    """A clean one-line error for a mistake in the user's env or config (raised as is with --debug)."""
    if DEBUG:
        raise exc
    return fail(str(exc), code)


def load(config: Path | None, ctx: typer.Context) -> AgentRLConfig:
    """Load and validate the run config for this command (the sections it uses), or exit with a
    message naming the bad field."""
    from agentrl.config import ConfigError, load_config

    try:
        return load_config(config, list(ctx.args), uses=USES.get(ctx.info_name or ""))
    except ConfigError as exc:
        raise fail(str(exc)) from None
