"""Loopback networking helpers shared by the launcher, the weight-sync rendezvous and the
benchmarks. Imports nothing heavy, so launchers stay fast."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for rendezvous stores, servers and queues)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
