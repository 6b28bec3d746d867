"""The TransferQueue server: one thread, one ZeroMQ context, bounded and staleness-aware.

Hosted by the learner in-process (`QueueServer(...).start()`) or on its own by
`agentrl queue --bind tcp://0.0.0.0:PORT`. It binds a ROUTER socket at the public
address (every message MAC-checked, see `auth.py`) and a second ROUTER on `inproc://`
for a consumer in the same process (no network, no MAC, zero-copy).

Messages are `[mac, control, *payload]`; `control` is a small msgpack map with a kind
`k`, and a put's payload is the group frames of `agentrl.wire.encode_group` (several
groups may share one message). Payload frames are received with `copy=False`, kept as
they arrived and forwarded to the consumer as the same buffers.

This file holds the sockets, the loop, start-up (WAL recovery), replies and timers; taking
groups in (put / nput, capacity, backpressure, the WAL append) is the `Intake` mixin in
`zmq_intake.py`, handing them out (get / ack / versions) the `Delivery` mixin in
`zmq_delivery.py`, and admission under rollers' leases (acq / rel / heartbeats / run id /
finish) the `Admission` mixin in `zmq_admission.py`. Every message is first checked against the
run and the sender's lease.

What the loop does each turn (`_loop`):
1. receive what is waiting on both sockets and handle each message (`_handle`);
2. expire leases (unacked groups go back to the queue; lapsed rollers' admission credits are
   reclaimed) and answer `get`s whose deadline passed; a turn that comes more than `STALL_S`
   after the last (the process was stopped or starved) expires nothing: the messages that
   renew leases may still be unread in the sockets, so expiry waits for the next turn that has
   read everything waiting (a dead roller's lease is not extended: it lapses at that turn);
3. commit the write-ahead log, then send the replies — so a producer's ack always
   follows the WAL write of its group. Without fsync, puts are acked after each message
   instead (commit, then send), so a producer refills its window while the next message is
   decoded rather than waiting for the whole turn; with `wal_fsync` the turn's writes share
   one fsync.

Flow control (`zmq_intake.py`): queued plus handed-out groups stay within `capacity_groups`
and `capacity_bytes`; a put that does not fit is held unanswered until room frees up.

With a `ledger` path the server keeps `ledger.py`'s ledger (what it took without an fsynced WAL,
what was trained or dropped, what it still held at `stop()`): the per-group account of
`agentrl/queue/account.py`, and the count of acknowledged groups a previous life lost
(`lost_undurable`): held by a durability-off queue that died, or cut from the WAL's tail.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import msgpack
import zmq

from agentrl.inference.server_list import Reader, as_wire
from agentrl.log import get_logger
from agentrl.queue.auth import Authenticator, AuthError, load_secret
from agentrl.queue.base import QueueError
from agentrl.queue.ledger import Ledger
from agentrl.queue.wal import WriteAheadLog
from agentrl.queue.zmq_admission import Admission, PeerRefused
from agentrl.queue.zmq_delivery import _NO_VERSION, Delivery, _Entry, _Get
from agentrl.queue.zmq_intake import Intake
from agentrl.wire import WireError, decode_groups

log = get_logger("queue.server")

COALESCE_SLACK = 8 << 20  # a put message may carry several small groups beyond one group's limit
REFUSAL_LOG_S = 10.0  # refusals are logged at WARNING at most this often (with the count since)
STALL_S = 1.0  # turns of the loop further apart than this are a stall (a turn polls at most 50 ms)


def _recv(sock: zmq.Socket) -> list[zmq.Frame]:
    """`recv_multipart(NOBLOCK, copy=False)` without its getsockopt(RCVMORE) per frame: each
    frame says whether more follow (the parts of a message arrive together)."""
    msg = [sock.recv(zmq.NOBLOCK, copy=False)]
    while msg[-1].more:
        msg.append(sock.recv(zmq.NOBLOCK, copy=False))
    return msg


def _run_id(given: str | None, wal_dir: Path | None) -> str:
    """The given run id, else the one a durable queue recorded in its WAL folder, else a new one."""
    if given:
        return given
    if wal_dir is None:
        return os.urandom(6).hex()
    path = wal_dir / "run_id"
    if path.exists():
        return path.read_text().strip()
    wal_dir.mkdir(parents=True, exist_ok=True)
    run_id = os.urandom(6).hex()
    path.write_text(run_id + "\n")
    return run_id


class QueueServer(Admission, Intake, Delivery):
    """The queue's state machine and its socket thread. `start()`, `stop()`, `metrics()`."""

    def __init__(
        self,
        config: Any,
        groups_per_step: int,
        max_staleness: int,
        bind: str | None = None,
        wal_dir: str | Path | None = None,
        run_id: str | None = None,
        ledger: str | Path | None = None,
        servers_file: str | Path | None = None,
        per_token_staleness: bool = False,
    ) -> None:
        """`run_id`: the run this queue serves (else `config.run_id`, else the WAL's, else new).
        `ledger`: a JSONL file of trained / dropped group ids (see the module docstring).
        `servers_file`: the launcher's live server list (`inference.server_list`), reread every
        0.5 s and carried in every reply (`sl`: [epoch, urls, services]) to the producers (their
        routers, and their env services map). `per_token_staleness` (`learner.staleness: token`):
        a queued group is dropped as stale only once its newest generated token is past the bound."""
        self.config = config
        self.per_token_staleness = per_token_staleness
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.bind = bind or config.address
        secret = load_secret(config.secret_env) if config.auth == "mac" else None
        self._auth = {"public": Authenticator(secret), "local": Authenticator(None)}
        self.inproc_address = f"inproc://agentrl-queue-{os.getpid()}-{id(self)}"
        self.context = zmq.Context()
        self.epoch = os.urandom(4).hex()
        self.endpoint: str | None = None
        self.wal: WriteAheadLog | None = None
        wal_path = Path(wal_dir or config.wal_dir or "runs/default/queue_wal") if config.durable else None
        if wal_path is not None:
            self.wal = WriteAheadLog(wal_path, config.wal_fsync)
        self._ledger_path = Path(ledger) if ledger is not None else None
        self.ledger: Ledger | None = None
        self._queued: dict[str, _Entry] = {}
        self._inflight: dict[str, _Entry] = {}
        self._acked: OrderedDict[str, None] = OrderedDict()
        self._parked: deque[tuple[zmq.Socket, bytes, int, _Entry]] = deque()
        self._parked_ids: set[str] = set()
        self._gets: dict[bytes, _Get] = {}
        self._last_batch: dict[bytes, tuple[int, list[str]]] = {}
        self._replies: list[tuple[zmq.Socket, bytes, dict, list]] = []
        self._put_acks: dict[tuple[zmq.Socket, bytes], list[int]] = {}
        self.version = 0
        self._low_version = _NO_VERSION  # lower bound of min_version over queued groups
        self._next_lease_check = 0.0
        self._last_tick = time.monotonic()
        self._expiry_held = False  # a stall was seen: expire nothing until the sockets are drained
        self._seq = 0
        self._bytes = 0
        self._ages: deque[float] = deque(maxlen=4096)
        self.counters = dict.fromkeys(
            (
                "groups_in",
                "groups_out",
                "trained",
                "recovered",
                "bytes_in",
                "dropped_stale",
                "dropped_skipped",
                "duplicates",
                "redelivered",
                "refused_auth",
                "refused_corrupt",
                "refused_oversize",
                "nixl_reads",
                "lost_undurable",
            ),
            0,
        )
        self._servers_file = None
        if servers_file is not None:
            self._servers_file = Reader(servers_file)
        self.servers: list | None = None  # [epoch, urls, services] of the live list, once there is one
        self._next_servers_check = 0.0
        self._init_admission(_run_id(run_id or config.run_id, wal_path))
        self._refusals: dict[str, list[float]] = {}  # kind -> [count since logged, last logged]
        self._nixl: Any = None
        self._nixl_busy: set[str] = set()
        if getattr(config, "nixl", False):
            from agentrl.queue.nixl_transport import NixlReader

            self._nixl = NixlReader(f"queue-server-{os.getpid()}-{self.epoch}", config.capacity_bytes)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> QueueServer:
        """Recover the WAL, bind, and serve in a daemon thread; raises if binding fails."""
        if self.wal is not None:
            self._recover()
        if self._ledger_path is not None:
            durable = self.wal is not None
            found = [*self._queued, *self._acked] if durable else None  # what the WAL replay knows
            self.ledger = Ledger(self._ledger_path, self.epoch, durable, self.version,
                                 wal_fsync=durable and self.wal.fsync, wal_found=found)  # fmt: skip
            self.counters["lost_undurable"] = self.ledger.lost_before
        self._thread = threading.Thread(target=self._run, name="agentrl-queue-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        log.info(
            "queue server on %s (run %s, epoch %s, durable=%s)",
            self.endpoint,
            self.run_id,
            self.epoch,
            self.wal is not None,
        )
        return self

    def stop(self) -> None:
        """Stop serving, close the sockets and the WAL (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.wal is not None:
                self.wal.close()
            if self.ledger is not None:
                self.ledger.close([*self._queued, *self._inflight, *self._parked_ids])
        if not self.context.closed:
            self.context.term()

    def serve_forever(self) -> None:
        """Block the calling thread until interrupted (the standalone `agentrl queue`)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def _recover(self) -> None:
        found = self.wal.recover()
        self._acked = found.acked
        self.version, self.tasks_issued = found.version, found.tasks
        decoded = decode_groups(list(found.groups.values()), max_bytes=self.config.max_message_bytes)
        for (gid, frames), result in zip(found.groups.items(), decoded, strict=True):
            if isinstance(result, WireError):  # the WAL checksums records, so this is a version skew
                raise result
            self._seq += 1
            nbytes = sum(map(len, frames[1:]))
            self._store(_Entry(gid, frames, nbytes, result[1], self._seq, time.time(), result[0]))
            self.counters["recovered"] += 1
        log.info("WAL: recovered %d unacked groups, version %d", len(self._queued), self.version)

    def _run(self) -> None:
        # signals are for the main thread; an EINTR inside libzmq here would only get in the way
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            public = self._socket(self.bind)
            local = self._socket(self.inproc_address)
            self.endpoint = public.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EADDRINUSE:
                exc = QueueError(
                    f"queue.address {self.bind}: address already in use (another learner or `agentrl queue` "
                    "is bound there). To consume from that standalone queue, run the learner with "
                    "--queue.standalone true; otherwise pick a free port"
                )
            self._error = exc
            self._ready.set()
            return
        except Exception as exc:
            self._error = exc
            self._ready.set()
            return
        self._names = {public: "public", local: "local"}
        self._ready.set()
        poller = zmq.Poller()
        poller.register(public, zmq.POLLIN)
        poller.register(local, zmq.POLLIN)
        self._last_tick = time.monotonic()
        try:
            self._loop(poller, public, local)
        except zmq.ContextTerminated:
            pass
        except Exception:
            log.exception("queue server thread failed")
            raise
        finally:
            public.close(linger=0)
            local.close(linger=0)

    def _loop(self, poller: zmq.Poller, public: zmq.Socket, local: zmq.Socket) -> None:
        while not self._stop.is_set():
            events = dict(poller.poll(1 if self._nixl is not None and self._nixl.pending else 50))
            drained = True
            for sock in (public, local):
                for _ in range(512 if sock in events else 0):
                    try:
                        msg = _recv(sock)
                    except zmq.Again:
                        break
                    with self._lock:
                        self._handle(sock, msg)
                    if self._put_acks and (self.wal is None or not self.wal.fsync):
                        self._commit_and_flush()  # ack now: the producer refills while we go on
                else:
                    drained = drained and sock not in events
            with self._lock:
                if drained:
                    self._expiry_held = False
                if self._nixl is not None and self._nixl.pending:
                    self._finish_nixl_reads()
                self._tick()
                if self.wal is not None:
                    self.wal.commit()
                    self.wal.maybe_roll(self.version, self.tasks_issued, self._acked)
            self._flush()

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        # frames above this make libzmq drop the connection; the app-level check below counts the rest
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes + COALESCE_SLACK)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    # ------------------------------------------------------------------ messages

    def _handle(self, sock: zmq.Socket, msg: list[Any]) -> None:
        if len(msg) < 3:
            self.counters["refused_corrupt"] += 1
            return
        ident, mac, control, *payload = msg[0].bytes, *map(memoryview, msg[1:])
        if sum(map(len, payload)) > self.config.max_message_bytes + COALESCE_SLACK:
            self.counters["refused_oversize"] += 1
            return
        try:
            self._auth[self._names[sock]].verify(mac, control, payload)
        except AuthError as exc:
            self.counters["refused_auth"] += 1
            # never answered (an unauthenticated peer learns nothing); the client times out and says
            # to check the secret, and this WARNING says who is knocking
            self._log_refusal("auth", f"refused a message that failed its MAC ({exc}): a client with another "
                              f"secret than ${self.config.secret_env}, or not an agentrl client")  # fmt: skip
            return
        ctl: Any = None
        try:
            try:
                ctl = msgpack.unpackb(control, raw=False)
            except Exception as exc:  # msgpack raises several unrelated types
                raise WireError(f"control frame is not msgpack: {exc}") from None
            if not isinstance(ctl, dict) or not isinstance(ctl.get("k"), str):
                raise WireError("control frame is not a map with a kind")
            handler = getattr(self, f"_on_{ctl['k']}", None)
            if handler is None:
                raise WireError(f"unknown message kind {ctl['k']!r}")
            self._check_peer(ctl)
            handler(sock, ident, ctl, payload)
        except PeerRefused as exc:
            self.counters[f"refused_{exc.code}"] += 1
            if exc.code != "finished":  # a roller asking after the run's end is told so; nothing wrong
                self._log_refusal(exc.code, str(exc))
            self._reply(sock, ident, {"k": "err", "rid": ctl.get("rid"), "code": exc.code, "msg": str(exc)})
        except Exception as exc:  # whatever an authenticated peer sent, the server keeps serving
            self.counters["refused_corrupt"] += 1
            log.warning("refused corrupt message: %s: %s", type(exc).__name__, exc)
            self._reply(
                sock,
                ident,
                {"k": "err", "rid": ctl.get("rid") if isinstance(ctl, dict) else None, "msg": str(exc)},
            )

    def _log_refusal(self, kind: str, message: str) -> None:
        """WARNING for the first refusal of a kind and then at most every REFUSAL_LOG_S, with the count."""
        count_last = self._refusals.setdefault(kind, [0, -REFUSAL_LOG_S])
        count_last[0] += 1
        now = time.monotonic()
        if now - count_last[1] >= REFUSAL_LOG_S:
            log.warning("%s (%d such refusal(s) since the last report)", message, count_last[0])
            count_last[:] = [0, now]

    def _reply(self, sock: zmq.Socket, ident: bytes, ctl: dict, frames: list | None = None) -> None:
        # every reply carries the run's identity and its admissible window (`ms`): a producer
        # learns the run's max_staleness from the queue, not from its own config
        ctl["e"], ctl["v"], ctl["r"], ctl["ms"] = self.epoch, self.version, self.run_id, self.max_staleness
        if self.servers is not None:
            ctl["sl"] = self.servers
        if self.finished:
            ctl["fin"] = 1
        self._replies.append((sock, ident, ctl, frames or []))

    def _ledger(self, kind: str, gids: list[str]) -> None:
        if self.ledger is not None and gids:
            self.ledger.write({kind: gids, "v": self.version})

    def _commit_and_flush(self) -> None:
        if self.wal is not None:
            with self._lock:
                self.wal.commit()
        self._flush()

    def _flush(self) -> None:
        with self._lock:
            if self.ledger is not None:
                self.ledger.flush_held()  # before the acks of what it names go out
            for (sock, ident), rids in self._put_acks.items():
                self._reply(sock, ident, {"k": "ok", "rids": rids})
            self._put_acks.clear()
            replies, self._replies = self._replies, []
        for sock, ident, ctl, frames in replies:
            body = msgpack.packb(ctl)
            mac = self._auth[self._names[sock]].sign(body, frames)
            try:
                sock.send_multipart([ident, mac, body, *frames], copy=False)
            except zmq.ZMQError as exc:  # the peer went away
                log.debug("reply to a gone peer dropped: %s", exc)

    # ---------------------------------------------------------------- timers, metrics

    def _tick(self) -> None:
        # every timer below compares against this one `now`; after a stall (a stop or starvation
        # of the process anywhere in the last turn) the renewals that arrived meanwhile may still be
        # unread, so nothing expires until a turn has read every socket empty
        now = time.monotonic()
        if now - self._last_tick > STALL_S:
            log.warning("queue server did not run for %.1fs (process stopped or starved): nothing expires "
                        "until the messages that waited in its sockets are read", now - self._last_tick)  # fmt: skip
            self._expiry_held = True
        self._last_tick = now
        if self._servers_file is not None and now >= self._next_servers_check:
            self._next_servers_check = now + 0.5
            if (found := self._servers_file.poll()) is not None:
                self.servers = as_wire(found)
                log.info("server list epoch %d: %s (carried to the producers)", found.epoch, found.urls)
        expired = []
        if now >= self._next_lease_check and not self._expiry_held:
            self._next_lease_check = now + 0.5
            expired = [e for e in self._inflight.values() if e.lease_until < now]
        if expired:
            log.warning(
                "%d groups not acked within lease_s=%s: handing them out again",
                len(expired),
                self.config.lease_s,
            )
            self._requeue(expired)
        if not self._expiry_held:
            self._expire_leases(now)
        for ident, get in list(self._gets.items()):
            if get.deadline is not None and get.deadline < now:
                del self._gets[ident]
                self._reply(get.sock, ident, {"k": "empty", "rid": get.rid, "dropped": get.dropped})
        if expired:
            self._serve_gets()

    def _metrics(self) -> dict[str, Any]:
        ages = sorted(self._ages)
        return {
            **self.counters,
            "depth": len(self._queued),
            "inflight": len(self._inflight),
            "bytes": self._bytes,
            "parked_puts": len(self._parked),
            "version": self.version,
            "run_id": self.run_id,
            **self._admission_metrics(),
            "age_s_mean": sum(ages) / len(ages) if ages else 0.0,
            "age_s_p50": ages[len(ages) // 2] if ages else 0.0,
            "age_s_max": ages[-1] if ages else 0.0,
        }

    def metrics(self) -> dict[str, Any]:
        """A snapshot of the queue's metrics (thread-safe)."""
        with self._lock:
            return self._metrics()
