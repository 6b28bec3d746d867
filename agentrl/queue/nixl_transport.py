"""NIXL data path of the TransferQueue: arrays move over NIXL (UCX), ZeroMQ stays the control plane.

With `queue.nixl: true` a producer does not put the array frames of a group on the ZeroMQ
socket. It registers the arrays' own buffers with its NIXL agent (no copy; GPU memory
works the same way where present) and sends the server a small `nput` message: the
msgpack header frame, the (address, length) of each array and the partial agent metadata
naming those buffers. The server takes a registered buffer from its `BufferPool` and
issues one NIXL READ of all arrays; when the read completes the group goes through the same validation, capacity,
WAL and ack path as a ZeroMQ put (`QueueServer._put_one`), and only then does the
producer get its ack and deregister the buffers. A server restarted mid-read simply
reads again when the producer re-sends (the buffers stay registered until acked).

This leg (rollers -> the queue hosted by the learner) is the only network hop; consumers
in other processes still receive frames over ZeroMQ. Small groups gain nothing from a
remote read, so groups under `NIXL_MIN_BYTES` take the ordinary ZeroMQ path.

Requires `pip install 'agentrl[nixl]'` (nixl>=1.5.1); UCX picks shared memory, TCP or
RDMA by itself.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from agentrl.log import get_logger
from agentrl.queue.auth import Authenticator
from agentrl.queue.zmq_producer import ZmqProducer
from agentrl.types import Group
from agentrl.wire import encode_group

log = get_logger("queue.nixl")

NIXL_MIN_BYTES = 256 << 10
POOL_ROUND = 1 << 20  # receive buffers come in whole MiB, so groups of similar size share them


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _address(frame: Any) -> tuple[int, int]:
    view = memoryview(frame)
    array = np.frombuffer(view, dtype=np.uint8)
    return int(array.ctypes.data) if len(array) else 0, len(array)


class NixlProducer(ZmqProducer):
    """A `ZmqProducer` whose large groups' arrays are read by the server over NIXL."""

    def __init__(
        self, address: str, auth: Authenticator, window_bytes: int = 256 << 20, **kwargs: Any
    ) -> None:
        super().__init__(address, auth, window_bytes, **kwargs)
        self.agent_name = f"roller-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent = _agent(self.agent_name)

    async def _send_group(self, group: Group, frames: list) -> None:
        if sum(len(f) for f in frames[1:]) < NIXL_MIN_BYTES:
            await super()._send_group(group, frames)
            return
        descs = [_address(f) for f in frames[1:]]
        registered = self._agent.register_memory([(a, n, 0, "") for a, n in descs if n], "DRAM")
        try:
            ctl = {
                "k": "nput",
                "gid": group.group_id,
                "descs": descs,
                "agent": self.agent_name,
                # this group's buffers and how to connect: the full metadata would name every
                # buffer of every group in flight, which the server would parse once per group
                "md": self._agent.get_partial_agent_metadata(registered, True, ["UCX"]),
            }
            await self._call(ctl, [bytes(frames[0])])
        finally:
            self._agent.deregister_memory(registered)


class BufferPool:
    """Receive buffers the server READs into, registered once and reused once nothing refers
    to them any more.

    A READ into freshly mapped pages is several times slower than into pages already faulted
    in (the copy faults each page in: 16 MiB took ~30 ms here, ~1-5 ms into a buffer read into
    before), and big buffers freed by the server thread go back to the OS, so a fresh buffer
    per group made the NIXL path slower than ZeroMQ. A buffer is reused only when its
    reference count shows that no group, frame or view of it is alive (the learner may keep a
    batch after acking it), so reuse never overwrites data anyone holds. Idle buffers beyond
    `max_bytes` are deregistered and freed."""

    def __init__(self, register: Any, deregister: Any, max_bytes: int) -> None:
        self._register, self._deregister = register, deregister
        self.max_bytes = max_bytes
        self._buffers: list[np.ndarray] = []
        self._registrations: list[Any] = []
        probe = [np.empty(0, dtype=np.uint8)]  # the count `_idle` sees for an unreferenced buffer
        self._baseline = sys.getrefcount(probe[0])

    @property
    def nbytes(self) -> int:
        return sum(len(buf) for buf in self._buffers)

    def _idle(self, i: int) -> bool:
        return sys.getrefcount(self._buffers[i]) <= self._baseline  # only this list refers to it

    def take(self, nbytes: int) -> np.ndarray:
        """A registered buffer of at least `nbytes` that nothing else refers to."""
        idle = [i for i in range(len(self._buffers)) if self._idle(i) and len(self._buffers[i]) >= nbytes]
        if idle:
            return self._buffers[min(idle, key=lambda i: len(self._buffers[i]))]
        size = -(-max(1, nbytes) // POOL_ROUND) * POOL_ROUND
        self._evict(self.max_bytes - size)
        buf = np.empty(size, dtype=np.uint8)
        self._registrations.append(self._register(buf))
        self._buffers.append(buf)
        return buf

    def _evict(self, keep_bytes: int) -> None:
        """Deregister and drop idle buffers, largest first, until at most `keep_bytes` remain."""
        idle = [self._idle(i) for i in range(len(self._buffers))]  # before any other reference
        total, dropped = self.nbytes, set()
        for i in sorted(range(len(self._buffers)), key=lambda i: -len(self._buffers[i])):
            if total <= keep_bytes:
                break
            if idle[i]:
                self._deregister(self._registrations[i])
                total -= len(self._buffers[i])
                dropped.add(i)
        if dropped:
            kept = [i for i in range(len(self._buffers)) if i not in dropped]
            self._buffers = [self._buffers[i] for i in kept]
            self._registrations = [self._registrations[i] for i in kept]

    def close(self) -> None:
        self._evict(0)


class NixlReader:
    """Server side: READs each announced group's arrays into a pooled registered buffer."""

    def __init__(self, name: str, max_pool_bytes: int = 1 << 30) -> None:
        self._agent = _agent(name)
        self.pool = BufferPool(
            lambda buf: self._agent.register_memory([(*_address(buf), 0, "")], "DRAM"),
            self._agent.deregister_memory,
            max_pool_bytes,
        )
        self.pending: list[tuple[dict, list, Any, Any]] = []

    def start(self, ctl: dict, header: Any, reply_to: Any) -> None:
        # the metadata names the memory the producer registered for this group: load it every time
        if self._agent.add_remote_agent(ctl["md"]).decode() != ctl["agent"]:
            raise ValueError("nput: NIXL metadata does not belong to the agent named in the message")
        lengths = [int(n) for _, n in ctl["descs"]]
        view = memoryview(self.pool.take(sum(lengths)))
        base, _ = _address(view)
        local, remote, offset = [], [], 0
        for (addr, _), length in zip(ctl["descs"], lengths, strict=True):
            if length:
                local.append((base + offset, length, 0))
                remote.append((int(addr), length, 0))
            offset += length
        handle = None
        if local:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, "DRAM"),
                self._agent.get_xfer_descs(remote, "DRAM"),
                ctl["agent"],
            )
            if self._agent.transfer(handle) == "ERR":
                log.warning("NIXL read of group %s failed to start", ctl["gid"])
        frames, offset = [bytes(memoryview(header))], 0
        for length in lengths:
            frames.append(view[offset : offset + length])
            offset += length
        self.pending.append((ctl, frames, reply_to, handle))

    def poll(self) -> list[tuple[dict, list, Any, str | None]]:
        """Reads that finished (or failed) since the last call."""
        done, still = [], []
        for item in self.pending:
            ctl, frames, reply_to, handle = item
            state = "DONE" if handle is None else self._agent.check_xfer_state(handle)
            if state == "PROC":
                still.append(item)
                continue
            if handle is not None:
                self._agent.release_xfer_handle(handle)
            done.append((ctl, frames, reply_to, None if state == "DONE" else f"transfer state {state}"))
        self.pending = still
        return done


__all__ = ["NixlProducer", "NixlReader", "encode_group"]
