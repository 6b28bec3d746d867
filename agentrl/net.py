"""Loopback networking helpers shared by the launchers, the weight-sync rendezvous and the
benchmarks (`wait_healthy`: until started servers answer their health check). Imports nothing heavy, so launchers stay fast."""

from __future__ import annotations

import random
import socket
import subprocess
import time


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for `bind(0)` / outgoing connections (Linux's
    ip_local_port_range; 32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for rendezvous stores, servers and queues), drawn
    below the kernel's ephemeral range: a port the kernel gave us for `bind(0)` is one it may give
    the next process that binds 0 as soon as we release it (vLLM's engine sockets took a queue
    port that way between the pick and the bind), which a port outside that range never is."""
    low = _ephemeral_low()
    if low > 11024:
        for _ in range(64):
            port = random.randrange(low - 10000, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def answers(url: str, path: str = "/health", timeout_s: float = 2.0) -> bool:
    """Whether `url + path` answers 200 within `timeout_s` (a refused or timed-out request: no)."""
    return probe(url, path, timeout_s) is None


def probe(url: str, path: str = "/health", timeout_s: float = 2.0) -> str | None:
    """None when `url + path` answers 200 within `timeout_s`; otherwise what was seen instead:
    `HTTP 503`, `no answer in 2s`, or the connection's error (`Connection refused`)."""
    import http.client
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=timeout_s) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return f"no answer in {timeout_s:g}s"
        return str(getattr(exc.reason, "strerror", None) or exc.reason)
    except TimeoutError:
        return f"no answer in {timeout_s:g}s"
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"


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
