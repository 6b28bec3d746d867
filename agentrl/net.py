"""Loopback networking helpers shared by the launcher, the weight-sync rendezvous and the
benchmarks. Imports nothing heavy, so launchers stay fast."""

from __future__ import annotations

import socket


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
