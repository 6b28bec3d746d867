"""NIXL data path of the TransferQueue: arrays move over NIXL (UCX), ZeroMQ stays the control plane.

With `queue.nixl: true` a producer does not put the array frames of a group on the ZeroMQ
socket. It registers the arrays' own buffers with its NIXL agent (no copy; GPU memory
works the same way where present) and sends the server a small `nput` message: the
msgpack header frame, the (address, length) of each array and its agent metadata. The
server allocates the group's buffer, registers it and issues one NIXL READ of all
arrays; when the read completes the group goes through the same validation, capacity,
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
from typing import Any

import numpy as np

from agentrl.log import get_logger
from agentrl.queue.auth import Authenticator
from agentrl.queue.zmq_client import ZmqProducer
from agentrl.types import Group, encode_group

log = get_logger("queue.nixl")

NIXL_MIN_BYTES = 256 << 10


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def _address(frame: Any) -> tuple[int, int]:
    view = memoryview(frame)
    array = np.frombuffer(view, dtype=np.uint8)
    return int(array.ctypes.data) if len(array) else 0, len(array)


class NixlProducer(ZmqProducer):
    """A `ZmqProducer` whose large groups' arrays are read by the server over NIXL."""

    def __init__(self, address: str, auth: Authenticator, window_bytes: int = 256 << 20) -> None:
        super().__init__(address, auth, window_bytes)
        self.agent_name = f"roller-{os.getpid()}-{os.urandom(4).hex()}"
        self._agent = _agent(self.agent_name)

    async def _send_group(self, group: Group, frames: list) -> None:
        if sum(len(f) for f in frames[1:]) < NIXL_MIN_BYTES:
            await super()._send_group(group, frames)
            return
        arrays = [_address(f) for f in frames[1:] if len(f)]
        registered = self._agent.register_memory([(a, n, 0, "") for a, n in arrays], "DRAM")
        try:
            descs = [[a, n] for a, n in (_address(f) for f in frames[1:])]
            ctl = {
                "k": "nput",
                "gid": group.group_id,
                "descs": descs,
                "agent": self.agent_name,
                "md": self._agent.get_agent_metadata(),  # after registering: it names these buffers
            }
            await self._call(ctl, [bytes(frames[0])])
        finally:
            self._agent.deregister_memory(registered)


class NixlReader:
    """Server side: READs each announced group's arrays into a buffer of its own."""

    def __init__(self, name: str) -> None:
        self._agent = _agent(name)
        self.pending: list[tuple[dict, list, Any, Any, np.ndarray, Any]] = []

    def start(self, ctl: dict, header: Any, reply_to: Any) -> None:
        # the metadata names the memory the producer registered for this group: load it every time
        if self._agent.add_remote_agent(ctl["md"]).decode() != ctl["agent"]:
            raise ValueError("nput: NIXL metadata does not belong to the agent named in the message")
        lengths = [int(n) for _, n in ctl["descs"]]
        buf = np.empty(max(1, sum(lengths)), dtype=np.uint8)
        base = int(buf.ctypes.data)
        registered = self._agent.register_memory([(base, len(buf), 0, "")], "DRAM")
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
        view = memoryview(buf)
        for length in lengths:
            frames.append(view[offset : offset + length])
            offset += length
        self.pending.append((ctl, frames, reply_to, handle, buf, registered))

    def poll(self) -> list[tuple[dict, list, Any, str | None]]:
        """Reads that finished (or failed) since the last call."""
        done, still = [], []
        for item in self.pending:
            ctl, frames, reply_to, handle, _, registered = item
            state = "DONE" if handle is None else self._agent.check_xfer_state(handle)
            if state == "PROC":
                still.append(item)
                continue
            if handle is not None:
                self._agent.release_xfer_handle(handle)
            self._agent.deregister_memory(registered)
            done.append((ctl, frames, reply_to, None if state == "DONE" else f"transfer state {state}"))
        self.pending = still
        return done


__all__ = ["NixlProducer", "NixlReader", "encode_group"]
