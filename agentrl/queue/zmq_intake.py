"""Taking groups in: the roller-side half of the queue server's state machine.

`QueueServer` (zmq_server.py) owns the sockets, the loop and the replies; this mixin holds what
a producer's puts ask of it:

- `put`: one message may carry several groups (`frames.pack`); each is checked against
  `max_message_bytes`, deduplicated by group id (a re-send after a server restart, or one the
  queue already acked), decoded as hostile input (`wire.decode_groups`: a bad group is refused
  with its reason, its neighbours are not), and spends one admission credit of the sender's
  lease whatever its fate;
- `nput` (`queue.nixl`): the arrays wait in the producer's memory and are READ over NIXL
  (`nixl_transport.py`); a finished read takes the same path as a put;
- flow control: queued plus handed-out groups stay within `capacity_groups` and
  `capacity_bytes`; a put that does not fit is parked unanswered until room frees up (an ack or
  a drop in `zmq_delivery.py` calls `_admit_parked`), so `Producer.put` waits (each producer also
  bounds its unacknowledged bytes). Admission is derived from what is in flight (see
  `zmq_admission.py`), so groups dropped as stale (or in a step the learner skipped) give their
  admission back by leaving, and rollers replace them;
- an accepted group is appended to the WAL (when durable) before its ack is queued; the server's
  loop commits the WAL before it sends the acks.
"""

from __future__ import annotations

import time
from typing import Any

import zmq

from agentrl.queue.frames import unpack
from agentrl.queue.wal import MAX_REMEMBERED_ACKS
from agentrl.queue.zmq_delivery import _Entry
from agentrl.types import Group
from agentrl.wire import WireError, decode_groups


class Intake:
    """Mixin of `QueueServer`: put / nput handlers, capacity and parking (its state lives there)."""

    def _on_put(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        items = ctl["items"]
        payload = unpack(ctl["lens"], ctl["segs"], payload)
        if sum(int(item[2]) for item in items) != len(payload):
            raise WireError("put: frame counts do not add up to the payload")
        todo, pos, lease = [], 0, ctl.get("l")
        for rid, gid, nframes in items:
            frames = payload[pos : pos + nframes]
            pos += nframes
            nbytes = sum(map(len, frames[1:]))
            if self._is_known(gid):
                self._spend(lease, rid)
                self._duplicate(sock, ident, rid)
            elif self._fits(sock, ident, rid, nbytes, lease):
                todo.append((rid, gid, frames, nbytes))
        decoded = decode_groups([t[2] for t in todo], max_bytes=self.config.max_message_bytes)
        for (rid, gid, frames, nbytes), result in zip(todo, decoded, strict=True):
            self._put_one(sock, ident, rid, gid, frames, nbytes, result, lease)
        self._serve_gets()

    def _is_known(self, gid: str) -> bool:
        return gid in self._acked or gid in self._queued or gid in self._inflight or gid in self._parked_ids

    def _duplicate(self, sock: zmq.Socket, ident: bytes, rid: int) -> None:
        self.counters["duplicates"] += 1
        self._put_acks.setdefault((sock, ident), []).append(rid)

    def _fits(self, sock: zmq.Socket, ident: bytes, rid: int, nbytes: int, lease: str | None) -> bool:
        """A group of `nbytes` array bytes is within `max_message_bytes`, or it is refused."""
        if nbytes <= self.config.max_message_bytes:
            return True
        self._spend(lease, rid)
        self.counters["refused_oversize"] += 1
        msg = f"group of {nbytes} bytes exceeds queue.max_message_bytes={self.config.max_message_bytes}"
        self._reply(sock, ident, {"k": "err", "rid": rid, "msg": msg})
        return False

    def _put_one(
        self,
        sock: zmq.Socket,
        ident: bytes,
        rid: int,
        gid: str,
        frames: list[Any],
        nbytes: int,
        decoded: tuple[Group, int] | WireError,
        lease: str | None,
    ) -> None:
        """Store one decoded group, hold it back while full, or refuse it with a reason; each spends
        one admission credit of the sender's lease."""
        self._spend(lease, rid)
        if self._is_known(gid):  # e.g. twice in one message
            self._duplicate(sock, ident, rid)
            return
        if not isinstance(decoded, WireError) and decoded[0].group_id != gid:
            decoded = WireError(f"put: header group_id {decoded[0].group_id!r} differs from {gid!r}")
        if isinstance(decoded, WireError):
            self.counters["refused_corrupt"] += 1
            self._reply(sock, ident, {"k": "err", "rid": rid, "msg": str(decoded)})
            return
        self._seq += 1
        group, min_version = decoded
        entry = _Entry(gid, frames, nbytes, min_version, self._seq, time.time(), group)
        if self._has_room(entry.nbytes) and not self._parked:
            self._accept(sock, ident, rid, entry)
        else:
            self._parked.append((sock, ident, rid, entry))
            self._parked_ids.add(gid)

    def _on_nput(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        """A put whose arrays wait in the producer's memory: READ them over NIXL (see nixl_transport)."""
        if self._nixl is None:
            raise ValueError("this queue server was started without queue.nixl")
        if self._is_known(ctl["gid"]) or ctl["gid"] in self._nixl_busy:
            if not self._is_known(ctl["gid"]):
                return  # a re-send while its read is under way: the read's ack answers it
            self._duplicate(sock, ident, ctl["rid"])
            return
        if not self._fits(sock, ident, ctl["rid"], sum(int(n) for _, n in ctl["descs"]), ctl.get("l")):
            return
        self._nixl_busy.add(ctl["gid"])
        self._nixl.start(ctl, payload[0], (sock, ident))

    def _finish_nixl_reads(self) -> None:
        for ctl, frames, (sock, ident), error in self._nixl.poll():
            self._nixl_busy.discard(ctl["gid"])
            if error is not None:
                self.counters["refused_corrupt"] += 1
                self._reply(sock, ident, {"k": "err", "rid": ctl["rid"], "msg": f"NIXL read failed: {error}"})
            else:
                self.counters["nixl_reads"] += 1  # of the lengths `_on_nput` checked against the limit
                (decoded,) = decode_groups([frames], max_bytes=self.config.max_message_bytes)
                nbytes = sum(map(len, frames[1:]))
                self._put_one(sock, ident, ctl["rid"], ctl["gid"], frames, nbytes, decoded, ctl.get("l"))
        self._serve_gets()

    def _has_room(self, nbytes: int) -> bool:
        held = len(self._queued) + len(self._inflight)
        if held == 0:
            return True
        return held < self.config.capacity_groups and self._bytes + nbytes <= self.config.capacity_bytes

    def _accept(self, sock: zmq.Socket, ident: bytes, rid: int, entry: _Entry) -> None:
        if self.wal is not None:
            self.wal.append_put(entry.gid, entry.frames)
        self._store(entry)
        if self.ledger is not None:
            self.ledger.held(entry.gid)
        self.counters["groups_in"] += 1
        self.counters["bytes_in"] += entry.nbytes
        self._put_acks.setdefault((sock, ident), []).append(rid)

    def _store(self, entry: _Entry) -> None:
        self._queued[entry.gid] = entry
        if entry.min_version >= 0:
            self._low_version = min(self._low_version, entry.min_version)
        self._bytes += entry.nbytes

    def _admit_parked(self) -> None:
        while self._parked and self._has_room(self._parked[0][3].nbytes):
            sock, ident, rid, entry = self._parked.popleft()
            self._parked_ids.discard(entry.gid)
            self._accept(sock, ident, rid, entry)

    def _forget(self, entry: _Entry) -> None:
        self._bytes -= entry.nbytes
        self._acked[entry.gid] = None
        while len(self._acked) > MAX_REMEMBERED_ACKS:
            self._acked.popitem(last=False)
