"""The roller's side of the ZeroMQ TransferQueue: `ZmqProducer` (asyncio).

A DEALER socket talking to the server's ROUTER with `[mac, control, *payload]` messages (see
`zmq_server.py`; the learner's side is `zmq_consumer.py`). Every request carries an id and is
kept until answered; every reply carries the server's *epoch* (random per server start). When
the producer sees a new epoch, the server restarted: it re-sends everything unanswered, and the
server deduplicates puts by group id. So a `put` survives a server crash and restart (with
`durable`, nothing it was told is stored is lost).

The producer coalesces puts that are waiting to be sent into one message (up to
`COALESCE_BYTES`), which is what makes small groups cheap; a large group goes alone.
Arrays are sent with `copy=False`: do not modify a group's arrays after `put`. `ByteWindow`
bounds the bytes it has unacknowledged.

Every producer message carries its lease (`l`), the admission credits it holds (`h`), who it
is (`w`) and, once known, the run (`r`); its heartbeat (`_ping_loop`, every `heartbeat_s`)
keeps the lease alive (see `zmq_admission.py`). Nobody waits in silence: a producer that hears
nothing within `connect_timeout_s` (a wrong address, or a wrong secret: the server answers no
message whose MAC fails, and logs it at WARNING), that belongs to another run, or whose queue
stays silent for `silent_timeout_s` fails every call with `QueueUnavailable` naming what to
check; a finished run fails them with `RunOver`; a lapsed lease fails the puts admitted under it
with `LeaseLapsed` and starts a fresh lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections import deque
from collections.abc import Callable

import msgpack
import zmq
import zmq.asyncio

from agentrl.inference.server_list import Follower
from agentrl.log import get_logger
from agentrl.queue.auth import Authenticator
from agentrl.queue.base import (
    Admission,
    LeaseLapsed,
    Producer,
    QueueError,
    QueueUnavailable,
    RunOver,
)
from agentrl.queue.frames import pack
from agentrl.types import Group
from agentrl.wire import encode_group

log = get_logger("queue.producer")

COALESCE_BYTES = 256 << 10
COALESCE_GROUPS = 512
FIN_SETTLE_S = 5.0
"""After the run is over, how long puts already sent wait for the queue's own answer to them (the
queue stores a put that reaches it after the end, and says so in its reply)."""


class ByteWindow:
    """Bounds the bytes a producer has unacknowledged. Waiters get in first come, first served,
    and a release wakes only those that now fit: with a shared event every waiting coroutine
    woke on every ack just to wait again, which cost more than the MAC with hundreds of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit  # one oversized put goes alone

    async def acquire(self, nbytes: int) -> None:
        if not self._waiters and self._fits(nbytes):
            self.used += nbytes
            return
        granted = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, granted))
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(nbytes)  # granted just as the caller was cancelled
            raise

    def release(self, nbytes: int) -> None:
        self.used -= nbytes
        while self._waiters and (self._waiters[0][1].done() or self._fits(self._waiters[0][0])):
            nbytes, granted = self._waiters.popleft()
            if not granted.done():  # not cancelled while it waited
                self.used += nbytes
                granted.set_result(None)


class ZmqProducer(Follower, Producer):
    """Sends groups to the queue server; one per roller process, shared by its coroutines."""

    def __init__(
        self,
        address: str,
        auth: Authenticator,
        window_bytes: int = 256 << 20,
        heartbeat_s: float = 2.0,
        connect_timeout_s: float = 30.0,
        silent_timeout_s: float = 120.0,
        run_id: str | None = None,
        name: str = "producer",
        secret_env: str = "AGENTRL_QUEUE_SECRET",
    ) -> None:
        self.address = address
        self.auth = auth
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.connect_timeout_s = connect_timeout_s
        self.silent_timeout_s = silent_timeout_s
        self.run_id = run_id
        self.secret_env = secret_env
        self.lease = self._new_lease()
        self.held = 0  # admission credits granted and not yet spent by a put or given back
        self.fatal: QueueError | None = None
        self.lapses = 0
        self._window = ByteWindow(window_bytes)
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[dict, list, asyncio.Future]] = {}  # rid -> (ctl, frames, future)
        self._outbox: deque[int] = deque()
        self._epoch: str | None = None
        self._version = 0
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._t0 = self._last_heard = 0.0
        self._heard = False
        self.max_staleness: int | None = None  # the run's, as the queue says in every reply
        self.on_max_staleness: Callable[[int], None] | None = None
        self.on_version: Callable[[int], None] | None = None

    def _new_lease(self) -> str:
        return f"{self.name}-{os.getpid()}-{os.urandom(3).hex()}"

    def _ensure_started(self) -> None:
        if self.fatal is not None:
            raise self.fatal
        if self._sock is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.address)
        self._wake = asyncio.Event()
        self._t0 = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._send_loop(), name="queue-producer-send"),
            asyncio.create_task(self._recv_loop(), name="queue-producer-recv"),
            asyncio.create_task(self._ping_loop(), name="queue-producer-ping"),
        ]

    async def _call(self, ctl: dict, frames: list | None = None) -> dict:
        self._ensure_started()
        rid = next(self._ids)
        ctl["rid"] = rid
        future = asyncio.get_running_loop().create_future()
        self._pending[rid] = (ctl, frames or [], future)
        self._outbox.append(rid)
        self._wake.set()
        try:
            return await future
        finally:
            self._pending.pop(rid, None)

    async def put(self, group: Group) -> None:
        frames = encode_group(group)
        nbytes = sum(map(len, frames))
        self._ensure_started()
        await self._window.acquire(nbytes)
        try:
            await self._send_group(group, frames)
        finally:
            self._window.release(nbytes)

    async def _send_group(self, group: Group, frames: list) -> None:
        await self._call({"k": "put", "gid": group.group_id}, frames)

    async def acquire_start(self, n: int = 1) -> Admission:
        ctl = {"k": "acq", "n": n}
        try:
            reply = await self._call(ctl)
        except asyncio.CancelledError:  # withdraw the request, or give back what was granted
            if self._sock is not None and self.fatal is None:
                await self._send({"k": "cancel", "rid": ctl["rid"], "n": n}, [])
            raise
        return Admission(reply["v"], reply.get("t", -1))

    async def release_start(self, n: int = 1) -> None:
        await self._call({"k": "rel", "n": n})

    async def current_version(self) -> int:
        return (await self._call({"k": "ping"}))["v"]

    async def _send_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outbox:
                rid = self._outbox.popleft()
                if rid not in self._pending or self._pending[rid][2].done():
                    continue
                ctl, frames, _ = self._pending[rid]
                if ctl["k"] != "put":
                    await self._send(ctl, frames)
                    continue
                items, payload, size = [[rid, ctl["gid"], len(frames)]], list(frames), sum(map(len, frames))
                while self._outbox and size < COALESCE_BYTES and len(items) < COALESCE_GROUPS:
                    nxt = self._pending.get(self._outbox[0])
                    if nxt is None or nxt[0]["k"] != "put" or nxt[2].done():
                        break
                    self._outbox.popleft()
                    items.append([nxt[0]["rid"], nxt[0]["gid"], len(nxt[1])])
                    payload.extend(nxt[1])
                    size += sum(map(len, nxt[1]))
                lens, counts, segments = pack(payload)
                await self._send({"k": "put", "items": items, "lens": lens, "segs": counts}, segments)

    def _stamp(self, ctl: dict) -> bytes:
        """The control frame with this producer's lease, credits, name and run (read at send time,
        so a restarted server learns what the producer holds now)."""
        ctl = {**ctl, "l": self.lease, "h": self.held, "w": self.name}
        if self.run_id is not None:
            ctl["r"] = self.run_id
        return msgpack.packb(ctl)

    async def _send(self, ctl: dict, payload: list) -> None:
        control = self._stamp(ctl)
        await self._sock.send_multipart([self.auth.sign(control, payload), control, *payload], copy=False)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._sock.recv_multipart(copy=False)
            if (ctl := self.auth.read_reply(msg, "producer")) is None:
                continue
            self._heard, self._last_heard = True, time.monotonic()
            if ctl.get("fin") and ctl.get("k") == "ok" and ctl.get("r") == self.run_id:
                # what the server did before the run ended still happened: a put it stored is put
                self._settle_reply(ctl)
            if self._check_run(ctl):
                return
            if isinstance(self.fatal, RunOver):  # the run is over; puts in flight still await answers
                self._settle_reply(ctl)
                if not self._puts_in_flight():
                    return
                continue
            if "v" in ctl:
                self._version = int(ctl["v"])
                if self.on_version is not None:
                    self.on_version(self._version)
            self._told_max_staleness(ctl.get("ms"))
            self.told(ctl.get("sl"))  # the launcher's live list (`inference.server_list.Follower`)
            if self._epoch is not None and ctl.get("e") != self._epoch:
                log.warning(
                    "queue server restarted (epoch %s -> %s): re-sending %d requests under lease %s "
                    "(%d credits held)",
                    self._epoch,
                    ctl.get("e"),
                    len(self._pending),
                    self.lease,
                    self.held,
                )
                answered = set(ctl.get("rids", [ctl.get("rid")]))  # this reply settles them: not again
                self._outbox.extend(sorted(rid for rid in self._pending if rid not in answered))
                self._wake.set()
            self._epoch = ctl.get("e")
            if ctl.get("code") == "lapsed":
                self._lapsed()
                continue
            self._settle_reply(ctl)

    def _settle_reply(self, ctl: dict) -> None:
        for rid in ctl.get("rids", [ctl.get("rid")]):
            waiting = self._pending.get(rid)
            if waiting is None or waiting[2].done():
                continue
            self._settle(waiting[0], waiting[2], ctl)

    def _settle(self, request: dict, future: asyncio.Future, reply: dict) -> None:
        kind = request["k"]
        if kind in ("put", "nput"):
            self.held = max(0, self.held - 1)  # stored, deduplicated or refused: the credit is spent
        elif kind == "acq" and reply["k"] == "ok":
            self.held += int(request["n"])
        elif kind == "rel":
            self.held = max(0, self.held - int(request["n"]))
        if reply["k"] != "err":
            future.set_result(reply)
        elif reply.get("code") == "finished":
            future.set_exception(RunOver(f"the run is over (learner finished at version {reply.get('v')})"))
        else:
            future.set_exception(QueueError(f"queue server refused the request: {reply['msg']}"))

    def _told_max_staleness(self, ms: int | None) -> None:
        if ms is None or ms == self.max_staleness:
            return
        if self.max_staleness is not None:
            log.warning("the queue's max_staleness changed from %d to %d", self.max_staleness, ms)
        self.max_staleness = int(ms)
        if self.on_max_staleness is not None:
            self.on_max_staleness(self.max_staleness)

    def _check_run(self, ctl: dict) -> bool:
        """Adopt the server's run id, or fail on another run's queue / a finished run; True: stop."""
        run = ctl.get("r")
        if self.run_id is None and run is not None:
            self.run_id = run
            log.info("joined run %s on the queue at %s", run, self.address)
        if ctl.get("code") == "run" or (run is not None and run != self.run_id):
            self._fail(
                QueueUnavailable(
                    f"the queue at {self.address} now serves run {run!r}, not this roller's run {self.run_id!r}: "
                    "the run it joined is over (or queue.run_id differs); not joining another run"
                )
            )
            return True
        if ctl.get("fin"):
            self._fail(
                RunOver(f"the run is over: the learner finished at version {ctl.get('v')}"), puts_wait=True
            )
            return not self._puts_in_flight()
        return False

    def _puts_in_flight(self) -> bool:
        return any(c["k"] in ("put", "nput") and not f.done() for c, _, f in self._pending.values())

    def _lapsed(self) -> None:
        """The queue reclaimed our lease: puts admitted under it are refused, and we start afresh."""
        old, self.lease, self.held = self.lease, self._new_lease(), 0
        self.lapses += 1
        failed = 0
        for ctl, _, future in list(self._pending.values()):
            if ctl["k"] in ("put", "nput") and not future.done():
                future.set_exception(LeaseLapsed(f"lease {old} lapsed; group {ctl['gid']} was not taken"))
                failed += 1
            elif ctl["k"] == "rel" and not future.done():
                future.set_result({"k": "ok", "v": self._version})  # nothing left to give back
        log.warning(
            "queue says lease %s lapsed (no message reached it within queue.roller_lease_s; a partition or "
            "a stall): %d puts under it refused; continuing under lease %s",
            old,
            failed,
            self.lease,
        )
        self._outbox.extend(sorted(rid for rid, p in self._pending.items() if not p[2].done()))
        self._wake.set()

    def _fail(self, exc: QueueError, puts_wait: bool = False) -> None:
        """Every pending and later call raises `exc`. With `puts_wait` (the run is over), puts
        already in flight first get `FIN_SETTLE_S` for the queue's answer: one it stored counts
        as put, not as lost to the end of the run."""
        if self.fatal is not None:
            return
        self.fatal = exc
        log.error("%s", exc) if not isinstance(exc, RunOver) else log.info("%s", exc)
        for ctl, _, future in self._pending.values():
            if not future.done() and not (puts_wait and ctl["k"] in ("put", "nput")):
                future.set_exception(exc)
        if puts_wait and self._puts_in_flight():
            asyncio.get_running_loop().call_later(FIN_SETTLE_S, self._fail_rest, exc)

    def _fail_rest(self, exc: QueueError) -> None:
        for _, _, future in self._pending.values():
            if not future.done():
                future.set_exception(exc)

    async def _ping_loop(self) -> None:
        """The heartbeat: renews the lease, detects a restarted server, and times the silences."""
        while self.fatal is None:
            await self._send({"k": "ping", "rid": 0}, [])
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            if not self._heard and now - self._t0 > self.connect_timeout_s:
                self._fail(
                    QueueUnavailable(
                        f"no answer from the queue at {self.address} within queue.connect_timeout_s="
                        f"{self.connect_timeout_s:g}s: check the address (the learner's queue.address, or "
                        "`agentrl queue --bind`), that the learner or queue is running and reachable from "
                        f"here, and that ${self.secret_env} holds the queue's secret (a message with a wrong "
                        "MAC is never answered; the queue logs it)"
                    )
                )
            elif self._heard and now - self._last_heard > self.silent_timeout_s:
                self._fail(
                    QueueUnavailable(
                        f"the queue at {self.address} has been silent for {now - self._last_heard:.0f}s "
                        f"(queue.silent_timeout_s={self.silent_timeout_s:g}): the learner or queue is gone"
                    )
                )

    def close(self) -> None:
        """Give back the credits still held (a `bye`, best effort) and release the socket."""
        for task in self._tasks:
            task.cancel()
        if self._sock is not None:
            if self.fatal is None or isinstance(self.fatal, RunOver):
                control = self._stamp({"k": "bye", "rid": 0})
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.send_multipart([self.auth.sign(control, []), control], flags=zmq.NOBLOCK)
            self._sock.close(linger=500)
            self._ctx.term()
            self._sock = None
