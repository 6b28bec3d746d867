"""Loopback networking helpers shared by the launchers, the weight-sync rendezvous and the
benchmarks (`wait_healthy`: until started servers answer their health check). Imports nothing heavy, so launchers stay fast."""

from __future__ import annotations

import socket
import subprocess
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for rendezvous stores, servers and queues)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers(url: str, path: str = "/health", timeout_s: float = 2.0) -> bool:
    """Whether `url + path` answers 200 within `timeout_s` (a refused or timed-out request: no)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout_s) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_healthy(
    urls: list[str],
    children: list[subprocess.Popen] | None = None,
    timeout_s: float = 300,
    path: str = "/health",
) -> None:
    """Wait until every server answers `path`; fail early if one of `children` exits."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for proc in children or []:
            if proc.poll() is not None:
                raise RuntimeError(f"process {proc.args!r} exited with code {proc.returncode} while starting")
        pending = [url for url in pending if not answers(url, path)]
        if time.monotonic() > deadline:
            raise TimeoutError(f"inference servers {pending} not healthy after {timeout_s}s")
        time.sleep(0.3)
