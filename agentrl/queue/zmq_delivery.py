"""Handing groups out: the learner-side half of the queue server's state machine.

`QueueServer` (zmq_server.py) owns the sockets and the loop, `Intake` (zmq_intake.py) puts,
capacity and the WAL append; this mixin holds what the learner ranks and the admission gate ask
of it:

- `get`: a rank asks for n whole groups admissible at version v with staleness k; groups
  that became inadmissible are dropped and counted (and give their admission back); the
  request waits, up to its deadline, until n are queued; FIFO or oldest-first;
- `ack`: trained on; forgotten (and an ack record in the WAL); acks with `drop` = stale / skipped count as drops and return admission;
- `hello`: a rank (re)started under its name gets back what it held and had not acked;
- `pub`: the learner's version (admission, in `zmq_admission.py`, follows it).

Every group put ends in exactly one of: trained (`trained`), dropped (`dropped_stale`,
`dropped_skipped`), still queued (`depth`) or handed out (`inflight`):
`groups_in + recovered == trained + dropped_stale + dropped_skipped + depth + inflight`
(`recovered`: found in the WAL at start).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from agentrl.log import get_logger
from agentrl.queue.base import DROP_REASONS
from agentrl.queue.frames import pack
from agentrl.queue.zmq_admission import PeerRefused
from agentrl.types import Group

log = get_logger("queue.server")


@dataclass(slots=True)
class _Entry:
    gid: str
    frames: list[Any]
    nbytes: int
    min_version: int
    seq: int
    t_in: float
    group: Group | None = None  # decoded (validated) views of `frames`
    holder: str | None = None
    lease_until: float = 0.0
    handed_version: int = -1  # the learner version it was last handed out for
    max_version: int | None = None  # newest generated token's version, once per-token staleness asks


@dataclass
class _Get:
    sock: zmq.Socket
    ident: bytes
    rid: int
    n: int
    version: int
    max_staleness: int
    deadline: float | None
    name: str
    dropped: int = 0


_NO_VERSION = np.iinfo(np.int32).max


class Delivery:
    """Mixin of `QueueServer`: get / ack / hello / pub / stats handlers (its state lives there)."""

    def _stale_key(self, entry: _Entry) -> int:
        """The version staleness is judged by: the oldest generated token's, or with per-token
        staleness the newest's (a group stays while any token is within the bound)."""
        if not self.per_token_staleness:
            return entry.min_version
        if entry.max_version is None:
            entry.max_version = entry.group.max_version if entry.group is not None else entry.min_version
        return entry.max_version

    def _drop_stale(self, version: int, max_staleness: int) -> int:
        # `_low_version` bounds every queued key from below (min_version ≤ the newest version)
        if self._low_version >= version - max_staleness:  # nothing queued can be stale: skip the scan
            return 0
        self._low_version = min(
            (k for e in self._queued.values() if (k := self._stale_key(e)) >= version - max_staleness),
            default=_NO_VERSION,
        )
        stale = [
            e for e in self._queued.values() if (k := self._stale_key(e)) >= 0 and version - k > max_staleness
        ]
        for entry in stale:
            del self._queued[entry.gid]
            self._forget(entry)
        if stale:
            self.counters["dropped_stale"] += len(stale)
            self._ledger("dropped_stale", [e.gid for e in stale])
            if self.wal is not None:
                self.wal.append_ack([e.gid for e in stale])
            self._admit_parked()
            self._grant_acqs()
        return len(stale)

    # ---------------------------------------------------------------- consumers

    def _on_hello(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        for key, mine, field in (
            ("gps", self.groups_per_step, "learner.groups_per_step"),
            ("ms", self.max_staleness, "max_staleness"),
        ):
            if ctl.get(key) is not None and int(ctl[key]) != mine:
                raise PeerRefused(
                    "config",
                    f"{field}: the learner has {ctl[key]} but this queue was started with {mine}; "
                    "start `agentrl queue` with the learner's config",
                )
        if ctl.get("pt") is not None and bool(ctl["pt"]) != self.per_token_staleness:
            theirs, mine = ("token", "group") if ctl["pt"] else ("group", "token")
            raise PeerRefused(
                "config",
                f"learner.staleness: the learner has {theirs} but this queue was started with {mine}; "
                "start `agentrl queue` with the learner's config",
            )
        held = [e for e in self._inflight.values() if e.holder == ctl["c"]]
        self._requeue(held)
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"], "requeued": len(held)})

    def _requeue(self, entries: list[_Entry]) -> None:
        if not entries:
            return
        for entry in entries:
            del self._inflight[entry.gid]
            entry.holder = None
            self._queued[entry.gid] = entry
            if entry.min_version >= 0:
                self._low_version = min(self._low_version, entry.min_version)
        self.counters["redelivered"] += len(entries)
        self._queued = dict(sorted(self._queued.items(), key=lambda kv: kv[1].seq))

    def _on_get(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        rid, n = ctl["rid"], int(ctl["n"])
        last = self._last_batch.get(ident)
        if last is not None and last[0] == rid:  # a resend of a request already answered
            entries = [self._inflight[g] for g in last[1] if g in self._inflight]
            self._send_batch(_Get(sock, ident, rid, n, ctl["v"], ctl["s"], None, ctl["c"]), entries)
            return
        if not 1 <= n <= self.config.capacity_groups:
            raise ValueError(f"get: num_groups must be 1..capacity_groups={self.config.capacity_groups}")
        timeout = ctl.get("t")
        deadline = None if timeout is None else time.monotonic() + float(timeout)
        self._set_version(max(self.version, int(ctl["v"])))
        self._gets[ident] = _Get(sock, ident, rid, n, int(ctl["v"]), int(ctl["s"]), deadline, ctl["c"])
        self._serve_gets()

    def _serve_gets(self) -> None:
        for ident, get in list(self._gets.items()):
            get.dropped += self._drop_stale(get.version, get.max_staleness)
            if len(self._queued) < get.n:
                continue
            if self.config.selection == "oldest_first":
                chosen = sorted(self._queued.values(), key=lambda e: (e.min_version, e.seq))[: get.n]
            else:
                chosen = [e for _, e in zip(range(get.n), self._queued.values(), strict=False)]
            del self._gets[ident]
            now, lease = time.time(), time.monotonic() + self.config.lease_s
            for entry in chosen:
                del self._queued[entry.gid]
                entry.holder, entry.lease_until, entry.handed_version = get.name, lease, get.version
                self._inflight[entry.gid] = entry
                self._ages.append(now - entry.t_in)
            self.counters["groups_out"] += len(chosen)
            self._last_batch[ident] = (get.rid, [e.gid for e in chosen])
            self._send_batch(get, chosen)

    def _send_batch(self, get: _Get, entries: list[_Entry]) -> None:
        now = time.time()
        meta = [
            [e.gid, len(e.frames), now - e.t_in, get.version - e.min_version if e.min_version >= 0 else 0]
            for e in entries
        ]
        ctl = {"k": "batch", "rid": get.rid, "groups": meta, "dropped": get.dropped}
        if self._names[get.sock] == "local":  # the consumer takes the Group objects (local_groups)
            self._reply(get.sock, get.ident, ctl)
            return
        ctl["lens"], ctl["segs"], segments = pack([f for e in entries for f in e.frames])
        self._reply(get.sock, get.ident, ctl, segments)

    def local_groups(self, gids: list[str]) -> dict[str, Group]:
        """The decoded groups handed to an in-process consumer (they stay until acked)."""
        with self._lock:
            entries = (self._inflight.get(g) or self._queued.get(g) for g in gids)
            return {e.gid: e.group for e in entries if e is not None}

    def _on_ack(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        done, reason = [], ctl.get("drop")
        for gid in ctl["ids"]:
            entry = self._inflight.pop(gid, None) or self._queued.pop(gid, None)
            if entry is not None:
                self._forget(entry)
                done.append(gid)
                if reason is None:
                    self._trained(entry.handed_version)
        if done and reason in DROP_REASONS:
            counter = "trained" if reason is None else f"dropped_{reason}"
            self.counters[counter] += len(done)
            self._ledger(counter, done)
            self._grant_acqs()
        if done and self.wal is not None:
            self.wal.append_ack(done)
        self._admit_parked()
        self._serve_gets()
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"], "acked": len(done)})

    def _on_pub(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        self._set_version(int(ctl["v"]))
        self.tasks_issued = max(self.tasks_issued, int(ctl.get("t", 0)))  # a resumed learner's cursor
        if self.wal is not None:
            self.wal.append_meta(self.version, self.tasks_issued)
        self._drop_stale(self.version, self.max_staleness)
        self._grant_acqs()
        self._serve_gets()
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"]})

    def _on_stats(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"], "m": self._metrics()})

    def _on_sl(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        """A learner consuming from this standalone queue hands on the launcher's live list
        (`inference.server_list.Publisher`), carried from now on in every reply (`sl`). The
        learner's list replaces what the queue has, whatever its epoch (a new launcher life
        starts again at epoch 1); producers apply newer epochs only."""
        from agentrl.inference.server_list import as_wire, parse

        sl = ctl.get("sl")
        if not isinstance(sl, list) or len(sl) != 3:
            raise ValueError(f"server list: expected [epoch, urls, services], got {sl!r}")
        found = parse({"epoch": sl[0], "urls": sl[1], "services": sl[2]})
        if self.servers != as_wire(found):
            self.servers = as_wire(found)
            log.info("server list epoch %d from the learner: %s %s (carried to the producers)", found.epoch,
                     list(found.urls), found.services)  # fmt: skip
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"]})

    def _on_ping(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"]})
