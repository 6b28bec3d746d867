"""Transports of the ZeroMQ queue besides TCP: `ipc://` (a Unix socket) for rollers on the
learner's host, and the in-process consumer; both keep the MAC and the wire checks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.queue import create
from tests.unit.queue.conftest import make_group, put_all


def test_groups_flow_over_an_ipc_socket(tmp_path: Path, secret: str) -> None:
    backend = create(ZmqQueueConfig(address=f"ipc://{tmp_path}/queue.sock"))
    server = backend.server(groups_per_step=4, max_staleness=1).start()
    try:
        assert server.endpoint.startswith("ipc://")
        groups = [make_group(seed=i, tokens=40_000 if i == 2 else 32) for i in range(5)]  # one goes alone
        put_all(backend.producer, groups, concurrent=True)
        consumer = backend.consumer("rank0")  # over the same ipc socket, MAC-checked both ways
        try:
            batch = consumer.get_batch(5, learner_version=0, max_staleness=1, timeout_s=30)
            assert sorted(batch.group_ids) == sorted(g.group_id for g in groups)
            for got in batch.groups:
                sent = next(g for g in groups if g.group_id == got.group_id)
                assert [e.tokens.tolist() for e in got.episodes] == [e.tokens.tolist() for e in sent.episodes]
            consumer.ack(batch.group_ids)
            assert consumer.metrics()["groups_in"] == 5
        finally:
            consumer.close()
    finally:
        server.stop()


def test_an_ipc_peer_without_the_secret_is_refused(
    tmp_path: Path, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = create(ZmqQueueConfig(address=f"ipc://{tmp_path}/queue.sock"))
    server = backend.server(groups_per_step=4, max_staleness=1).start()
    try:
        monkeypatch.setenv("AGENTRL_QUEUE_SECRET", "another-secret-of-enough-length")
        producer = backend.producer()

        async def put_with_timeout() -> None:
            try:
                await asyncio.wait_for(producer.put(make_group()), 1.0)
            finally:
                producer.close()

        with pytest.raises(TimeoutError):
            asyncio.run(put_with_timeout())
        assert server.metrics()["refused_auth"] >= 1 and server.metrics()["groups_in"] == 0
    finally:
        server.stop()
