"""Write-ahead log of the TransferQueue server: what it acknowledged survives a crash.

With `queue.durable`, the server appends every accepted group to the log *before*
acknowledging the producer, and an ack record once the learner acknowledged the group.
On restart it replays the log: groups put and not acked are queued again, acked ids
are remembered so that a producer re-sending a group the server already took (its ack
was lost in the crash) is deduplicated. Writes reach the page cache before the
producer's ack, which survives `kill -9` of the server; `queue.wal_fsync` also
fsyncs each batch of writes, which survives a machine crash at a cost per batch.

Layout: `wal-<n>.log` segments of records `[kind u8][length u64][crc32 u32][body]`.
A torn record at the tail (crash mid-write) fails its length or CRC and the log is
truncated there. Segments roll at `segment_bytes`; the new segment starts with a
snapshot (learner version, the task cursor, recent acked ids) and the oldest segments
are deleted once every group they hold is acked.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from agentrl.log import get_logger
from agentrl.wire import byte_view

log = get_logger("queue.wal")

PUT, ACK, META, SNAPSHOT = b"P", b"A", b"M", b"S"
_HEAD = struct.Struct("<cQI")
MAX_REMEMBERED_ACKS = 200_000


@dataclass
class Recovered:
    """What a replay of the log found."""

    groups: dict[str, list[bytes]] = field(default_factory=dict)  # gid -> frames, in put order
    acked: OrderedDict[str, None] = field(default_factory=OrderedDict)
    version: int = 0
    tasks: int = 0
    """The task cursor (tasks handed out with admission so far)."""


def _frames_body(gid: str, frames: Sequence[Any]) -> list[Any]:
    bufs = [byte_view(f) for f in frames]
    head = msgpack.packb([gid, [len(b) for b in bufs]])
    return [struct.pack("<I", len(head)), head, *bufs]


class WriteAheadLog:
    """Append-only, segment-rolling log; one writer (the server thread)."""

    def __init__(self, directory: str | Path, fsync: bool = False, segment_bytes: int = 1 << 30) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self._segment_of: dict[str, int] = {}  # live gid -> segment number
        self._live_per_segment: dict[int, int] = {}
        self._file = None
        self._segment = 0
        self._older: list[int] = []  # closed segments, oldest first
        self._dirty = False

    # ------------------------------------------------------------------ replay

    def _segments(self) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in self.dir.glob("wal-*.log"))

    def _path(self, n: int) -> Path:
        return self.dir / f"wal-{n:08d}.log"

    def recover(self) -> Recovered:
        """Replay every segment, truncate a torn tail, and open the log for appends."""
        out = Recovered()
        segments = self._segments()
        for n in segments:
            self._replay(n, out, last=n == segments[-1])
        self._segment = segments[-1] if segments else 1
        self._older = segments[:-1]
        self._file = open(self._path(self._segment), "ab")  # noqa: SIM115 - held open for appends
        return out

    def _replay(self, n: int, out: Recovered, last: bool) -> None:
        path = self._path(n)
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            if pos + _HEAD.size > len(data):
                break
            kind, length, crc = _HEAD.unpack_from(data, pos)
            body = memoryview(data)[pos + _HEAD.size : pos + _HEAD.size + length]
            if len(body) != length or zlib.crc32(body) != crc:
                break
            self._apply(kind, body, n, out)
            pos += _HEAD.size + length
        if pos < len(data):
            log.warning("WAL %s: torn or corrupt record at byte %d of %d, truncating", path, pos, len(data))
            with open(path, "r+b") as f:
                f.truncate(pos)

    def _apply(self, kind: bytes, body: memoryview, segment: int, out: Recovered) -> None:
        if kind == PUT:
            (hlen,) = struct.unpack_from("<I", body)
            gid, lengths = msgpack.unpackb(body[4 : 4 + hlen])
            pos, frames = 4 + hlen, []
            for length in lengths:
                frames.append(bytes(body[pos : pos + length]))
                pos += length
            if gid not in out.acked and gid not in out.groups:
                out.groups[gid] = frames
                self._track(gid, segment)
        elif kind == ACK:
            for gid in msgpack.unpackb(body):
                out.groups.pop(gid, None)
                self._untrack(gid)
                out.acked[gid] = None
        elif kind == META:
            out.version, out.tasks = msgpack.unpackb(body)
        elif kind == SNAPSHOT:
            snap = msgpack.unpackb(body)
            out.version, out.tasks = snap["version"], snap.get("tasks", snap.get("started", 0))
            out.acked.update((gid, None) for gid in snap["acked"])
        while len(out.acked) > MAX_REMEMBERED_ACKS:
            out.acked.popitem(last=False)

    def _track(self, gid: str, segment: int) -> None:
        self._segment_of[gid] = segment
        self._live_per_segment[segment] = self._live_per_segment.get(segment, 0) + 1

    def _untrack(self, gid: str) -> None:
        segment = self._segment_of.pop(gid, None)
        if segment is not None:
            self._live_per_segment[segment] -= 1

    # ------------------------------------------------------------------ appends

    def _write(self, kind: bytes, parts: Iterable[Any]) -> None:
        parts = list(parts)
        crc, length = 0, 0
        for part in parts:
            crc = zlib.crc32(part, crc)
            length += len(part)
        self._file.write(_HEAD.pack(kind, length, crc))
        for part in parts:
            self._file.write(part)
        self._dirty = True

    def append_put(self, gid: str, frames: Sequence[Any]) -> None:
        self._write(PUT, _frames_body(gid, frames))
        self._track(gid, self._segment)

    def append_ack(self, gids: list[str]) -> None:
        self._write(ACK, [msgpack.packb(gids)])
        for gid in gids:
            self._untrack(gid)

    def append_meta(self, version: int, tasks: int) -> None:
        self._write(META, [msgpack.packb([version, tasks])])

    def commit(self) -> None:
        """Make the appends so far durable (page cache, plus fsync when asked)."""
        if not self._dirty:
            return
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        self._dirty = False

    def maybe_roll(self, version: int, tasks: int, acked: Iterable[str]) -> None:
        """Start a new segment when this one is full; delete leading segments with no live group."""
        if self._file.tell() >= self.segment_bytes:
            self.commit()
            self._file.close()
            self._segment += 1
            self._file = open(self._path(self._segment), "ab")  # noqa: SIM115
            snap = {"version": version, "tasks": tasks, "acked": list(acked)[-MAX_REMEMBERED_ACKS:]}
            self._write(SNAPSHOT, [msgpack.packb(snap)])
            self.commit()
            self._older.append(self._segment - 1)
        # the acked ids of a deleted segment live on in the snapshot that opens every later one
        while self._older and self._live_per_segment.get(self._older[0], 0) == 0:
            n = self._older.pop(0)
            self._path(n).unlink(missing_ok=True)
            self._live_per_segment.pop(n, None)

    def close(self) -> None:
        if self._file is not None:
            self.commit()
            self._file.close()
            self._file = None
