"""The one sandbox interface every backend implements, and what an `exec` returns.

Code an agent writes is hostile input: it runs only inside a `Sandbox` — a fresh
working directory and process tree with no network and resource limits. Backends
(`local`, `docker`, `remote`) differ in how they isolate, never in what callers see:

    async with create(config) as box:          # start() with the config's default image
        await box.write_file("a.py", "print(1)")
        result = await box.exec("python3 a.py", timeout=10)
        result.exit_code, result.stdout, result.timed_out
"""

from __future__ import annotations

import abc
import io
import os
import tarfile
from dataclasses import asdict, dataclass
from typing import Any

ISOLATION_ORDER = ("none", "rlimits", "namespaces", "bwrap", "docker")
"""Isolation levels from weakest to strongest (docker counts as at least bwrap)."""


class SandboxError(RuntimeError):
    """A sandbox could not be started or used (not: the command inside it failed)."""


@dataclass
class ExecResult:
    """What one command did. `exit_code` follows the shell: 128 + N when killed by signal N."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def local_directory(image_or_spec: str | None) -> str | None:
    """`image_or_spec` when it names a directory on this machine (a repository snapshot to copy
    into the sandbox) rather than an image."""
    return image_or_spec if image_or_spec and os.path.isdir(image_or_spec) else None


def tar_directory(path: str) -> bytes:
    """The contents of a host directory as an uncompressed tar (paths relative to it)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in sorted(os.listdir(path)):
            tar.add(os.path.join(path, name), arcname=name)
    return buffer.getvalue()


def isolation_at_least(have: str, want: str) -> bool:
    """Whether isolation level `have` is as strong as `want`."""
    return ISOLATION_ORDER.index(have) >= ISOLATION_ORDER.index(want)


def truncate_output(data: bytes, limit: int, dropped: int = 0) -> str:
    """Decode output, keeping the head and tail of it within `limit` bytes.

    `dropped` counts bytes a reader already discarded from the middle of the stream; the
    marker names the total removed so the model (and the user) can see output was cut."""
    if len(data) > limit:
        dropped += len(data) - limit
        head = limit // 2
        data = data[:head] + data[len(data) - (limit - head) :]
    if not dropped:
        return data.decode("utf-8", errors="replace")
    head = limit // 2
    return (
        data[:head].decode("utf-8", errors="replace")
        + f"\n[... {dropped} bytes truncated ...]\n"
        + data[head:].decode("utf-8", errors="replace")
    )


class OutputCapture:
    """Keeps the first and last `limit // 2` bytes of a stream and counts what it drops."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes) -> None:
        room = self.limit // 2 - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if not chunk:
            return
        self.tail += chunk
        keep = self.limit - self.limit // 2
        if len(self.tail) > keep:
            self.dropped += len(self.tail) - keep
            del self.tail[: len(self.tail) - keep]

    def text(self) -> str:
        return truncate_output(bytes(self.head + self.tail), self.limit, self.dropped)


class Sandbox(abc.ABC):
    """An isolated place to run commands. Use as `async with`, or call start() and close()."""

    isolation: str = "none"
    """The isolation level actually obtained (one of ISOLATION_ORDER), known after start()."""
    workdir: str = "/work"
    """The working directory inside the sandbox (where relative paths point)."""
    tmpdir: str = "/tmp"
    """A scratch directory inside the sandbox that write_file/read_file may use."""

    @abc.abstractmethod
    async def start(self, image_or_spec: str | None = None) -> None:
        """Create the sandbox from an image name (docker), a host directory whose contents become
        the working directory (a repository snapshot; every backend), or None for the default."""

    @abc.abstractmethod
    async def exec(
        self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        """Run `cmd` (a shell string, or an argv list) in the working directory. On timeout the
        whole process tree is killed and `timed_out` is set; it never raises for the command."""

    @abc.abstractmethod
    async def write_file(self, path: str, data: str | bytes) -> None:
        """Write a file inside the sandbox (relative to `workdir`), creating parent directories.
        Safe while sandboxed code runs: a path through a symbolic link raises PermissionError
        (local), or resolves inside the container (docker); a full disk quota raises OSError
        (ENOSPC)."""

    @abc.abstractmethod
    async def read_file(self, path: str) -> bytes:
        """Read a file from inside the sandbox; raises FileNotFoundError when it does not exist and
        PermissionError for a file larger than `max_file_size_mb` (and, locally, for a path
        through a symbolic link or to something not a regular file)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill everything still running and remove the sandbox. Safe to call twice."""

    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
