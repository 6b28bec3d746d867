"""Sandboxes for code an agent writes: one interface (`Sandbox`), three backends.

`create(config)` picks the backend `config.type` names in `SANDBOXES` (`registry.py`): `local` (bubblewrap /
namespaces / rlimits on this machine), `docker` (one container per sandbox), `remote` (a sandbox
hosted by `agentrl sandbox-server`), or one another package registers (entry-point group
`agentrl.sandboxes`). Backends are imported lazily so the docker SDK and aiohttp are only
needed by those who use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.envs.sandbox.base import ISOLATION_ORDER, ExecResult, Sandbox, SandboxError
from agentrl.envs.sandbox.registry import SANDBOXES
from agentrl.plugins import UnknownName

if TYPE_CHECKING:
    from agentrl.envs.sandbox.config import (
        DockerSandboxConfig,
        LocalSandboxConfig,
        PluginSandboxConfig,
        RemoteSandboxConfig,
    )

    AnySandboxConfig = LocalSandboxConfig | DockerSandboxConfig | RemoteSandboxConfig | PluginSandboxConfig

__all__ = ["ISOLATION_ORDER", "SANDBOXES", "ExecResult", "Sandbox", "SandboxError", "create"]


def create(config: AnySandboxConfig) -> Sandbox:
    """A not-yet-started sandbox of the backend `config.type` names."""
    try:
        cls = SANDBOXES.get(config.type)
    except UnknownName as exc:
        raise SandboxError(str(exc)) from None
    return cls(config)
