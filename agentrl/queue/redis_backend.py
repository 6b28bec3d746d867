"""The TransferQueue over Redis Streams, for teams that already run Redis.

Same `Producer` / `Consumer` interfaces as the ZeroMQ backend; Redis is the server.
A group is one stream entry `XADD <stream> * gid <id> minv <v> lens <msgpack> data <bytes>`
(the group frames of `encode_group`, concatenated). Learner ranks read through one
consumer group (`XREADGROUP`), so each entry goes to exactly one rank (disjoint shares);
`ack` is `XACK` + `XDEL`. A Lua script claims a batch all-or-nothing (`XREADGROUP` only once
`need` undelivered entries exist), so two ranks never each sit on half of the last batch. A rank restarting under the same name first reads its own
pending entries (`XREADGROUP ... 0`), which is the redelivery of what it had not acked.

Dedupe: a Lua script adds the entry only if `SADD <stream>:ids <gid>` is new, atomically,
so a producer retrying a put never creates a second entry. Flow control: a producer
waits while `XLEN` (queued + handed out, not yet acked) is at `capacity_groups`; several
producers can overshoot by one group each. Admission: `<stream>:state` holds the learner
version, `groups_per_step`, `max_staleness` and the started count, and a Lua script
grants `acquire_start` atomically, with the next numbers of a shared task cursor (`tasks`).

Leases, as in the zmq backend: each producer holds its admitted-but-unput credits under a lease
(`<stream>:held` lease -> credits; `<stream>:leases`, a sorted set of lease -> deadline on
Redis's clock). Every acquire / put / release and the producer's heartbeat (every
`heartbeat_s`) renews it for `roller_lease_s`; the scripts (and the learner's polls) reap lapsed
leases: their credits leave `started` (`admission_reclaimed`) and the lease id joins
`<stream>:lapsed`, so a late producer's put under it raises `LeaseLapsed` and it starts a fresh
lease. A closing producer gives back what it holds. The learner's `finish` sets `finished` in
`<stream>:state`: a producer's next put or acquire raises `RunOver` (the PUT and ACQUIRE scripts
read it, so no group is taken after it), and the learner waits for
the leases to leave before its last count; a learner's start clears it. The launcher's live list (servers, env
services: `inference.server_list`) is `<stream>:servers`, set by the learner and read by each
producer's heartbeat. Durability is Redis's own (AOF/RDB); the MAC of the
zmq backend is replaced by Redis AUTH/TLS in the URL. The ids set grows with the run.

The per-group account (`account.py`): a consumer given a `ledger` path keeps `ledger.py`'s
ledger, as a hosted zmq server does: what it dropped as stale or skipped, and at its close the
ids still in the stream. `<stream>:state` counts `trained` beside the drops, so the queue's
group invariant holds on Redis's metrics too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections import deque
from typing import Any

import msgpack

from agentrl.inference.server_list import Follower
from agentrl.log import get_logger
from agentrl.queue.base import (
    Admission,
    Backend,
    Batch,
    Consumer,
    LeaseLapsed,
    Producer,
    RunOver,
    check_drop_reason,
)
from agentrl.queue.ledger import Ledger
from agentrl.queue.redis_scripts import (
    ACQUIRE,
    BYE,
    GIVE_BACK,
    PING,
    PUT,
    REAP_ONLY,
    RELEASE,
    TAKE,
)
from agentrl.types import Group
from agentrl.wire import decode_group, encode_group

log = get_logger("queue.redis")

POLL_S = 0.02
RUN_OVER = "the run is over (the learner finished)"


async def _poll_pause(seconds: float = POLL_S) -> None:
    """Sleep between polls, and honour a cancellation that redis-py may have swallowed while it
    retried a command (seen with `asyncio.wait_for` around a waiting `acquire_start`, and with
    a cancelled heartbeat that went on renewing its lease)."""
    task = asyncio.current_task()
    if task is not None and getattr(task, "cancelling", lambda: 0)():
        raise asyncio.CancelledError
    await asyncio.sleep(seconds)


class RedisProducer(Follower, Producer):
    """Roller side over `redis.asyncio`; holds its admission credits under a lease (see the module
    docstring) renewed by every call and by a heartbeat task started with the first call."""

    def __init__(
        self, url: str, stream: str, capacity_groups: int, heartbeat_s: float = 2.0, lease_s: float = 10.0,
        name: str = "producer",
    ) -> None:  # fmt: skip
        import redis.asyncio

        # concurrent puts queue for a bounded set of connections instead of failing
        pool = redis.asyncio.BlockingConnectionPool.from_url(url, max_connections=32, timeout=None)
        self._redis = redis.asyncio.Redis(connection_pool=pool)
        self.url, self.stream, self.capacity = url, stream, capacity_groups
        self.heartbeat_s, self.ttl_ms = heartbeat_s, int(lease_s * 1000)
        self.name = name
        self.lease = self._new_lease()
        self.lapses = 0
        self._lease_keys = [f"{stream}:state", f"{stream}:leases", f"{stream}:held", f"{stream}:lapsed"]
        self._put = self._redis.register_script(PUT)
        self._acquire = self._redis.register_script(ACQUIRE)
        self._release = self._redis.register_script(RELEASE)
        self._ping = self._redis.register_script(PING)
        self._heartbeat: asyncio.Task | None = None

    def _new_lease(self) -> str:
        return f"{self.name}-{os.getpid()}-{os.urandom(3).hex()}"

    def _start(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(
                self._heartbeat_loop(), name="redis-heartbeat"
            )

    async def _heartbeat_loop(self) -> None:
        """Renews the lease; a lapsed one (a stall longer than the lease) is replaced by a fresh one.
        Reads the launcher's live list too (`<stream>:servers`, set by the learner)."""
        while True:
            if await self._ping(keys=self._lease_keys, args=[self.lease, self.ttl_ms]) < 0:
                self._lapsed()
            sl = await self._redis.get(f"{self.stream}:servers")
            if sl is not None:
                self.told(json.loads(sl))
            await _poll_pause(self.heartbeat_s)

    def _lapsed(self) -> str:
        old, self.lease = self.lease, self._new_lease()
        self.lapses += 1
        log.warning(
            "lease %s lapsed (its credits were reclaimed); continuing under lease %s", old, self.lease
        )
        return old

    async def put(self, group: Group) -> None:
        """Waits while the stream is full; the learner's `finish` (`finished` in `<stream>:state`,
        read by that wait and, atomically with the put, by the PUT script) raises RunOver."""
        self._start()
        frames = encode_group(group)
        while True:
            async with self._redis.pipeline(transaction=False) as pipe:
                length, finished = (
                    await pipe.xlen(self.stream).hget(f"{self.stream}:state", "finished").execute()
                )
            if finished == b"1":
                raise RunOver(RUN_OVER)
            if length < self.capacity:
                break
            await _poll_pause()
        lens = msgpack.packb([len(f) for f in frames])
        keys = [self.stream, f"{self.stream}:ids", *self._lease_keys]
        args = [group.group_id, group.min_version, lens, b"".join(frames), self.lease, self.ttl_ms]
        taken = await self._put(keys=keys, args=args)
        if taken == -2:
            raise RunOver(RUN_OVER)
        if taken < 0:
            old = self._lapsed()
            raise LeaseLapsed(f"lease {old} lapsed; group {group.group_id} was not taken")

    async def acquire_start(self, n: int = 1) -> Admission:
        self._start()
        while True:
            granted, version, first_task, k = await self._acquire(
                keys=self._lease_keys, args=[n, self.lease, self.ttl_ms]
            )
            if granted == -2:
                raise RunOver(RUN_OVER)
            if int(k) >= 0 and int(k) != self.max_staleness:
                self.max_staleness = int(k)
                if self.on_max_staleness is not None:
                    self.on_max_staleness(self.max_staleness)
            if self.on_version is not None:
                self.on_version(int(version))
            if granted == 1:
                return Admission(int(version), int(first_task))
            if granted < 0:
                self._lapsed()
            await _poll_pause()

    async def release_start(self, n: int = 1) -> None:
        self._start()
        if await self._release(keys=self._lease_keys, args=[n, self.lease, self.ttl_ms]) < 0:
            self._lapsed()  # nothing left to give back: the queue reclaimed it

    async def current_version(self) -> int:
        return int(await self._redis.hget(f"{self.stream}:state", "version") or 0)

    def close(self) -> None:
        """Give back the credits still held (the lease ends; best effort, as the zmq `bye`) and
        drop the client."""
        import redis

        if self._heartbeat is not None:
            self._heartbeat.cancel()
        with contextlib.suppress(redis.RedisError), redis.Redis.from_url(self.url) as client:
            client.register_script(BYE)(keys=self._lease_keys, args=[self.lease])
        with contextlib.suppress(RuntimeError):  # without a running loop the client is just dropped
            asyncio.get_running_loop().create_task(self._redis.aclose())


class RedisAdmission:
    """The 'server' of the Redis backend: records groups_per_step and max_staleness for admission."""

    def __init__(self, config: Any, groups_per_step: int, max_staleness: int, **_: Any) -> None:
        import redis

        self.config = config
        self._redis = redis.Redis.from_url(config.url)
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness

    def start(self) -> RedisAdmission:
        state = f"{self.config.stream}:state"
        self._redis.hset(
            state, mapping={"groups_per_step": self.groups_per_step, "max_staleness": self.max_staleness}
        )
        self._redis.hsetnx(state, "version", 0)
        self._redis.hdel(state, "finished")  # a new (or resumed) learner: the run goes on
        return self

    def stop(self) -> None:
        self._redis.close()


class RedisConsumer(Consumer):
    """Learner rank over one Redis consumer group; blocking calls."""

    def __init__(self, config: Any, name: str, ledger: str | None = None) -> None:
        import redis

        self.config, self.name = config, name
        self.stream, self.state = config.stream, f"{config.stream}:state"
        self._redis = redis.Redis.from_url(config.url)
        try:
            self._redis.xgroup_create(self.stream, config.consumer_group, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._entry_of: dict[str, bytes] = {}  # gid -> stream entry id, for ack
        self._buffer: list[tuple[Group, float]] = []
        self._ages: deque[float] = deque(maxlen=4096)  # seconds in the stream, of groups handed out
        self._take_script = self._redis.register_script(TAKE)
        self._reap = self._redis.register_script(REAP_ONLY)
        self._lease_keys = [
            self.state,
            f"{self.stream}:leases",
            f"{self.stream}:held",
            f"{self.stream}:lapsed",
        ]
        self._next_claim = 0.0
        self.ledger = None
        if ledger is not None:  # a life of a durable queue: Redis keeps the stream across ours
            version = int(self._redis.hget(self.state, "version") or 0)
            self.ledger = Ledger(ledger, f"redis-{os.urandom(4).hex()}", durable=True, version=version)
        self._read_pending()  # what this name held and had not acked

    def _read_pending(self) -> None:
        """What this name held and had not acked (a restarted rank gets it back)."""
        self._ingest(self._redis.xreadgroup(self.config.consumer_group, self.name, {self.stream: "0"}))

    def _claim_expired(self) -> None:
        """Take over entries another rank has held past `lease_s` without acking (XAUTOCLAIM)."""
        if time.monotonic() < self._next_claim:
            return
        self._next_claim = time.monotonic() + 1.0
        self._reap(keys=self._lease_keys)  # lapsed rollers' credits come back while the learner waits
        reply = self._redis.xautoclaim(
            self.stream, self.config.consumer_group, self.name, int(self.config.lease_s * 1000), count=256
        )
        self._ingest([[self.stream, reply[1]]])

    def _take(self, need: int) -> bool:
        count = max(need, self.config.capacity_groups if self.config.selection == "oldest_first" else need)
        reply = self._take_script(
            keys=[self.stream], args=[self.config.consumer_group, self.name, need, count]
        )
        self._ingest(reply)
        return bool(reply)

    def _ingest(self, reply: Any) -> None:
        now = time.time()
        for _, entries in reply or []:
            for entry_id, fields in entries:
                if not fields:
                    continue  # deleted while pending
                if isinstance(fields, list):  # a script's raw reply: [field, value, ...]
                    fields = dict(zip(fields[::2], fields[1::2], strict=True))
                gid = fields[b"gid"].decode()
                if gid in self._entry_of:
                    continue
                data, pos, frames = memoryview(fields[b"data"]), 0, []
                for length in msgpack.unpackb(fields[b"lens"]):
                    frames.append(data[pos : pos + length])
                    pos += length
                self._entry_of[gid] = entry_id
                age = now - int(entry_id.split(b"-")[0]) / 1000
                self._buffer.append((decode_group(frames, max_bytes=1 << 62), age))

    def get_batch(
        self, num_groups: int, learner_version: int, max_staleness: int, timeout_s: float | None = None
    ) -> Batch:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        dropped = 0
        while True:
            stale = [
                g.group_id
                for g, _ in self._buffer
                if not g.is_admissible(learner_version, max_staleness, self.per_token_staleness)
            ]
            if stale:
                self._buffer = [b for b in self._buffer if b[0].group_id not in stale]
                self._remove(stale, dropped="stale")
                dropped += len(stale)
            if len(self._buffer) >= num_groups:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._give_back()
                raise TimeoutError(
                    f"no {num_groups} admissible groups within {timeout_s}s ({dropped} dropped)"
                )
            self._claim_expired()
            if len(self._buffer) < num_groups and not self._take(num_groups - len(self._buffer)):
                time.sleep(POLL_S)
        if self.config.selection == "oldest_first":
            self._buffer.sort(key=lambda b: b[0].min_version)
        taken, self._buffer = self._buffer[:num_groups], self._buffer[num_groups:]
        self._ages.extend(a for _, a in taken)
        self._redis.hincrby(self.state, "groups_out", len(taken))
        return self._hand_out(
            [g for g, _ in taken], [a for _, a in taken], learner_version, max_staleness, dropped
        )

    def _give_back(self) -> None:
        """Return buffered (claimed, not handed out) entries to the stream, so other ranks can take
        them: a partial batch must not sit in one rank's pending list, as the zmq server holds it."""
        if not self._buffer:
            return
        entries = [self._entry_of.pop(g.group_id) for g, _ in self._buffer]
        self._buffer = []
        self._redis.register_script(GIVE_BACK)(
            keys=[self.stream], args=[self.config.consumer_group, *entries]
        )

    def _remove(self, group_ids: list[str], dropped: str | None = None) -> None:
        present = [g for g in group_ids if g in self._entry_of]
        if not present:
            return
        entries = [self._entry_of.pop(g) for g in present]
        pipe = self._redis.pipeline()
        pipe.xack(self.stream, self.config.consumer_group, *entries)
        pipe.xdel(self.stream, *entries)
        fate = "trained" if dropped is None else f"dropped_{dropped}"
        pipe.hincrby(self.state, fate, len(entries))
        if dropped is not None:
            pipe.hincrby(self.state, "started", -len(entries))  # admission replaces them
        pipe.hget(self.state, "version")  # for the ledger row, in the same round trip
        version = pipe.execute()[-1]
        if self.ledger is not None:
            self.ledger.write({fate: present, "v": int(version or 0)})

    def ack(self, group_ids: list[str], dropped: str | None = None) -> None:
        check_drop_reason(dropped)
        self._remove(list(group_ids), dropped)

    def publish_version(self, version: int) -> None:
        self._redis.hset(self.state, "version", int(version))

    def finish(self) -> None:
        """The run is over: producers' next put or acquire raises `RunOver` (rollers exit 0)."""
        self._redis.hset(self.state, "finished", 1)

    def metrics(self) -> dict[str, Any]:
        pipe = self._redis.pipeline(transaction=True)  # one snapshot (MULTI/EXEC): invariants hold in it
        pipe.hgetall(self.state)
        pipe.xpending(self.stream, self.config.consumer_group)
        pipe.xlen(self.stream)
        pipe.hvals(f"{self.stream}:held")
        pipe.zcard(f"{self.stream}:leases")
        state, pending, length, held, leases = pipe.execute()
        state = {k.decode(): int(v) for k, v in state.items()}
        pending = pending["pending"]
        depth = length - pending
        ages = sorted(self._ages)
        return {
            **state,
            "leased": sum(int(v) for v in held),
            "leases": leases,
            "depth": depth,
            "inflight": pending,
            "age_s_mean": sum(ages) / len(ages) if ages else 0.0,
            "age_s_p50": ages[len(ages) // 2] if ages else 0.0,
            "age_s_max": ages[-1] if ages else 0.0,
        }

    def follow_servers(self, path: Any) -> None:
        """Hand the launcher's live list in `path` on to the producers: `<stream>:servers`, which
        their heartbeat reads (`server_list.Publisher`, a thread; redis-py's client is thread-safe)."""
        from agentrl.inference.server_list import Publisher

        key = f"{self.stream}:servers"
        self._publisher = Publisher(path, lambda sl: self._redis.set(key, json.dumps(sl))).start()

    def close(self) -> None:
        if getattr(self, "_publisher", None) is not None:
            self._publisher.stop()
        if self.ledger is not None and not self.ledger.closed:
            self._give_back()
            remaining = [fields[b"gid"].decode() for _, fields in self._redis.xrange(self.stream) if fields]
            self.ledger.close(remaining)
        self._redis.close()


class RedisBackend(Backend):
    """`create(config)` for `queue.type: redis`."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def server(self, groups_per_step: int, max_staleness: int, **kwargs: Any) -> RedisAdmission:
        return RedisAdmission(self.config, groups_per_step, max_staleness)

    def producer(self, name: str = "producer", **kwargs: Any) -> RedisProducer:
        c = self.config
        return RedisProducer(c.url, c.stream, c.capacity_groups, c.heartbeat_s, c.roller_lease_s, name)

    def consumer(self, name: str = "rank0", ledger: str | None = None, **kwargs: Any) -> RedisConsumer:
        return RedisConsumer(self.config, name, ledger)
