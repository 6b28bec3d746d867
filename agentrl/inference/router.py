"""A router over many inference servers with the same interface as one client.

Rollers generate through it without knowing how many servers exist. It sends each request
to the usable server with the fewest outstanding requests, except that the turns of one
episode (`session_id`) stay on the server that served its previous turn (its prefix cache
holds the conversation so far) while that server is usable. A server is usable when it is
healthy and its weight version is inside the admissible window: at least the learner's
version minus `max_staleness`. The learner's version is the one the queue reports
(`learner_version`); before the queue has said it, the newest version any server reported
stands in (the learner publishes a version before it pushes it, so no server is ahead of the
learner). A server restarted at an old version therefore gets no work until the learner has
pushed the current weights to it. After a resume from an older checkpoint the versions pushed
since it are gone, and the window follows the learner back down.

A request that fails because its server is unreachable, times out or errors (5xx) is
retried on another server. A server that answers with its own failure (`ServerError`: its
engine failed the request, e.g. on NaN weights) is held back from routing — `HOLD_FIRST_S` after
its first such failure, twice as long after each next one in a row, up to `HOLD_MAX_S` — even
while its health check answers, and gets work again when the hold ends; one success ends its run
of failures. So a server whose every request fails is marked unhealthy and its error reaches the
rollers (`RequestLostError` carries it), instead of absorbing every request. When no server is
usable (all down, failing, or all behind the window) the request waits for one — probing at
once, then after `FIRST_PROBE_S` and twice as long each time up to `probe_interval_s`, waiters
that wake together sharing one probe — for at most `server_wait_s`, instead of burning its
retries on a server that is restarting. After `max_retries + 1` failures, or that long without a usable server, it
raises `RequestLostError`, counted in `stats["lost"]` — a request is never dropped silently
and never waits without a bound. A background `_health_loop` marks servers down and up
again and reads their versions. Admin calls (pause, continue, abort) fan out to
every server; weight updates go to each server's own `WeightUpdateClient` (`weight_sync/`).

The server set can change while the run goes on: `set_servers(epoch, urls)` swaps it for the
launcher's live list, which the queue carries to the rollers (`inference.server_list`).

Start-up: `Router(clients)` or `from_config(inference, max_staleness)` (a router even over
one server, so a roller waits out a restart); the health loop starts on first use (or
`await start()`). Shutdown: `await close()` cancels the loop and closes every client.

The module runs past 500 lines because it is one class whose parts (routing, failover and holds,
the live list, the health loop) all read and write the same per-server state, kept aligned by
index; a split would pass that state between modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.inference.base import (
    BadRequestError,
    GenerateResult,
    InferenceClient,
    InferenceError,
    RequestLostError,
    ServerError,
    ServerUnavailableError,
)
from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.inference.config import InferenceConfig

logger = get_logger(__name__)

FIRST_PROBE_S = 0.02  # the first wait between probes while no server is usable (then doubled)
HOLD_FIRST_S = 1.0  # how long a server that failed a request with its own error gets no work (then doubled)
HOLD_MAX_S = 30.0  # the longest such hold


def create(config: InferenceConfig, urls: list[str] | None = None) -> InferenceClient:
    """A client for `config.type` (`inference/registry.py`): one server gives its client, several
    give a `Router` over them."""
    from agentrl.inference.registry import client

    urls = list(urls if urls is not None else config.servers)
    if not urls:
        raise ValueError("inference: no server URLs given (set inference.servers)")
    if len(urls) == 1:
        return client(config, urls[0])
    return Router(
        [client(config, u) for u in urls],
        max_retries=config.max_retries,
        request_timeout_s=config.request_timeout_s,
        health_interval_s=config.health_check_interval_s,
    )


def from_config(config: InferenceConfig, max_staleness: int | None = None, lora: str | None = None) -> Router:
    """A router over `config.servers` (even one), waiting up to `config.server_wait_s` for a server;
    `set_servers` later creates the clients of new URLs the same way. `lora`: the adapter base every
    request names (its newest served version; `registry.adapter_base`)."""
    from agentrl.inference.registry import client

    if not config.servers:
        raise ValueError("inference: no server URLs given (set inference.servers)")
    return Router(
        [client(config, url, lora) for url in config.servers],
        client_factory=lambda url: client(config, url, lora),
        max_retries=config.max_retries,
        request_timeout_s=config.request_timeout_s,
        health_interval_s=config.health_check_interval_s,
        server_wait_s=config.server_wait_s,
        max_staleness=max_staleness,
    )


@dataclass
class _Failing:
    """A server's run of `ServerError`s with no success between them."""

    count: int
    held_until: float  # time.monotonic() before which it gets no work
    error: str


class Router(InferenceClient):
    """Least-outstanding-requests routing, sticky sessions, health and version checks, failover."""

    def __init__(
        self,
        clients: list[InferenceClient],
        max_retries: int = 2,
        request_timeout_s: float = 300.0,
        health_interval_s: float = 5.0,
        max_sessions: int = 100_000,
        server_wait_s: float = 0.0,
        max_staleness: int | None = None,
        probe_interval_s: float = 0.5,
        client_factory: Callable[[str], InferenceClient] | None = None,
    ) -> None:
        if not clients:
            raise ValueError("Router needs at least one client")
        self.clients = list(clients)
        self.client_factory = client_factory
        self.servers_epoch: int | None = None  # the live server list's epoch last applied
        self._retired: dict[int, tuple[InferenceClient, int]] = {}  # removed, requests still in flight
        self._probe_task: asyncio.Task | None = None  # the probe of servers new in the list
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.health_interval_s = health_interval_s
        self.max_sessions = max_sessions
        self.server_wait_s = server_wait_s
        self.max_staleness = max_staleness
        self.probe_interval_s = probe_interval_s
        self.outstanding = [0] * len(clients)
        self.healthy = [True] * len(clients)
        self.versions: list[int | None] = [None] * len(clients)  # last version each reported
        self.newest = -1  # the newest version any server reported
        self.learner = -1  # the learner's version as the queue reported it (-1: not yet)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._health_task: asyncio.Task | None = None
        self._probe_lock = asyncio.Lock()
        self._last_probe = float("-inf")
        self._last_wait_log = float("-inf")
        self.stats = {"requests": 0, "completed": 0, "retries": 0, "lost": 0, "bad_requests": 0,
                      "server_errors": 0, "waits": 0, "waited_s": 0.0}  # fmt: skip
        self._failing: dict[int, _Failing] = {}  # by id(client): servers failing with their own error
        self.served: dict[str, int] = {}  # requests completed, per server URL
        self.url = ",".join(c.url for c in clients)

    # ------------------------------------------------------------------ routing

    def floor(self) -> int | None:
        """The oldest weight version a server may generate with (None: no bound)."""
        newest = self.learner if self.learner >= 0 else self.newest
        if self.max_staleness is None or newest < 0:
            return None
        return newest - self.max_staleness

    def learner_version(self, version: int) -> None:
        """The learner's version, as the queue reported it: the top of the admissible window."""
        before = self.learner if self.learner >= 0 else self.newest
        if 0 <= version < before:
            logger.warning("the learner's version went back from %d to %d (resumed from an older "
                           "checkpoint): the admissible window follows it", before, version)  # fmt: skip
        self.learner = version

    def _usable(self, i: int) -> bool:
        floor, version = self.floor(), self.versions[i]
        failing = self._failing.get(id(self.clients[i]))
        if failing is not None and time.monotonic() < failing.held_until:
            return False
        return self.healthy[i] and (floor is None or version is None or version >= floor)

    def _seen_version(self, i: int, version: int | None) -> None:
        self.versions[i] = version
        if version is not None:
            self.newest = max(self.newest, version)

    def _pick(self, session_id: str | None, tried: set[int]) -> int | None:
        """`tried`: the ids of the clients this request failed on (ids, not indices: the server
        list may be swapped while it runs)."""
        if session_id is not None:
            idx = self._sessions.get(session_id)
            if idx is not None and id(self.clients[idx]) not in tried and self._usable(idx):
                self._sessions.move_to_end(session_id)
                return idx
        candidates = [i for i, c in enumerate(self.clients) if id(c) not in tried and self._usable(i)]
        if not candidates:
            return None
        return min(candidates, key=lambda i: (self.outstanding[i], i))

    def _remember(self, session_id: str | None, idx: int) -> None:
        if session_id is None:
            return
        self._sessions[session_id] = idx
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        self._ensure_health_loop()
        self.stats["requests"] += 1
        tried: set[int] = set()
        errors: list[str] = []
        failures, deadline = 0, None
        while failures <= self.max_retries:
            idx = self._pick(session_id, tried)
            if idx is None:  # no usable server left to try: wait (bounded) for one to come back
                loop = asyncio.get_running_loop()
                deadline = deadline if deadline is not None else loop.time() + self.server_wait_s
                if not await self._wait_usable(deadline):
                    errors.append(self._unusable_reason())
                    break
                tried.clear()
                continue
            client = self.clients[idx]
            tried.add(id(client))
            self.outstanding[idx] += 1  # the list may be swapped while this runs: `_index` finds it again
            try:
                result = await asyncio.wait_for(
                    client.generate(input_ids, sampling_params, rid=rid, session_id=session_id),
                    self.request_timeout_s,
                )
            except BadRequestError:
                self.stats["bad_requests"] += 1
                raise
            except (ServerUnavailableError, asyncio.TimeoutError, InferenceError) as exc:
                errors.append(f"{client.url}: {type(exc).__name__}: {exc}")
                if (idx := self._index(client)) is not None:
                    self.healthy[idx] = False
                if isinstance(exc, ServerError):
                    self._server_failed(client, str(exc))
                failures += 1
                if failures <= self.max_retries:
                    self.stats["retries"] += 1
                logger.warning(
                    "request failed on %s (%s); %s",
                    client.url,
                    exc,
                    "retrying" if failures <= self.max_retries else "giving up",
                )
                continue
            finally:
                self._finished(client)
            if (idx := self._index(client)) is not None:
                self._remember(session_id, idx)
                self._seen_version(idx, result.weight_version)
            if self._failing.pop(id(client), None) is not None:
                logger.warning("server %s serves requests again", client.url)
            self.stats["completed"] += 1
            self.served[client.url] = self.served.get(client.url, 0) + 1
            if self.served[client.url] == 1:
                logger.info("server %s served its first request", client.url)
            result.server = client.url
            return result
        self.stats["lost"] += 1
        raise RequestLostError(
            f"request lost after {failures} failure(s) on {len(self.clients)} server(s): "
            f"{'; '.join(errors) or 'no server'}"
        )

    def _server_failed(self, client: InferenceClient, error: str) -> None:
        """Hold `client`'s server back: it answered a request with its own failure."""
        self.stats["server_errors"] += 1
        failing = self._failing.get(id(client))
        count = failing.count + 1 if failing is not None else 1
        hold = min(HOLD_FIRST_S * 2 ** (count - 1), HOLD_MAX_S)
        self._failing[id(client)] = _Failing(count, time.monotonic() + hold, error)
        if count == 1 or hold < HOLD_MAX_S:
            logger.error("server %s failed %d request(s) in a row with its own error; no work for it "
                         "for %.0fs: %s", client.url, count, hold, error)  # fmt: skip

    def _index(self, client: InferenceClient) -> int | None:
        return next((i for i, c in enumerate(self.clients) if c is client), None)

    def _finished(self, client: InferenceClient) -> None:
        idx = self._index(client)
        if idx is not None:
            self.outstanding[idx] -= 1
            return
        retired, left = self._retired.pop(id(client), (client, 1))
        if left > 1:
            self._retired[id(client)] = (retired, left - 1)
        else:  # the last request on a removed server is done: close its client
            asyncio.get_running_loop().create_task(retired.close())

    # ------------------------------------------------------------------ the live server list

    def set_servers(self, epoch: int, urls: list[str]) -> bool:
        """Swap the server set for the launcher's live list (`inference.server_list`) when `epoch`
        is newer than the last applied; True when it was. A kept URL keeps its client, health,
        version and sessions; a new one gets a client from `client_factory` (usable once a probe,
        started at once, finds it up and inside the window, like a restarted server); a removed one gets no new request, and its
        requests in flight finish, or fail over as on a dead server, before its client is closed."""
        if self.servers_epoch is not None and epoch <= self.servers_epoch:
            return False
        if not urls:
            logger.error("server list epoch %d is empty: keeping %s", epoch, self.url)
            return False
        by_url = {c.url: i for i, c in enumerate(self.clients)}
        new = [u for u in urls if u not in by_url]
        if new and self.client_factory is None:
            raise ValueError("Router.set_servers: new URLs need a client_factory")
        old_clients, old_outstanding = self.clients, self.outstanding
        keep = [by_url.get(u) for u in urls]
        self._realign(urls, keep)
        gone = [i for i in range(len(old_clients)) if i not in keep]
        self._retire([(old_clients[i], old_outstanding[i]) for i in gone])
        self.servers_epoch = epoch
        self.url = ",".join(c.url for c in self.clients)
        if new:
            with contextlib.suppress(RuntimeError):  # probe the new ones now, not at the next round
                self._probe_task = asyncio.get_running_loop().create_task(self.check_health())
        removed = [old_clients[i].url for i in gone]
        logger.log(logging.WARNING if new or removed else logging.INFO,
                   "server list epoch %d: routing to %s (added %s, removed %s)", epoch, self.url, new,
                   removed)  # fmt: skip
        return True

    def _realign(self, urls: list[str], keep: list[int | None]) -> None:
        """Per-server state in the order of `urls`: a kept server's (`keep[j]`: its old index) moves
        with it, sessions follow their server or are dropped with it; a new server gets a client and
        is not used before a probe read its version: it may still be at the one it started with,
        until the learner's catch-up push (then the window admits it)."""
        old_clients, outstanding, healthy, versions = (
            self.clients,
            self.outstanding,
            self.healthy,
            self.versions,
        )
        self.clients = [
            old_clients[i] if i is not None else self.client_factory(u)
            for u, i in zip(urls, keep, strict=True)
        ]
        self.outstanding = [outstanding[i] if i is not None else 0 for i in keep]
        self.healthy = [healthy[i] if i is not None else False for i in keep]
        self.versions = [versions[i] if i is not None else None for i in keep]
        moved = {old: new_i for new_i, old in enumerate(keep) if old is not None}
        for sid, old in list(self._sessions.items()):
            if old in moved:
                self._sessions[sid] = moved[old]
            else:
                del self._sessions[sid]

    def _retire(self, gone: list[tuple[InferenceClient, int]]) -> None:
        """Removed servers (client, requests in flight): closed now when idle, else when their last
        request is done (`_finished`)."""
        for client, in_flight in gone:
            self._failing.pop(id(client), None)
            if in_flight > 0:
                self._retired[id(client)] = (client, in_flight)
            else:
                with contextlib.suppress(RuntimeError):  # no running loop: nothing to close on
                    asyncio.get_running_loop().create_task(client.close())

    async def _wait_usable(self, deadline: float) -> bool:
        """Probe until a server is usable or `deadline` passes; True when one is. The wait between
        probes starts at FIRST_PROBE_S and doubles up to `probe_interval_s` (waiters that wake
        together share one probe): a server behind the window is usually waiting for a push that is under
        way (at max_staleness 0 every step waits for one), a restarting one for seconds."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = interval = min(FIRST_PROBE_S, self.probe_interval_s)
        try:
            while True:
                async with self._probe_lock:  # after each wait, unless another waiter just probed
                    if loop.time() - self._last_probe >= first / 2:
                        await self.check_health()
                        self._last_probe = loop.time()
                if any(self._usable(i) for i in range(len(self.clients))):
                    return True
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                if loop.time() - self._last_wait_log >= 10:
                    self._last_wait_log = loop.time()
                    logger.warning("%s; waiting up to %.0fs for one (inference.server_wait_s)",
                                   self._unusable_reason(), remaining)  # fmt: skip
                await asyncio.sleep(min(interval, remaining))
                interval = min(2 * interval, self.probe_interval_s)
        finally:
            waited = loop.time() - started
            if waited > 0.01:
                self.stats["waits"] += 1
                self.stats["waited_s"] += waited

    def _unusable_reason(self) -> str:
        failing = {id(c): f for c in self.clients if (f := self._failing.get(id(c))) is not None}
        down = [
            c.url for c, ok in zip(self.clients, self.healthy, strict=True) if not ok and id(c) not in failing
        ]
        held = [
            f"{c.url} ({f.count} in a row, last: {f.error[:300]})"
            for c in self.clients
            if (f := failing.get(id(c)))
        ]
        behind = [
            f"{c.url} at version {v}"
            for i, (c, v) in enumerate(zip(self.clients, self.versions, strict=True))
            if self.healthy[i] and id(c) not in failing and not self._usable(i)
        ]
        parts = (
            ([f"down: {', '.join(down)}"] if down else [])
            + ([f"failing requests with their own error: {'; '.join(held)}"] if held else [])
            + (
                [f"behind the admissible window (>= version {self.floor()}): {', '.join(behind)}"]
                if behind
                else []
            )
        )
        return "no usable inference server (" + "; ".join(parts or ["none configured"]) + ")"

    # ------------------------------------------------------------------ health

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name="health_loop"
            )

    async def start(self) -> None:
        self._ensure_health_loop()

    async def check_health(self) -> list[bool]:
        """Probe every server once (health, then weight version; each bounded) and update `healthy`
        and `versions`."""
        timeout = max(1.0, self.health_interval_s)

        async def probe(c: InferenceClient) -> tuple[bool, int | None]:
            try:
                if not await asyncio.wait_for(c.health(), timeout):
                    return False, None
            except (asyncio.TimeoutError, InferenceError):
                return False, None
            try:
                return True, await asyncio.wait_for(c.get_weight_version(), timeout)
            except (asyncio.TimeoutError, InferenceError, KeyError, TypeError):
                return True, None  # up, version unknown: not held back by the window

        clients = list(self.clients)
        results = await asyncio.gather(*(probe(c) for c in clients))
        if clients != self.clients:  # swapped while probing: these answers are for the old list
            return [ok for ok, _ in results]
        for i, (ok, version) in enumerate(results):
            if ok != self.healthy[i]:
                logger.info(
                    "server %s is %s", self.clients[i].url, f"up at version {version}" if ok else "down"
                )
            self.healthy[i] = ok
            if ok:
                self._seen_version(i, version)
        return [ok for ok, _ in results]

    async def _health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval_s)

    async def health(self) -> bool:
        return any(await self.check_health())

    # ------------------------------------------------------------------ admin: fan out to all servers

    async def _all(self, name: str, *args: Any, **kwargs: Any) -> list[Any]:
        results = await asyncio.gather(
            *(getattr(c, name)(*args, **kwargs) for c in self.clients), return_exceptions=True
        )
        failed = [
            f"{c.url}: {r}"
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            raise InferenceError(
                f"{name} failed on {len(failed)}/{len(self.clients)} servers: {'; '.join(failed)}"
            )
        return results

    async def get_weight_version(self) -> int:
        """The oldest version any server reports (the one that bounds staleness)."""
        return min(await self._all("get_weight_version"))

    async def pause_generation(self) -> None:
        await self._all("pause_generation")

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._all("abort_request", rid, abort_all)

    async def close(self) -> None:
        for task in (self._health_task, self._probe_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        retired = [c for c, _ in self._retired.values()]
        self._retired.clear()
        await asyncio.gather(*(c.close() for c in self.clients + retired), return_exceptions=True)
