"""A micro-batcher: concurrent single calls become one batched call.

    batcher = MicroBatcher(score_many, max_size=32, wait_s=0.005)
    score = await batcher.submit(item)

The first item of a batch waits up to `wait_s` for others (or until `max_size` are waiting);
then `score_many(items)` runs once and each caller gets its own result, or the batch's
exception. Batches run one at a time, in arrival order: the roller's client uses it to send one
`/score` request for the episodes that finish together, the scoring server to run one forward
for the requests that arrive together. `sizes` keeps the recent batch sizes for metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        run: Callable[[list[T]], Awaitable[Sequence[R]]],
        max_size: int,
        wait_s: float,
        weight: Callable[[T], int] = lambda _: 1,
    ) -> None:
        """`weight(item)`: how much of `max_size` an item takes (a request of 5 texts takes 5);
        an item heavier than `max_size` runs alone."""
        self._run = run
        self.max_size = max_size
        self.wait_s = wait_s
        self._weight = weight
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._pending_weight = 0
        self._full = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self.sizes: deque[int] = deque(maxlen=1024)
        self.batches = 0

    async def submit(self, item: T) -> R:
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        self._pending_weight += self._weight(item)
        if self._pending_weight >= self.max_size:
            self._full.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._batch_loop(), name="_batch_loop")
        return await future

    async def _batch_loop(self) -> None:
        """Run batches while items wait; exits when none is left (`submit` starts it again)."""
        while self._pending:
            if self._pending_weight < self.max_size and self.wait_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), self.wait_s)
            batch, weight = self._take()
            self.sizes.append(weight)
            self.batches += 1
            try:
                results = await self._run([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"batched call returned {len(results)} results for {len(batch)} items")
            except Exception as exc:  # every caller of the batch gets the error
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _take(self) -> tuple[list[tuple[T, asyncio.Future[R]]], int]:
        """The oldest items that fit in `max_size` (at least one)."""
        taken, weight = [], 0
        while self._pending:
            w = self._weight(self._pending[0][0])
            if taken and weight + w > self.max_size:
                break
            taken.append(self._pending.pop(0))
            weight += w
        self._pending_weight -= weight
        if self._pending_weight < self.max_size:
            self._full.clear()
        return taken, weight

    def stats(self) -> dict[str, Any]:
        sizes = list(self.sizes)
        return {"batches": self.batches, "batch_size_mean": sum(sizes) / len(sizes) if sizes else 0.0}
