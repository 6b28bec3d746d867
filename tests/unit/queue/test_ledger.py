"""The queue's ledger: a durability-off queue that dies holding groups has them counted as lost
with durability off (by the next queue on the run, and by the account), never silently."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.queue import create
from agentrl.queue.account import account
from agentrl.queue.ledger import read_rows, undurable_losses
from tests.unit.queue.conftest import make_group

pytestmark = pytest.mark.timeout(90)


def _life(run_dir: Path, durable: bool, address: str = "tcp://127.0.0.1:*"):
    config = ZmqQueueConfig(address=address, durable=durable, wal_dir=str(run_dir / "wal"))
    backend = create(config)
    server = backend.server(groups_per_step=2, max_staleness=1, ledger=run_dir / "queue_ledger.jsonl").start()
    return backend, server


def _put(backend, server, groups, roller_file: Path) -> None:
    async def go() -> None:
        producer = backend.producer(address=server.endpoint)
        await producer.acquire_start(len(groups))
        for group in groups:
            await producer.put(group)
            with roller_file.open("a") as out:  # what the roller records for an acknowledged put
                out.write(json.dumps({"id": group.group_id, "task": None}) + "\n")
        producer.close()

    asyncio.run(go())


@pytest.mark.parametrize("durable", [False, True], ids=["durability-off", "durable"])
def test_groups_a_dead_queue_held_are_lost_with_durability_off_and_counted(
    tmp_path: Path, secret: str, durable: bool
) -> None:
    roller_file = tmp_path / "roller-0.groups"
    backend, first = _life(tmp_path, durable)
    groups = [make_group(seed=i) for i in range(3)]
    _put(backend, first, groups, roller_file)
    consumer = backend.consumer("rank0", server=first)
    batch = consumer.get_batch(1, learner_version=0, max_staleness=1, timeout_s=10)
    consumer.ack(batch.group_ids)  # one trained, two still queued
    (tmp_path / "learner_groups.jsonl").write_text(json.dumps({"trained": batch.group_ids}) + "\n")
    consumer.close()
    first.ledger._file.close()  # what kill -9 leaves: the ledger without the stop's `remaining` row
    first.stop()

    backend, second = _life(tmp_path, durable)  # the learner resumed: a new queue on the run's ledger
    held = {g.group_id for g in groups} - set(batch.group_ids)
    assert second.metrics()["lost_undurable"] == (0 if durable else 2)
    assert undurable_losses(read_rows(tmp_path / "queue_ledger.jsonl")) == (set() if durable else held)
    if durable:  # the WAL brought them back
        assert second.metrics()["recovered"] == 2
    second.stop()
    acct = account(tmp_path)
    assert acct.lost == 0 and acct.duplicated == 0
    assert acct.lost_undurable == (0 if durable else 2)
    assert acct.remaining == (held if durable else set())


def test_a_group_acknowledged_then_cut_from_the_wal_tail_is_counted_and_named(
    tmp_path: Path, secret: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Durable without `wal_fsync`: a machine crash can lose the WAL's tail from the page cache
    (here: the last record cut by hand, as the attack did). The group acknowledged past the cut is
    named and counted as lost_undurable by the next queue and by the account, never silent."""
    roller_file = tmp_path / "roller-0.groups"
    backend, first = _life(tmp_path, durable=True)
    groups = [make_group(seed=i) for i in range(3)]
    _put(backend, first, groups, roller_file)
    first.ledger._file.close()  # kill -9: no `remaining` row
    first.stop()
    segment = max((tmp_path / "wal").glob("wal-*.log"))
    segment.write_bytes(segment.read_bytes()[:-10])  # the last put's record torn

    with caplog.at_level("WARNING", logger="agentrl.queue.ledger"):
        backend, second = _life(tmp_path, durable=True)
    cut = groups[-1].group_id
    assert second.metrics()["recovered"] == 2
    assert second.metrics()["lost_undurable"] == 1
    assert cut in caplog.text and "lost_undurable" in caplog.text
    second.stop()
    backend, third = _life(tmp_path, durable=True)  # a later life does not count it again
    assert third.metrics()["lost_undurable"] == 0
    third.stop()
    assert undurable_losses(read_rows(tmp_path / "queue_ledger.jsonl")) == {cut}
    acct = account(tmp_path)
    assert acct.lost == 0 and acct.lost_undurable == 1
