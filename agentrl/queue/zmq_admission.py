"""Admission credits under rollers' leases: the producer-side half of the queue server's state machine.

`QueueServer` (zmq_server.py) owns the sockets and the loop, `Intake` (zmq_intake.py) takes
puts; `Delivery` (zmq_delivery.py) hands groups to the learner; this mixin decides who may start a group.

Admission is *derived from what is in flight*, never kept as a running count that can drift:

    used  = v × groups_per_step          (the learner trained that many to reach version v)
          + trained at v but not yet covered by a version step (a learner that acks first)
          + queued + handed out + held-back puts + NIXL reads under way
          + credits held under live leases  (admitted, not yet put)
    grant `acq n` while used + n ≤ (v + max_staleness + 1) × groups_per_step

So a stale drop or a skipped step frees its credit by leaving the queue, and a resumed
learner that publishes its checkpoint's version rebuilds admission from what actually is
in flight — a fresh hosted queue (nothing queued) or a recovered WAL alike.

Leases: every producer message carries its lease id `l` (and `h`, the credits the producer
believes it holds; `w`, who it is). Any message renews the lease for `roller_lease_s`; the
producer's heartbeat (`ping` every `heartbeat_s`) keeps an idle one alive. A grant adds
credits to the lease, each put (stored, deduplicated or refused) spends one, `rel` /
`cancel` / `bye` give them back. Each request counts once per lease and request id: a copy of
one this server has seen (a request sent while the server was down waits in the producer's
socket and arrives on reconnect, and the producer re-sends it on seeing the new epoch) spends,
grants or gives back nothing again; a copy of a granted `acq` gets the same answer again. A lease that lapses (kill -9, partition) is reclaimed: its
credits return (`admission_reclaimed`), its waiting `acq`s are dropped, and its id is
remembered, so the late producer's next message is answered `lapsed` and it starts a fresh
lease (`LeaseLapsed`). A lease this server has never seen is created from `h`: a restarted
queue learns what each live roller holds (`admission_restored`).

The credit account, true after every message:
`admitted == admission_spent + admission_released + admission_reclaimed + leased`.

Each grant also hands out the next `n` numbers of the run's task cursor (`t`), so rollers
share one task stream disjointly and a restarted roller continues where the run is.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from agentrl.log import get_logger

log = get_logger("queue.server")

MAX_LAPSED = 4096
MAX_SEEN = 4096  # request ids remembered per lease (a producer's window holds far fewer in flight)


class PeerRefused(Exception):
    """A request refused for who sent it (run, lease, finished run, config); `code` tells the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class _Lease:
    who: str
    credits: int
    until: float
    told_finished: bool = False
    # (kind, request id) -> the answer to repeat to a copy (None: none); insertion order, bounded
    seen: OrderedDict[tuple[str, int], dict | None] = field(default_factory=OrderedDict)

    def first_time(self, key: tuple[str, int]) -> bool:
        """Remember request `key`; False if this server has seen it before."""
        if key in self.seen:
            return False
        self.seen[key] = None
        if len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)
        return True


class Admission:
    """Mixin of `QueueServer`: leases, `acq` / `rel` / `cancel` / `bye` / `fin` and the run checks."""

    def _init_admission(self, run_id: str) -> None:
        self.run_id = run_id
        self.finished = False
        self.tasks_issued = 0
        self._leases: dict[str, _Lease] = {}
        self._lapsed: OrderedDict[str, None] = OrderedDict()
        self._leased = 0
        self._trained_ahead = 0
        self._acqs: list[tuple[zmq.Socket, bytes, int, int, str | None]] = []
        self._next_expiry_check = 0.0
        for name in (
            "admitted",
            "admission_spent",
            "admission_released",
            "admission_reclaimed",
            "admission_restored",
            "put_unleased",
            "leases_lapsed",
            "refused_lapsed",
            "refused_run",
            "refused_finished",
            "refused_config",
        ):
            self.counters[name] = 0

    def _used(self) -> int:
        held = len(self._queued) + len(self._inflight) + len(self._parked) + len(self._nixl_busy)
        return self.version * self.groups_per_step + self._trained_ahead + held + self._leased

    def _set_version(self, version: int) -> None:
        """The learner's version moved: a step forward covers the groups trained ahead of it; a
        step back (a resume from an older checkpoint) starts the account at that version."""
        if version > self.version:
            self._trained_ahead = max(
                0, self._trained_ahead - (version - self.version) * self.groups_per_step
            )
        elif version < self.version:
            self._trained_ahead = 0
        self.version = version

    def _trained(self, handed_version: int) -> None:
        """A group handed out at `handed_version` was trained on: ahead of the version until it steps."""
        if handed_version >= self.version:
            self._trained_ahead += 1

    def _limit(self) -> int:
        return (self.version + self.max_staleness + 1) * self.groups_per_step

    # ---------------------------------------------------------------- every message

    def _check_peer(self, ctl: dict) -> None:
        """Refuse another run's client or a lapsed lease; renew (or learn) the sender's lease."""
        run = ctl.get("r")
        if run is not None and run != self.run_id:
            raise PeerRefused(
                "run",
                f"this queue serves run {self.run_id!r}, the client belongs to run {run!r}: it is left over "
                "from another run (or queue.run_id differs); stop it or point it at its own queue",
            )
        lease_id = ctl.get("l")
        if lease_id is None:
            return
        if lease_id in self._lapsed:
            raise PeerRefused(
                "lapsed",
                f"lease {lease_id} lapsed (nothing heard for queue.roller_lease_s={self.config.roller_lease_s}s)"
                " and its admission credits were reclaimed; start a fresh lease",
            )
        lease = self._leases.get(lease_id)
        if lease is None:
            lease = self._leases[lease_id] = _Lease(str(ctl.get("w", "?")), 0, 0.0)
            restored = max(0, int(ctl.get("h", 0)))
            if restored:  # a restarted server: the roller still holds what the old one granted
                lease.credits = restored
                self._leased += restored
                self.counters["admitted"] += restored
                self.counters["admission_restored"] += restored
            log.info("roller %s took lease %s (%d credits held)", lease.who, lease_id, restored)
        lease.until = time.monotonic() + self.config.roller_lease_s
        if self.finished:
            lease.told_finished = True

    def _spend(self, lease_id: str | None, rid: int) -> None:
        """Put `rid` arrived under `lease_id`: its credit is used up, whatever became of the group
        (once: a copy of a put this server has seen spends nothing)."""
        lease = self._leases.get(lease_id) if lease_id is not None else None
        if lease is not None and not lease.first_time(("put", rid)):
            return
        if lease is not None and lease.credits > 0:
            lease.credits -= 1
            self._leased -= 1
            self.counters["admission_spent"] += 1
        else:
            self.counters["put_unleased"] += 1

    def _give_back(self, lease_id: str | None, n: int, counter: str = "admission_released") -> None:
        lease = self._leases.get(lease_id) if lease_id is not None else None
        if lease is None:
            return
        n = min(n, lease.credits)
        lease.credits -= n
        self._leased -= n
        self.counters[counter] += n
        self._grant_acqs()

    def _expire_leases(self, now: float) -> None:
        if now < self._next_expiry_check:
            return
        self._next_expiry_check = now + min(0.5, self.config.heartbeat_s)
        for lease_id, lease in [(i, lease) for i, lease in self._leases.items() if lease.until < now]:
            del self._leases[lease_id]
            self._lapsed[lease_id] = None
            while len(self._lapsed) > MAX_LAPSED:
                self._lapsed.popitem(last=False)
            self._acqs = [a for a in self._acqs if a[4] != lease_id]
            self.counters["leases_lapsed"] += 1
            self._leased -= lease.credits
            self.counters["admission_reclaimed"] += lease.credits
            if lease.credits or not self.finished:
                log.warning(
                    "roller %s (lease %s) silent for queue.roller_lease_s=%ss: %d admission credits reclaimed",
                    lease.who,
                    lease_id,
                    self.config.roller_lease_s,
                    lease.credits,
                )
        self._grant_acqs()

    def live_leases(self) -> int:
        return len(self._leases)

    def untold_leases(self) -> int:
        """Live leases that have not yet been answered since the run finished."""
        with self._lock:
            return sum(1 for lease in self._leases.values() if not lease.told_finished)

    def _admission_metrics(self) -> dict[str, Any]:
        return {
            "leased": self._leased,
            "leases": len(self._leases),
            "started": self._used(),
            "admission_limit": self._limit(),
            "tasks_issued": self.tasks_issued,
            "finished": self.finished,
        }

    # ---------------------------------------------------------------- handlers

    def _on_acq(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        n = int(ctl["n"])
        if not 1 <= n <= self.groups_per_step * (self.max_staleness + 1):
            raise ValueError(f"acq: n must be 1..{self.groups_per_step * (self.max_staleness + 1)}")
        if self.finished:
            raise PeerRefused("finished", f"the run is over (learner finished at version {self.version})")
        lease = self._leases.get(ctl.get("l")) if ctl.get("l") is not None else None
        if lease is not None and not lease.first_time(("acq", ctl["rid"])):
            granted = lease.seen[("acq", ctl["rid"])]
            if granted is not None:  # a copy of a granted acq: the same answer, no new credit
                self._reply(sock, ident, granted)
            return  # (a copy of one still waiting: the grant answers both)
        self._acqs.append((sock, ident, ctl["rid"], n, ctl.get("l")))
        self._grant_acqs()

    def _on_cancel(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        for i, (_, who, rid, _, _) in enumerate(self._acqs):
            if who == ident and rid == ctl["rid"]:
                del self._acqs[i]
                return
        lease = self._leases.get(ctl.get("l")) if ctl.get("l") is not None else None
        if lease is None or lease.seen.get(("acq", ctl["rid"])) is None:
            return  # never granted here (lost, or granted by a server before a restart: not in `h`)
        lease.seen[("acq", ctl["rid"])] = None  # given back once
        self._give_back(ctl.get("l"), int(ctl["n"]))

    def _on_rel(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        lease = self._leases.get(ctl.get("l")) if ctl.get("l") is not None else None
        if lease is None or lease.first_time(("rel", ctl["rid"])):
            self._give_back(ctl.get("l"), int(ctl["n"]))
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"]})

    def _on_bye(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        """A producer closing: its credits come back and its lease ends (no reply)."""
        lease_id = ctl.get("l")
        self._give_back(lease_id, 1 << 30)
        self._leases.pop(lease_id, None)
        self._acqs = [a for a in self._acqs if a[4] != lease_id]

    def _on_fin(self, sock: zmq.Socket, ident: bytes, ctl: dict, payload: list[Any]) -> None:
        """The learner finished: every later reply tells producers the run is over."""
        self.finished = True
        for sock_, ident_, rid, _, _ in self._acqs:
            self._reply(sock_, ident_, {"k": "err", "rid": rid, "code": "finished", "msg": "the run is over"})
        self._acqs.clear()
        log.info(
            "run %s finished at version %d; telling %d rollers", self.run_id, self.version, len(self._leases)
        )
        self._reply(sock, ident, {"k": "ok", "rid": ctl["rid"]})

    def _grant_acqs(self) -> None:
        limit = self._limit()
        while self._acqs and self._used() + self._acqs[0][3] <= limit:
            sock, ident, rid, n, lease_id = self._acqs.pop(0)
            lease = self._leases.get(lease_id) if lease_id is not None else None
            answer = {"k": "ok", "rid": rid, "t": self.tasks_issued}
            if lease is not None:
                lease.credits += n
                self._leased += n
                lease.seen[("acq", rid)] = answer
            self.counters["admitted"] += n
            if lease is None:  # an old client without a lease: nothing to hold its credits
                self.counters["admission_spent"] += n
            self._reply(sock, ident, answer)
            self.tasks_issued += n
            if self.wal is not None:
                self.wal.append_meta(self.version, self.tasks_issued)
