"""The NIXL server's receive-buffer pool: reuse only what nothing refers to, bounded when idle.

The pool's register/deregister are NIXL calls (the outside edge); here they only record which
buffers were registered, so the pool runs without the nixl extra."""

from __future__ import annotations

import gc

import numpy as np

from agentrl.queue.nixl_transport import POOL_ROUND, BufferPool
from agentrl.wire import decode_group, encode_group
from tests.unit.queue.conftest import make_group


class Registry:
    def __init__(self) -> None:
        self.live: dict[int, int] = {}  # address -> bytes
        self.registered = 0

    def register(self, buf: np.ndarray) -> int:
        self.registered += 1
        self.live[int(buf.ctypes.data)] = len(buf)
        return int(buf.ctypes.data)

    def deregister(self, address: int) -> None:
        del self.live[address]


def _pool(max_bytes: int = 64 * POOL_ROUND) -> tuple[BufferPool, Registry]:
    registry = Registry()
    return BufferPool(registry.register, registry.deregister, max_bytes), registry


def test_a_buffer_comes_back_only_when_nothing_refers_to_it() -> None:
    pool, registry = _pool()
    first = pool.take(1000)
    assert len(first) >= 1000 and len(first) % POOL_ROUND == 0
    address = int(first.ctypes.data)
    view = memoryview(first)[:10]
    del first
    second = pool.take(1000)  # `view` still holds the first one
    assert int(second.ctypes.data) != address and registry.registered == 2
    del second, view
    gc.collect()
    assert int(pool.take(1000).ctypes.data) in registry.live  # reused: nothing new registered
    assert registry.registered == 2


def test_decoded_groups_keep_their_buffer_in_use() -> None:
    """What the queue does with a READ: frames are slices of the buffer, the group views them."""
    pool, _ = _pool()
    group = make_group(seed=3, tokens=1000)
    frames = [bytes(f) for f in encode_group(group)]
    buf = pool.take(sum(map(len, frames[1:])))
    view, offset, sliced = memoryview(buf), 0, [frames[0]]
    for frame in frames[1:]:
        view[offset : offset + len(frame)] = frame
        sliced.append(view[offset : offset + len(frame)])
        offset += len(frame)
    address = int(buf.ctypes.data)
    decoded = decode_group(sliced)
    del buf, view, sliced
    gc.collect()
    other = pool.take(10)
    assert int(other.ctypes.data) != address  # the decoded arrays still live in it
    np.testing.assert_array_equal(decoded.episodes[0].tokens, group.episodes[0].tokens)
    del decoded, other
    gc.collect()
    assert {int(pool.take(10).ctypes.data), int(pool.take(10).ctypes.data)} <= {address}


def test_idle_buffers_beyond_the_bound_are_deregistered_and_busy_ones_never() -> None:
    pool, registry = _pool(max_bytes=2 * POOL_ROUND)
    busy = pool.take(POOL_ROUND)
    idle = pool.take(POOL_ROUND)
    del idle
    gc.collect()
    big = pool.take(2 * POOL_ROUND)  # over the bound: the idle one goes, the busy one stays
    assert int(busy.ctypes.data) in registry.live and int(big.ctypes.data) in registry.live
    assert len(registry.live) == 2 and pool.nbytes == 3 * POOL_ROUND  # busy buffers may exceed it
    busy[:] = 1  # still valid memory
    del busy, big
    gc.collect()
    pool.close()
    assert registry.live == {} and pool.nbytes == 0
