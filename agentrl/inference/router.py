"""A router over many inference servers with the same interface as one client.

Rollers generate through it without knowing how many servers exist. It sends each request
to the healthy server with the fewest outstanding requests, except that the turns of one
episode (`session_id`) stay on the server that served its previous turn (its prefix cache
holds the conversation so far) while that server is healthy. A request that fails because
its server is unreachable, times out or errors (5xx) is retried on another server; after
`max_retries` retries it raises `RequestLostError`, counted in `stats["lost"]` — a request
is never dropped silently and never waits without a timeout. A background `_health_loop`
marks servers down and up again. Admin calls (weight updates, pause, abort) fan out to
every server.

Start-up: `Router(clients)`; the health loop starts on first use (or `await start()`).
Shutdown: `await close()` cancels the loop and closes every client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from typing import Any

from agentrl.inference.base import (
    BadRequestError,
    GenerateResult,
    InferenceClient,
    InferenceError,
    RequestLostError,
    ServerUnavailableError,
)
from agentrl.log import get_logger

logger = get_logger(__name__)


class Router(InferenceClient):
    """Least-outstanding-requests routing, sticky sessions, health checks and failover."""

    def __init__(
        self,
        clients: list[InferenceClient],
        max_retries: int = 2,
        request_timeout_s: float = 300.0,
        health_interval_s: float = 5.0,
        max_sessions: int = 100_000,
    ) -> None:
        if not clients:
            raise ValueError("Router needs at least one client")
        self.clients = clients
        self.max_retries = max_retries
        self.request_timeout_s = request_timeout_s
        self.health_interval_s = health_interval_s
        self.max_sessions = max_sessions
        self.outstanding = [0] * len(clients)
        self.healthy = [True] * len(clients)
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._health_task: asyncio.Task | None = None
        self.stats = {"requests": 0, "completed": 0, "retries": 0, "lost": 0, "bad_requests": 0}
        self.url = ",".join(c.url for c in clients)

    # ------------------------------------------------------------------ routing

    def _pick(self, session_id: str | None, tried: set[int]) -> int | None:
        if session_id is not None:
            idx = self._sessions.get(session_id)
            if idx is not None and idx not in tried and self.healthy[idx]:
                self._sessions.move_to_end(session_id)
                return idx
        candidates = [i for i in range(len(self.clients)) if i not in tried and self.healthy[i]]
        if not candidates:  # every untried server looks down: try one anyway rather than give up early
            candidates = [i for i in range(len(self.clients)) if i not in tried]
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
        for attempt in range(self.max_retries + 1):
            idx = self._pick(session_id, tried)
            if idx is None:
                break
            tried.add(idx)
            client = self.clients[idx]
            self.outstanding[idx] += 1
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
                self.healthy[idx] = False
                if attempt < self.max_retries:
                    self.stats["retries"] += 1
                logger.warning(
                    "request failed on %s (%s); %s",
                    client.url,
                    exc,
                    "retrying" if attempt < self.max_retries else "giving up",
                )
                continue
            finally:
                self.outstanding[idx] -= 1
            self._remember(session_id, idx)
            self.stats["completed"] += 1
            result.server = client.url
            return result
        self.stats["lost"] += 1
        raise RequestLostError(
            f"request lost after {len(tried)} server(s): {'; '.join(errors) or 'no server'}"
        )

    # ------------------------------------------------------------------ health

    def _ensure_health_loop(self) -> None:
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(
                self._health_loop(), name="health_loop"
            )

    async def start(self) -> None:
        self._ensure_health_loop()

    async def check_health(self) -> list[bool]:
        """Probe every server once (bounded by its connect timeout) and update `healthy`."""

        async def probe(c: InferenceClient) -> bool:
            try:
                return await asyncio.wait_for(c.health(), max(1.0, self.health_interval_s))
            except (asyncio.TimeoutError, InferenceError):
                return False

        results = await asyncio.gather(*(probe(c) for c in self.clients))
        for i, ok in enumerate(results):
            if ok != self.healthy[i]:
                logger.info("server %s is %s", self.clients[i].url, "up" if ok else "down")
            self.healthy[i] = ok
        return list(results)

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

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Server i joins as rank `rank_offset + i` (one GPU per server, SGLang's numbering)."""
        results = await asyncio.gather(
            *(
                c.init_weights_update_group(
                    master_address, master_port, rank_offset + i, world_size, group_name, backend
                )
                for i, c in enumerate(self.clients)
            ),
            return_exceptions=True,
        )
        failed = [
            f"{c.url}: {r}"
            for c, r in zip(self.clients, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if failed:
            raise InferenceError(f"init_weights_update_group failed: {'; '.join(failed)}")

    async def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name="weight_update_group", weight_version=None
    ) -> None:
        await self._all("update_weights_from_distributed", names, dtypes, shapes, group_name, weight_version)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        await self._all("update_weights_from_disk", model_path, weight_version)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self._all("destroy_weights_update_group", group_name)

    async def pause_generation(self) -> None:
        await self._all("pause_generation")

    async def continue_generation(self) -> None:
        await self._all("continue_generation")

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._all("abort_request", rid, abort_all)

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._health_task
        await asyncio.gather(*(c.close() for c in self.clients), return_exceptions=True)
