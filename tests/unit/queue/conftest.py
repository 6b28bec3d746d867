"""Queue test harness: one behavioural suite runs against the ZeroMQ server and a real
redis-server (started here on a free loopback port, stopped by PID)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agentrl.config import RedisQueueConfig, ZmqQueueConfig
from agentrl.queue import create
from agentrl.types import Episode, Group

SECRET = "queue-test-secret-0123456789abcdef"


def make_group(version: int = 0, tokens: int = 32, episodes: int = 2, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(episodes):
        mask = np.r_[np.zeros(tokens // 2), np.ones(tokens - tokens // 2)].astype(np.uint8)
        eps.append(
            Episode(
                tokens=rng.integers(0, 1000, tokens),
                loss_mask=mask,
                logprobs=-rng.random(tokens).astype(np.float32) * mask,
                versions=np.where(mask == 1, version, -1),
                reward=float(rng.random()),
            )
        )
    return Group(eps, prompt_id=f"p{seed}")


def put_all(producer_factory: Any, groups: list[Group], concurrent: bool = False) -> None:
    """Put groups from one producer in a fresh event loop, one after the other or all at once."""

    async def go() -> None:
        producer = producer_factory()
        try:
            if concurrent:
                await asyncio.gather(*(producer.put(g) for g in groups))
            for group in [] if concurrent else groups:
                await producer.put(group)
        finally:
            producer.close()

    asyncio.run(go())


class Harness:
    """One queue (server + config) that tests take producers and consumers from."""

    def __init__(self, kind: str, tmp_path: Path, redis_url: str | None) -> None:
        self.kind, self.tmp_path, self.redis_url = kind, tmp_path, redis_url
        self.server: Any = None
        self.consumers: list[Any] = []

    def start(
        self, groups_per_step: int = 4, max_staleness: int = 1, server_args: dict | None = None, **fields: Any
    ) -> Harness:
        if self.kind == "zmq":
            self.config = ZmqQueueConfig(
                address="tcp://127.0.0.1:*", wal_dir=str(self.tmp_path / "wal"), **fields
            )
        else:
            stream = f"test:{self.tmp_path.name}"
            self.config = RedisQueueConfig(url=self.redis_url, stream=stream, **fields)
        self.backend = create(self.config)
        self.server = self.backend.server(
            groups_per_step=groups_per_step, max_staleness=max_staleness, **(server_args or {})
        ).start()
        self.address = getattr(self.server, "endpoint", None)
        return self

    def producer(self) -> Any:
        return self.backend.producer(address=self.address) if self.kind == "zmq" else self.backend.producer()

    def consumer(self, name: str = "rank0") -> Any:
        consumer = (
            self.backend.consumer(name, address=self.address)
            if self.kind == "zmq"
            else self.backend.consumer(name)
        )
        self.consumers.append(consumer)
        return consumer

    def put(self, groups: list[Group], concurrent: bool = False) -> None:
        put_all(self.producer, groups, concurrent)

    def close(self) -> None:
        for consumer in self.consumers:
            consumer.close()
        if self.server is not None:
            self.server.stop()


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("AGENTRL_QUEUE_SECRET", SECRET)
    return SECRET


@pytest.fixture(params=["zmq", "redis"])
def queue(request: pytest.FixtureRequest, tmp_path: Path, secret: str) -> Iterator[Harness]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else None
    harness = Harness(request.param, tmp_path, url)
    yield harness
    harness.close()


@pytest.fixture
def zmq_queue(tmp_path: Path, secret: str) -> Iterator[Harness]:
    harness = Harness("zmq", tmp_path, None)
    yield harness
    harness.close()
