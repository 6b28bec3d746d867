"""Fixtures for sandbox tests: local sandboxes at a given isolation, and a leftover-process check."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentrl.config import LocalSandboxConfig
from agentrl.envs.sandbox.local import LocalSandbox, available_isolation


def best_uid() -> int | None:
    return 424242 if os.geteuid() == 0 else None


AVAILABLE = available_isolation(best_uid())
needs_bwrap = pytest.mark.skipif(
    "bwrap" not in AVAILABLE,
    reason="bubblewrap is not installed or cannot create namespaces here (make system-deps, or apt-get install -y bubblewrap)",
)


def processes_with(marker: str) -> list[int]:
    """PIDs on this host whose command line contains `marker` (leftovers of a sandbox)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = (
                Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            continue
        if marker in cmdline:
            found.append(int(entry))
    return found


def local_config(isolation: str = "bwrap", **kwargs) -> LocalSandboxConfig:
    defaults = {"memory_mb": 256, "max_processes": 32, "timeout_s": 20, "max_output_bytes": 4096}
    return LocalSandboxConfig(isolation=isolation, min_isolation="none", **{**defaults, **kwargs})


@pytest.fixture
async def box() -> AsyncIterator[LocalSandbox]:
    """A started local sandbox under bubblewrap (tests using it are marked `needs_bwrap`)."""
    sandbox = LocalSandbox(local_config("bwrap"))
    await sandbox.start()
    yield sandbox
    await sandbox.close()
