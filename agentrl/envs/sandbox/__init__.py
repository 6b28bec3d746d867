"""Sandboxes for code an agent writes: one interface (`Sandbox`), three backends.

`create(config)` picks the backend by `config.type`: `local` (bubblewrap / namespaces /
rlimits on this machine), `docker` (one container per sandbox) or `remote` (a sandbox
hosted by `agentrl sandbox-server`). Backends are imported lazily so the docker SDK
and aiohttp are only needed by those who use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.envs.sandbox.base import ISOLATION_ORDER, ExecResult, Sandbox, SandboxError

if TYPE_CHECKING:
    from agentrl.config import DockerSandboxConfig, LocalSandboxConfig, RemoteSandboxConfig

__all__ = ["ISOLATION_ORDER", "ExecResult", "Sandbox", "SandboxError", "create"]


def create(config: LocalSandboxConfig | DockerSandboxConfig | RemoteSandboxConfig) -> Sandbox:
    """A not-yet-started sandbox of the backend `config.type` names."""
    if config.type == "local":
        from agentrl.envs.sandbox.local import LocalSandbox

        return LocalSandbox(config)
    if config.type == "docker":
        from agentrl.envs.sandbox.docker import DockerSandbox

        return DockerSandbox(config)
    if config.type == "remote":
        from agentrl.envs.sandbox.remote import RemoteSandbox

        return RemoteSandbox(config)
    raise SandboxError(f"sandbox.type: unknown backend {config.type!r}; use local, docker or remote")
