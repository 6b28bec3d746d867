"""The NIXL data path: a producer's arrays are READ by the server over NIXL (UCX, DRAM here)."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.queue.nixl_transport import NIXL_MIN_BYTES
from tests.unit.queue.conftest import Harness, make_group

pytestmark = pytest.mark.timeout(90)  # a hang fails this test, not the whole run

pytest.importorskip("nixl._api", reason="the nixl extra is not installed (pip install 'agentrl[nixl]')")


def test_large_groups_travel_over_nixl_small_ones_over_zmq(zmq_queue: Harness) -> None:
    zmq_queue.start(nixl=True)
    big = [make_group(seed=i, tokens=NIXL_MIN_BYTES // 13 + 100, episodes=2) for i in range(3)]
    small = make_group(seed=9)
    zmq_queue.put([*big, small], concurrent=True)
    consumer = zmq_queue.consumer()  # over tcp: frames come back over ZeroMQ
    batch = consumer.get_batch(4, 0, 1, timeout_s=20)
    got = {g.group_id: g for g in batch.groups}
    for sent in [*big, small]:
        for a, b in zip(sent.episodes, got[sent.group_id].episodes, strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
            np.testing.assert_array_equal(a.versions, b.versions)
    m = consumer.metrics()
    assert m["groups_in"] == 4 and m["refused_corrupt"] == 0
    assert m["nixl_reads"] == 3  # the three large groups; the small one went over ZeroMQ
