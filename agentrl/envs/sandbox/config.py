"""The sandbox config section (`env.sandbox:`): one model per built-in backend, and one for a
backend another package registers, chosen by `type`.

Kept beside the sandboxes; `agentrl/envs/config.py` holds it in the env section. A `type` that is
not a built-in's is checked against `agentrl/envs/sandbox/registry.py` (a table of names; the
backends themselves are imported only when used).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from agentrl.section import Section

IsolationLevel = Literal["none", "rlimits", "namespaces", "bwrap"]


class _SandboxLimits(Section):
    """Limits every sandbox backend enforces on the code it runs."""

    timeout_s: float = Field(60.0, gt=0)
    """Default wall-clock limit of one `exec`; the whole process tree is killed when it passes."""
    memory_mb: int = Field(1024, ge=16)
    """Memory limit of the sandbox (all its processes together where cgroups or Docker allow)."""
    max_processes: int = Field(64, ge=1)
    """Processes/threads the sandbox may run at once (contains fork bombs)."""
    max_output_bytes: int = Field(65536, ge=256)
    """stdout and stderr of one `exec` are each cut to this size (head and tail kept, marker between)."""
    max_file_size_mb: int = Field(256, ge=1)
    """Largest file a sandboxed process may write (RLIMIT_FSIZE); also the most read_file returns."""
    disk_mb: int = Field(1024, ge=0)
    """Disk quota of the sandbox: all it writes together (local: its work and tmp dirs, on a
    filesystem of this size mounted when started as root; docker: the container's writable layer
    where the storage driver supports a size). Writes past it fail with ENOSPC. 0: no quota."""
    workdir: str = "/work"
    """Working directory inside the sandbox; relative paths of read_file/write_file start here."""


class LocalSandboxConfig(_SandboxLimits):
    """Processes on this machine, isolated with bubblewrap or Linux namespaces plus rlimits/cgroups."""

    type: Literal["local"] = "local"
    isolation: Literal["auto", "none", "rlimits", "namespaces", "bwrap"] = "auto"
    """Isolation to use: `auto` takes the strongest available (bwrap > namespaces > rlimits)."""
    min_isolation: IsolationLevel = "bwrap"
    """Weakest isolation accepted: starting a sandbox with less fails (untrusted code never runs)."""
    cpu_time_s: int = Field(120, ge=1)
    """CPU seconds each process may use (RLIMIT_CPU)."""
    ro_paths: list[str] = Field(default_factory=list)
    """Extra host paths bound read-only at the same place (e.g. a Python prefix outside /usr)."""
    python_packages: list[str] = Field(default_factory=list)
    """Pure-Python packages of agentrl's own interpreter made importable inside (e.g. [pytest])."""
    root_dir: str | None = None
    """Host directory the sandboxes' working directories are created in (default: the system temp dir)."""
    uid: int | None = Field(None, ge=1)
    """When started as root: the unprivileged uid sandboxed code runs as (default: a random high uid)."""
    seccomp: bool = True
    """Under bubblewrap, load a seccomp filter refusing new namespaces, mounts and other kernel-wide
    calls to the code inside (`envs/sandbox/seccomp.py`)."""


class DockerSandboxConfig(_SandboxLimits):
    """One Docker container per sandbox, network disabled, removed on close."""

    type: Literal["docker"] = "docker"
    image: str = "agentrl/python-sandbox:latest"
    """Default image when `start()` is not given one (a task's own image wins)."""
    cpus: float = Field(1.0, gt=0)
    """CPUs the container may use (Docker's nano_cpus)."""
    docker_host: str | None = None
    """Docker engine URL, e.g. unix:///var/run/docker.sock; default: DOCKER_HOST or the local socket."""


class RemoteSandboxConfig(Section):
    """A sandbox hosted by `agentrl sandbox-server` on another machine, reached over HTTP.
    Limits and isolation are the server's own (its `--backend` config); it reports them."""

    type: Literal["remote"] = "remote"
    url: str = "http://127.0.0.1:8765"
    """Base URL of the sandbox server."""
    api_key_env: str = "AGENTRL_SANDBOX_KEY"
    """Environment variable holding the API key the server expects."""
    timeout_s: float = Field(60.0, gt=0)
    """Default wall-clock limit of one `exec` (the server caps it at its own limit)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Time to wait for the server to answer before the call fails."""


class PluginSandboxConfig(Section):
    """A sandbox backend another package registers (entry-point group `agentrl.sandboxes`); its
    class gets this section, `options` as given."""

    type: str = "plugin"
    """The name the package registers."""
    options: dict[str, Any] = Field(default_factory=dict)
    """Settings of that backend, passed to it as given."""

    @field_validator("type")
    @classmethod
    def _registered(cls, value: str) -> str:
        from agentrl.envs.sandbox.registry import SANDBOXES

        return SANDBOXES.require(value)


_BUILTIN_SANDBOXES = ("local", "docker", "remote")


def _sandbox_tag(value: Any) -> str:
    """The built-in's own section for its `type`, `plugin` for any other name."""
    kind = value.get("type", "local") if isinstance(value, dict) else getattr(value, "type", "local")
    return kind if kind in _BUILTIN_SANDBOXES else "plugin"


SandboxConfig = Annotated[
    Annotated[LocalSandboxConfig, Tag("local")]
    | Annotated[DockerSandboxConfig, Tag("docker")]
    | Annotated[RemoteSandboxConfig, Tag("remote")]
    | Annotated[PluginSandboxConfig, Tag("plugin")],
    Discriminator(_sandbox_tag),
]
