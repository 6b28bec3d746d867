"""Sandboxes for code an agent writes: one interface (`Sandbox`), three backends.

`create(config)` picks the backend `config.type` names in `SANDBOXES`: `local` (bubblewrap /
namespaces / rlimits on this machine), `docker` (one container per sandbox), `remote` (a sandbox
hosted by `agentrl sandbox-server`), or one another package registers (entry-point group
`agentrl.sandboxes`). Backends are imported lazily so the docker SDK and aiohttp are only
needed by those who use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.envs.sandbox.base import ISOLATION_ORDER, ExecResult, Sandbox, SandboxError
from agentrl.plugins import Registry, UnknownName

if TYPE_CHECKING:
    from agentrl.config import (
        DockerSandboxConfig,
        LocalSandboxConfig,
        PluginSandboxConfig,
        RemoteSandboxConfig,
    )

    AnySandboxConfig = LocalSandboxConfig | DockerSandboxConfig | RemoteSandboxConfig | PluginSandboxConfig

__all__ = ["ISOLATION_ORDER", "SANDBOXES", "ExecResult", "Sandbox", "SandboxError", "create"]


SANDBOXES: Registry[type[Sandbox]] = Registry(
    "env.sandbox.type",
    "agentrl.sandboxes",
    {
        "local": "agentrl.envs.sandbox.local:LocalSandbox",
        "docker": "agentrl.envs.sandbox.docker:DockerSandbox",
        "remote": "agentrl.envs.sandbox.remote:RemoteSandbox",
    },
)
"""Sandbox classes by `type`; another package adds one through the entry-point group
`agentrl.sandboxes` (a `Sandbox` subclass taking its `PluginSandboxConfig`)."""


def create(config: AnySandboxConfig) -> Sandbox:
    """A not-yet-started sandbox of the backend `config.type` names."""
    try:
        cls = SANDBOXES.get(config.type)
    except UnknownName as exc:
        raise SandboxError(str(exc)) from None
    return cls(config)
