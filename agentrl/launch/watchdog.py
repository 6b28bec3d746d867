"""The launchers' health watchdog: a server whose process lives on but that no longer answers its
health check is named, so its launcher stops it and the restart path for a dead child takes over.

A server can break without exiting: a vLLM server whose EngineCore crashed answers 503 on /health
and 500 to every request, for ever; a hung or stopped process answers nothing. The launchers
restart children that exit, so without this the router keeps such a server off, the rollers'
requests to it keep failing and the learner waits for a batch that never comes.

`HealthWatch.check` runs in every round of a launcher's main loop and never waits on the network:
it probes each running server's /health (`net.probe`, a GET with a short timeout) on a small thread
pool, at most one probe per server in flight, one every `interval_s`, and collects the answers of
finished probes. It names the servers that have not answered 200 for `unhealthy_after_s`
(`launcher.unhealthy_after_s`) since they last did, or, when they have not answered 200 since they
(re)started, within their backend's start-up timeout (a restarted server loads its model first).
A server paused for a weight push still answers /health 200 (the embedded server while its engine
thread runs, `inference/admin.py`; vLLM while its engine lives), so pushes never trigger it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from agentrl import net

PROBE_EVERY_S = 2.0
"""How often a running server's /health is probed."""
PROBE_TIMEOUT_S = 5.0
"""How long one probe waits for an answer."""
KILL_AFTER_S = 10.0
"""How long a launcher gives a server it stopped as unhealthy (SIGTERM) before SIGKILL."""


@dataclass
class _Seen:
    """What the watchdog knows of one incarnation (one process) of a server."""

    incarnation: Any
    since: float  # when this incarnation was first seen
    healthy_at: float | None = None  # when a probe last answered 200
    last: str = "no answer yet"  # what the last finished probe saw
    probed_at: float = -math.inf
    probe: Future | None = None
    reported: bool = False


class HealthWatch:
    """Probes servers' /health and names those to stop (see the module docstring); `clock`,
    `probe` and `pool` are the time, the GET and the threads it uses (a test passes its own)."""

    def __init__(
        self,
        unhealthy_after_s: float,
        startup_s: float,
        interval_s: float = PROBE_EVERY_S,
        timeout_s: float = PROBE_TIMEOUT_S,
        probe: Callable[[str, str, float], str | None] = net.probe,
        clock: Callable[[], float] | None = None,
        pool: Executor | None = None,
    ) -> None:
        self.unhealthy_after_s, self.startup_s = unhealthy_after_s, startup_s
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.probe, self.clock = probe, clock or time.monotonic
        self.pool = pool
        self.seen: dict[str, _Seen] = {}

    def check(self, servers: dict[str, tuple[str, Any]]) -> dict[str, str]:
        """One round over the running servers, {name: (base URL, incarnation)} — the incarnation
        (its pid) changes when the server is restarted, which starts its clock afresh. Returns
        {name: why} for each server that has just become due to be stopped (named once per
        incarnation); {} when `unhealthy_after_s` is 0 (the watchdog is off)."""
        if self.unhealthy_after_s <= 0:
            return {}
        now = self.clock()
        for gone in set(self.seen) - set(servers):
            del self.seen[gone]
        due = {}
        for name, (url, incarnation) in servers.items():
            s = self.seen.get(name)
            if s is None or s.incarnation != incarnation:
                s = self.seen[name] = _Seen(incarnation, now)
            if s.probe is not None and s.probe.done():
                seen, s.probe = _result(s.probe), None
                s.last = seen or "HTTP 200"
                if seen is None:
                    s.healthy_at = now
            if s.probe is None and now - s.probed_at >= self.interval_s:
                s.probe, s.probed_at = self._pool().submit(self.probe, url, "/health", self.timeout_s), now
            if not s.reported and (why := self._why(s, url, now)) is not None:
                s.reported = True
                due[name] = why
        return due

    def _why(self, s: _Seen, url: str, now: float) -> str | None:
        why = self._overdue(s, url, now)
        if why is not None and s.probe is not None:  # the newest probe has not come back yet
            why += f"; the probe sent {now - s.probed_at:.0f}s ago has not answered yet"
        return why

    def _overdue(self, s: _Seen, url: str, now: float) -> str | None:
        if s.healthy_at is not None:
            if now - s.healthy_at > self.unhealthy_after_s:
                return (
                    f"unhealthy: {url}/health has not answered 200 for {now - s.healthy_at:.0f}s "
                    f"(launcher.unhealthy_after_s); last probe seen: {s.last}"
                )
        elif now - s.since > max(self.startup_s, self.unhealthy_after_s):
            return (
                f"unhealthy: {url}/health has not answered 200 since the server started "
                f"{now - s.since:.0f}s ago (its backend's start-up timeout); last probe seen: {s.last}"
            )
        return None

    def _pool(self) -> Executor:
        if self.pool is None:
            self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="health-probe")
        return self.pool

    def close(self) -> None:
        """Drop the probes in flight (each ends within its timeout on its own)."""
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _result(probe: Future) -> str | None:
    try:
        return probe.result()
    except Exception as exc:  # a probe that failed in itself saw no healthy answer
        return f"{type(exc).__name__}: {exc}"
