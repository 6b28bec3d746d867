"""Which inference servers are up, and at which weight version, probed in the background.

A weight push must not wait on a server that is gone or silent, and a server that comes
back (restarted on the same address, or back after a partition) must be brought to the
learner's version before rollers use it again, without waiting for the next trained step.
`ServerWatch` probes every server concurrently on the weight-sync engine's event loop
(`AsyncBridge`), each probe bounded by `timeout_s` (alive, then the weight version),
one round every `interval_s`, and keeps the last answers. Each round probes the servers in
`clients` at that time: the engine adds a server to it (and `forget`s one) as the launcher's
live server list moves (`inference.server_list`). `fresh(since)` returns what the
probes started after `since` saw, without blocking; `probe_now(urls)` asks again at once
and waits, but never for a server whose last probe timed out.

A server that accepts TCP but never answers is "down" here after `timeout_s`, in the
background, so it costs a push nothing (it used to cost every later push one health-check
timeout, ~10 s).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.inference.base import WeightUpdateClient
    from agentrl.weight_sync.base import AsyncBridge

logger = get_logger(__name__)

DOWN = -1
"""Version recorded for a server that did not answer its probe."""


class ServerWatch:
    """Background probes of `clients` ({url: client}); started on `bridge`'s loop."""

    def __init__(
        self,
        clients: dict[str, WeightUpdateClient],
        bridge: AsyncBridge,
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
    ) -> None:
        self.clients = clients
        self.bridge = bridge
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._seen: dict[str, tuple[float, int]] = {}  # url -> (start of the probe, version or DOWN)
        self._silent: set[str] = set()  # whose last probe timed out
        self._future = None

    def start(self) -> None:
        self._future = self.bridge.submit(self._probe_loop())

    def stop(self) -> None:
        if self._future is not None:
            self._future.cancel()
            self._future = None

    def fresh(self, since: float) -> dict[str, int]:
        """{url: version, or DOWN} from probe rounds that started after `since` (time.monotonic)."""
        return {url: v for url, (at, v) in dict(self._seen).items() if at > since}

    def last(self, url: str) -> int | None:
        """The version (or DOWN) of `url`'s last probe; None before its first."""
        seen = self._seen.get(url)
        return None if seen is None else seen[1]

    def probe_now(self, urls: list[str]) -> None:
        """Probe `urls` at once and wait for the answers, except those whose last probe timed out
        (silent servers are left to the background: they would cost this caller the timeout)."""
        urls = [u for u in urls if u not in self._silent]
        if not urls:
            return
        started = time.monotonic()

        async def every() -> list[int]:
            return await asyncio.gather(*(self._probe(u) for u in urls))

        self._record(urls, self.bridge.run(every(), timeout_s=2 * self.timeout_s + 1), started)

    def forget(self, urls: list[str]) -> None:
        """Stop probing `urls` (removed from the server list)."""
        for url in urls:
            self._seen.pop(url, None)
            self._silent.discard(url)

    async def _probe(self, url: str) -> int:
        client = self.clients.get(url)
        if client is None:  # removed from the server list while this round ran
            return DOWN
        try:
            if not await asyncio.wait_for(client.alive(), self.timeout_s):
                version = DOWN
            else:
                version = await asyncio.wait_for(client.get_weight_version(), self.timeout_s)
        except asyncio.TimeoutError:  # accepts connections, does not answer
            self._silent.add(url)
            return DOWN
        except Exception:  # unreachable, or an answer we cannot read: down for now
            version = DOWN
        self._silent.discard(url)
        return version

    def _record(self, urls: list[str], versions: list[int], started: float) -> None:
        for url, version in zip(urls, versions, strict=True):
            if url not in self.clients:  # removed while probed
                continue
            previous = self._seen.get(url, (0.0, None))[1]
            if previous is not None and (previous == DOWN) != (version == DOWN):
                logger.info("server %s is %s", url, "down" if version == DOWN else f"up at version {version}")
            self._seen[url] = (started, version)

    async def _probe_loop(self) -> None:
        while True:
            urls = list(self.clients)  # the engine adds and removes servers as the live list moves
            started = time.monotonic()
            self._record(urls, await asyncio.gather(*(self._probe(u) for u in urls)), started)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
