"""The write-ahead log: replay, torn tails, acks, segment roll-over; and a durable server restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.queue import create
from agentrl.queue.wal import WriteAheadLog
from agentrl.wire import decode_group, encode_group
from tests.unit.queue.conftest import make_group, put_all

pytestmark = pytest.mark.timeout(90)  # a hang fails this test, not the whole run


@pytest.mark.parametrize("fsync", [False, True])
def test_replay_restores_unacked_groups_and_remembers_acks(tmp_path: Path, fsync: bool) -> None:
    wal = WriteAheadLog(tmp_path, fsync=fsync)
    assert wal.recover().groups == {}
    groups = [make_group(seed=i) for i in range(3)]
    for g in groups:
        wal.append_put(g.group_id, encode_group(g))
    wal.append_ack([groups[1].group_id])
    wal.append_meta(version=4, tasks=12)
    wal.close()
    found = WriteAheadLog(tmp_path).recover()
    assert list(found.groups) == [groups[0].group_id, groups[2].group_id]
    assert groups[1].group_id in found.acked
    assert (found.version, found.tasks) == (4, 12)
    back = decode_group(found.groups[groups[2].group_id])
    assert (
        back.group_id == groups[2].group_id
        and (back.episodes[0].tokens == groups[2].episodes[0].tokens).all()
    )


def test_a_torn_tail_is_truncated(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.recover()
    a, b = make_group(seed=1), make_group(seed=2)
    wal.append_put(a.group_id, encode_group(a))
    wal.append_put(b.group_id, encode_group(b))
    wal.close()
    segment = next(tmp_path.glob("wal-*.log"))
    segment.write_bytes(segment.read_bytes()[:-10])  # the crash cut the last record
    wal = WriteAheadLog(tmp_path)
    assert list(wal.recover().groups) == [a.group_id]
    c = make_group(seed=3)
    wal.append_put(c.group_id, encode_group(c))  # appends continue after the cut
    wal.close()
    assert list(WriteAheadLog(tmp_path).recover().groups) == [a.group_id, c.group_id]


def test_fully_acked_segments_are_deleted(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path, segment_bytes=4096)
    wal.recover()
    groups = [make_group(seed=i, tokens=256) for i in range(6)]
    for g in groups:
        wal.append_put(g.group_id, encode_group(g))
        wal.maybe_roll(0, 0, [])
    assert len(list(tmp_path.glob("wal-*.log"))) > 2
    wal.append_ack([g.group_id for g in groups[:-1]])
    wal.maybe_roll(0, 0, [g.group_id for g in groups[:-1]])
    wal.close()
    assert len(list(tmp_path.glob("wal-*.log"))) <= 2
    found = WriteAheadLog(tmp_path).recover()
    assert list(found.groups) == [groups[-1].group_id]
    assert set(found.acked) >= {g.group_id for g in groups[:-1]}


def test_durable_server_restart_keeps_unacked_and_forgets_acked(tmp_path: Path, secret: str) -> None:
    config = ZmqQueueConfig(address="tcp://127.0.0.1:*", durable=True, wal_dir=str(tmp_path / "wal"))
    backend = create(config)
    groups = [make_group(seed=i) for i in range(4)]
    server = backend.server(groups_per_step=2, max_staleness=1).start()
    put_all(lambda: backend.producer(address=server.endpoint), groups)
    consumer = backend.consumer("rank0", server=server)
    first = consumer.get_batch(2, 0, 1, timeout_s=10)
    consumer.ack(first.group_ids[:1])
    consumer.close()
    server.stop()

    server = backend.server(groups_per_step=2, max_staleness=1).start()
    put_all(
        lambda: backend.producer(address=server.endpoint), groups
    )  # a producer retrying: all deduplicated
    consumer = backend.consumer("rank0", server=server)
    rest = consumer.get_batch(3, 0, 1, timeout_s=10)
    assert sorted(rest.group_ids) == sorted(g.group_id for g in groups[1:])
    assert server.metrics()["duplicates"] == 4
    consumer.close()
    server.stop()
