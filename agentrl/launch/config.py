"""The launcher's config section (`launcher:`): how `agentrl run` supervises its children.

Kept beside the launch code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.section import Section


class LauncherConfig(Section):
    """How `agentrl run` supervises its children."""

    max_restarts: int = Field(3, ge=0)
    """Restarts of one roller or server child after it dies, before the run stops; the learner is
    never restarted (its death ends the run; `agentrl run --resume` continues it)."""
    restart_backoff_s: float = Field(1.0, ge=0)
    """Wait before a child's first restart; doubled for each further restart of that child."""
    unhealthy_after_s: float = Field(60.0, ge=0)
    """A server whose process runs but that has not answered /health with 200 for this long (a
    vLLM server whose engine died answers 503, a hung one nothing) is stopped (SIGTERM, SIGKILL
    10 s later) and restarted as if it had died, within `max_restarts`; one that has not answered
    200 since it (re)started gets its backend's start-up timeout instead. 0: never."""
    type: Literal["local", "ray"] = "local"
    """`local`: every process on this machine; `ray`: placed by Ray on a running cluster."""
    address: str = "auto"
    """Ray only: the cluster to join (`auto`: the one `ray start` runs on this node, or HOST:PORT)."""
    forward_env: list[str] = Field(default_factory=lambda: ["HF_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY"])
    """Ray only: environment variables (API keys) handed to every process by an actor method call,
    with the queue's secret; never on a command line or in the actors' runtime_env."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_resources(cls, data: Any) -> Any:
        """`launcher.resources` moved to the sections of the processes that ask for them."""
        if isinstance(data, dict) and "resources" in data:
            raise ValueError(
                "moved keys: launcher.resources is now learner.resources (per rank), inference.resources "
                "(per server), roller.resources (per roller) and env.service_resources (per env service)"
            )
        return data
