"""The default checkpoint engine: bucketed broadcast over a dedicated process group.

Group: learner rank 0 (rank 0, hosts the rendezvous) plus every worker of every inference
server (engine i at `rank_offset = 1 + i × workers_per_server`, as SGLang numbers them),
separate from the training group; NCCL on GPUs, gloo on CPU. The engine is in four modules:
this one (the push), `membership.py` (`GroupMembership`: the group, its members, drops and
rejoins), `adapter_http.py` (`AdapterOverHTTP`: adapter pushes over HTTP) and `buckets.py`
(bucketing, the gather thread, phase timing). It needs clients that join a weight group
(`DistributedWeightUpdateClient`); `init` refuses others, naming the disk engine.

A push, on rank 0 (other learner ranks only join the FSDP gathers):
1. pause generation on every server (in-flight requests come back aborted; rollers resume)
   and open a weight-update session on each (`/begin_weight_update`: SGLang 0.5.23 refuses
   `/update_weights_from_distributed` outside one); a server with `session_control` (the
   embedded server, from its first begin on) pauses in its begin's round trip;
2. a gather thread pulls full tensors from `weights()` (layer by layer from FSDP2), groups them into
   buckets of about `bucket_mb` and, where every member takes SGLang's `flattened_bucket`, packs
   each bucket into one flat uint8 tensor (`buckets.Packer`: on CPU into buffers kept from push
   to push; a view, no copy, where the tensors already lie back to back, as a one-rank FSDP2
   learner lays them out: `learner.fsdp.home_for_push`), at most one bucket ahead — so bucket
   i+1 is gathered and packed while bucket i is broadcast, and extra memory is about three
   buckets; buckets of the learner's own weights sent as they lie (a `Resident` source) hold no
   memory and the gather runs ahead through all of them. The gather thread starts while the
   servers are paused and their sessions opened, and waits for that before it announces;
3. per bucket: tell each server its names/dtypes/shapes (`/update_weights_from_distributed`;
   the version travels with the last bucket only), broadcast the packed bucket (or each tensor
   in that order), await the servers' replies. Where every member receives buckets in the order
   of their index (`ordered_buckets`: the embedded server), the gather thread announces each
   bucket as soon as it is gathered (the server queues its receive behind the one in progress)
   and bucket i's replies are awaited after bucket i+1's broadcast; a resident push to members
   that take bucket batches (`bucket_batches`) announces all its buckets in one request per
   member, answered once; elsewhere (SGLang, vLLM:
   out-of-order broadcasts deadlock) a bucket is announced once the one before has its replies;
4. commit every session (`/end_weight_update`), read each server's version back, and resume
   generation (a server with `session_control` continues in its commit's round trip and its
   reply carries the version it serves after the commit: that is its read-back).
Each push is a transaction per server: every server of the live list ends committed at the
version (read back), or dropped from the push with its reason (`PushStats.outcomes`, one log
line per server); no server failure raises into the learner loop. A failed bucket aborts the
attempt on every member (`abort_weight_update`: the embedded server and vLLM's worker discard
what they staged, SGLang keeps what it loaded), the group is rebuilt and the push redone (every
learner rank repeats the gathers in step). A server that stopped answering is dropped; a live
one whose bucket failed is kept for one redo and, failing again, dropped (`transactional:
any`), or the version is given up on every server (`all`: all stay on the previous one).
Afterwards a server whose weights are whole (one that stages, or one no bucket reached)
continues generating; one that may hold a mix (SGLang, part of a push) stays paused. A dropped
server rejoins at a later push once it answers its liveness check (`alive`) again.

A LoRA adapter push (`lora_mode: adapter`) is gathered once on every rank; to the embedded server
it streams as above in an adapter session; to vLLM, whose clients take adapters over HTTP
(`load_lora_tensors`), it goes by HTTP instead, each server paused, loaded, read back and resumed
(`adapter_http.py`), and an engine built with the adapter for vLLM builds no group.

Servers are probed in the background (`watch.ServerWatch`: health and weight version, each
probe bounded), so no push waits on a dead or silent server. Before each push, members
probed down leave the group, and servers back up — dropped ones that answer again, members
restarted on the same address (their version is not the last pushed) — join it. `behind(v)`
names the servers up but not at `v`; the learner loop asks it while it waits for data and
pushes the current weights at once (`push(model, v)` again), so a restarted server does not
wait for the next trained step. A server whose rejoin fails is retried with backoff
(`membership.py`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentrl.inference.weight_group import dtype_name
from agentrl.log import get_logger
from agentrl.weight_sync.adapter_http import AdapterOverHTTP
from agentrl.weight_sync.base import (
    AdapterSpec,
    Outcome,
    PushStats,
    Resident,
    WeightSource,
    errors_of,
    loads_adapters,
    no_adapters,
    resolve,
)
from agentrl.weight_sync.buckets import (
    Bucket,
    Packer,
    Phase,
    agree,
    flat_layout,
    iter_buckets,
    prefetch,
    timed_iter,
)
from agentrl.weight_sync.watch import DOWN, ServerWatch

if TYPE_CHECKING:
    from pathlib import Path

    from agentrl.config import BroadcastSyncConfig, InferenceConfig

logger = get_logger(__name__)


@dataclass
class InFlight:
    """A bucket broadcast whose replies are not yet awaited."""

    futures: dict[str, Any]
    announced: float
    nbytes: int
    tensors: int
    broadcasts: int
    covered: bool = False
    """Its replies are a later bucket's (announced together): nothing to await for it."""


class BroadcastEngine(AdapterOverHTTP):
    """The push over the weight group (`GroupMembership` keeps the group and its members;
    `AdapterOverHTTP` the adapter path to servers that take adapters over HTTP)."""

    def __init__(
        self,
        config: BroadcastSyncConfig,
        urls: list[str],
        inference: InferenceConfig,
        rank: int,
        servers_file: str | Path | None = None,
        adapter: AdapterSpec | None = None,
    ) -> None:
        super().__init__(config, urls, inference, rank, servers_file, adapter)
        # one push's record (rank 0), beside the drops `GroupMembership` records: which servers got
        # a bucket, and why the whole push was given up (`transactional: all`), if it was
        self._touched: set[str] = set()
        self._gave_up = ""
        self._adapter: dict | None = None  # an adapter push's config (its sessions open with it)
        self._given_up = 0  # pushes given up in a row (`transactional: all`), for the catch-up backoff
        self._given_up_until = 0.0
        self.packer = Packer()  # the flat buffers buckets are packed into (rank 0)

    # ------------------------------------------------------------------ set-up

    def _init_servers(self) -> None:
        """Probe every server first and invite only those that answer: one that is down, or accepts
        TCP but never answers, would hold the rendezvous until every server's join timed out."""
        interval = min(2.0, self.inference.health_check_interval_s)
        self.watch = ServerWatch(
            self.clients, self._bridge, interval, min(self.inference.connect_timeout_s, 2.0)
        )
        self.watch.probe_now(list(self.urls))
        seen = self.watch.fresh(0.0)
        if self.adapter is not None and self._adapters_over_http():
            # a LoRA run whose adapters go over HTTP (vLLM) needs no group; a full push would build it
            logger.info("adapter pushes go over HTTP to %d server(s): no weight group", len(self.urls))
            self._over_http = True
            self.watch.start()
            return
        down = [u for u in self.urls if seen.get(u, DOWN) == DOWN]
        self._drop(down, dict.fromkeys(down, "not answering at start-up"))
        self._build_group([u for u in self.urls if u not in self.dropped])
        self.watch.start()

    def behind(self, version: int) -> list[str]:
        """Servers probed up since the last push that do not hold `version` (restarted, or dropped
        and back), outside their retry backoff. Never blocks."""
        if self.rank != 0 or self.watch is None:
            return []
        self._reread()  # a server new in the live list is one behind (and never blocks)
        now, leaving = time.monotonic(), self._leaving()
        if now < self._given_up_until:  # `transactional: all` gave a version up: no catch-up push yet
            return []
        return [
            url
            for url, v in self.watch.fresh(self._pushed_at).items()
            if v != DOWN
            and url not in leaving
            and (v != version or (url not in self.members and not self._over_http))
            and self._retry_at.get(url, 0.0) <= now
        ]

    # ------------------------------------------------------------------ push

    def _begin(self, urls: list[str]) -> dict[str, str]:
        """Open a weight-update session on `urls` (an adapter session for an adapter push); returns
        {url: why} for those that refused. One still holding a session from an earlier, interrupted
        push has it aborted and opened again."""
        if self._adapter is not None:
            unable = {u: no_adapters(self.clients[u], "group") for u in urls
                      if not loads_adapters(self.clients[u], "group")}  # fmt: skip
            urls = [u for u in urls if u not in unable]
            method, args = "begin_adapter_update", (self._adapter,)
        else:
            unable, method, args = {}, "begin_weight_update", ()

        def opened(among: list[str]) -> dict[str, BaseException | None]:
            """{url: why it refused, or None}; a server with `session_control` pauses in the same
            round trip (the others were paused before: `_pause_members`)."""
            calls = {u: {"pause": True} if self.clients[u].session_control else {} for u in among}
            return errors_of(self._each(method, calls, *args, timeout_s=self.config.timeout_s))

        errors = opened(urls)
        stale = [u for u, exc in errors.items() if exc is not None and "already open" in str(exc)]
        if stale:
            self._abort(stale)
            errors.update(opened(stale))
        refused = {u: f"/begin_weight_update refused: {exc}" for u, exc in errors.items() if exc is not None}
        return {**unable, **refused}

    def _abort(self, urls: list[str]) -> None:
        """Close the session on `urls` without committing (a staging server keeps its weights and
        version); a failure is logged, the server is then judged by its next push."""
        for url, exc in self._all("abort_weight_update", urls, timeout_s=self.config.timeout_s).items():
            if exc is not None:
                logger.error("server %s: aborting its weight update failed: %s", url, exc)

    def _open_sessions(self) -> None:
        """Open a session on every member; those that refuse are dropped and the group is rebuilt
        without them (before anything is broadcast)."""
        while self.members and (refused := self._begin(self.members)):
            self._drop(list(refused), refused)
            self._build_group([u for u in self.members if u not in refused])

    def _start_push(self, stats: PushStats | None = None) -> None:
        """Rank 0: regroup (members probed down leave, servers back up join), pause every member,
        open their sessions; a member that fails either is dropped before anything is broadcast."""
        self._why, self._dead, self._touched, self._gave_up = {}, set(), set(), ""
        with Phase(stats, "regroup"):
            self._regroup()
            if self.group is None and self.members:  # closed by an earlier push that stopped early
                self._build_group(list(self.members))
        with Phase(stats, "pause"):
            self._pause_members()
        with Phase(stats, "begin"):
            self._open_sessions()

    def push(self, weights: WeightSource, version: int) -> PushStats | None:
        """One transaction per server: begin, buckets, commit, version read back. A failed bucket
        aborts the attempt on every member and rebuilds the group; a server that stops answering
        is dropped, one that fails twice is dropped (`transactional: any`) or ends the push for
        all (`all`). Every server of the live list ends committed or dropped with its reason
        (`PushStats.outcomes`); only servers with whole weights are resumed. Server failures never
        raise here. An adapter push (`AdapterWeights`, `lora_mode: adapter`) opens adapter sessions
        and sends only the adapter's tensors (`PushStats.bytes` counts them)."""
        stats = PushStats(version) if self.rank == 0 else None
        start = time.perf_counter()
        weights, adapter = resolve(weights, self.config.lora_mode)
        self._adapter = adapter.config(version) if adapter is not None else None
        if adapter is not None:  # small: gathered once (every rank), whatever path and attempts follow
            pairs = [(name, tensor.detach()) for name, tensor in weights()]
            weights = functools.partial(iter, pairs)
            if agree(self.rank == 0 and self._adapters_over_http()):
                return self._adapter_push_over_http(pairs, adapter, version, stats, start)
        if self.rank == 0:
            self._over_http = False  # this push goes over the group: membership counts again
        attempt = 0
        failures: dict[str, int] = {}  # failed attempts per server in this push
        try:
            while True:
                attempt += 1
                opening = (
                    functools.partial(self._start_push, stats) if self.rank == 0 and attempt == 1 else None
                )
                failed = self._stream(weights, version, stats, opening)
                redo = self.rank == 0 and bool(failed) and self._after_failure(failed, failures, stats)
                if not agree(redo):
                    break
        except BaseException:
            self.packer = Packer()  # a gather thread left behind may still write into the old buffers
            if self.rank == 0:  # the learner's own failure (e.g. a gather): no server keeps a session
                self._abort(self.members)
                self._all("continue_generation", self._whole(self.members), timeout_s=self.config.timeout_s)
            raise
        if self.rank == 0:
            stats.attempts = attempt
            self._finish(version, stats)
            stats.seconds = time.perf_counter() - start
            self.last = stats
            self._report(stats, f"by broadcast in {attempt} attempt(s)")
        return stats

    def _stream(
        self, weights: WeightSource, version: int, stats: PushStats | None, opening: Callable[[], None] | None
    ) -> dict[str, str]:
        """One attempt: every bucket of `weights()` gathered (every rank) and, on rank 0, sent to the
        members until one fails; {url: why} for the servers that failed it. `opening` (the first
        attempt's pause and begin, on rank 0) runs while the gather thread takes the first buckets,
        which wait for it before they are announced or packed. Where every member receives buckets
        in index order (`ordered_buckets`), each bucket is announced from the gather thread as soon
        as it is gathered (before it is packed), so a server queues its receive before the
        broadcast before it ends, and bucket i+1 is broadcast before bucket i's replies are awaited
        (one reply in flight); each reply is still checked, and a failure stops the attempt (a
        server that failed the earlier bucket is blamed first)."""
        failed: dict[str, str] = {}
        ahead: list[Bucket] = []  # announced from the gather thread, in order
        stop = threading.Event()  # a bucket failed: announce no more
        opened = threading.Event()  # the members are known: buckets may be announced and packed
        order = itertools.count()
        how: dict[str, Any] = {"ordered": False, "batches": False, "packer": None}  # set once `opening` ran

        def decided(bucket: Bucket) -> Bucket:
            """(gather thread, the sessions open) How `bucket` travels, and its index in the push to
            ordered members (none once a bucket failed: it will not be announced)."""
            bucket.flattened = self._travels_flat(how["packer"], bucket)
            if how["ordered"] and not stop.is_set():
                bucket.index = next(order)
            return bucket

        def gathered(bucket: Bucket) -> Bucket:
            """(gather thread) Decide how `bucket` travels; to ordered members, announce it now."""
            opened.wait()
            if decided(bucket).index is not None:
                with Phase(stats, "announce_ahead"):
                    self._announce([bucket], version)
                ahead.append(bucket)
            return bucket

        def stream() -> Iterator[Bucket]:
            """(gather thread) The attempt's buckets, gathered, announced and packed in turn; a
            resident push to members that take bucket batches is gathered whole (it costs no
            memory) and announced in one request per member."""
            pairs = weights()
            resident = isinstance(pairs, Resident)

            def pack(bucket: Bucket) -> Bucket:  # after `gathered`: the packer is chosen by then
                return self._pack(how["packer"], stats, resident, bucket)

            bucketed = iter_buckets(pairs, int(self.config.bucket_mb * (1 << 20)))
            if not resident:
                return map(pack, map(gathered, bucketed))
            every = list(bucketed)
            opened.wait()
            if not how["batches"] or not every:
                return map(pack, map(gathered, every))
            for bucket in every:
                decided(bucket)
            if every[-1].index is not None and not stop.is_set():  # all indexed: none failed yet
                with Phase(stats, "announce_ahead"):
                    self._announce(every, version)
                ahead.extend(every)
            return map(pack, every)  # packed as they are taken: the packer's slots bound how far

        buckets = prefetch(stream)
        in_flight = None
        try:
            try:
                if opening is not None:
                    opening()
                how["ordered"] = (
                    self.rank == 0
                    and bool(self.members)
                    and all(self.clients[u].ordered_buckets for u in self.members)
                )
                how["batches"] = how["ordered"] and all(self.clients[u].bucket_batches for u in self.members)
                how["packer"] = self.packer if self._flattens() else None
            finally:
                opened.set()
            for bucket in timed_iter(buckets, stats, "gather_wait"):
                if self.rank != 0 or failed or not self.members:
                    continue  # other ranks only gather; after a failure the rest is drained unsent
                failed, sent = self._send_bucket(bucket, version, stats)
                if in_flight is not None and (before := self._collect(in_flight, stats)):
                    failed = before if sent is None else {**self._collect(sent, stats), **before}
                    sent = None
                in_flight = sent
                if failed:
                    stop.set()
            if in_flight is not None:
                failed = self._collect(in_flight, stats)
        finally:
            stop.set()
            self._close_for_unsent(ahead)
        return failed

    def _close_for_unsent(self, ahead: list[Bucket]) -> None:
        """After an attempt that stopped early: a bucket announced ahead but never broadcast holds a
        server's receive (its engine thread, on the embedded server) until the group times out, so
        our end of the group is closed and those receives fail now; the next attempt or push
        rebuilds the group. Their replies are not awaited (each is bounded by its own timeout)."""
        if self.group is None or all(bucket.sent for bucket in ahead):
            return
        logger.warning("closing the weight group: %d bucket(s) announced were never broadcast",
                       sum(not bucket.sent for bucket in ahead))  # fmt: skip
        self._close_group()

    def _close_group(self) -> None:
        """Close our end of the group: the servers still waiting for a broadcast in it then fail
        fast instead of waiting out their timeout. It is rebuilt before anything else is sent."""
        assert self.group is not None
        self._stale_group = self.group.group_name
        self.group.close()
        self.group = None

    def _after_failure(self, failed: dict[str, str], failures: dict[str, int], stats: PushStats) -> bool:
        """Rank 0, after an attempt failed on `failed` ({url: why}): abort it on every member,
        drop those that stopped answering (and, with `transactional: any`, those failing a second
        time), rebuild the group and open new sessions. True: redo the push with the members left."""
        probe_s = self.config.timeout_s
        alive = self._bridge.run(self._healthy(list(failed), probe_s), timeout_s=probe_s + 10)
        for url in failed:
            failures[url] = failures.get(url, 0) + 1
        dead = {u: f"stopped answering ({why})" for u, why in failed.items() if u not in alive}
        self.members = [u for u in self.members if u not in dead]
        self._abort(self.members)
        again = {u: f"failed twice ({why})" for u, why in failed.items() if u in alive and failures[u] >= 2}
        self._dead.update(dead)
        self._drop(list(dead), dead)
        if again and self.config.transactional == "all":
            self._gave_up = "; ".join(f"{u} {why}" for u, why in again.items())
            logger.error(
                "version %d aborted on every server (weight_sync.transactional: all): %s",
                stats.version,
                self._gave_up,
            )
            again = {}
        self._drop(list(again), again)
        self._build_group([u for u in self.members if u not in dead and u not in again])
        if self._gave_up or not self.members:
            return False
        self._open_sessions()
        stats.bytes = stats.tensors = stats.buckets = stats.broadcasts = 0
        return bool(self.members)

    def _whole(self, urls: list[str]) -> list[str]:
        """Those of `urls` whose weights are whole after an aborted push: servers that stage
        updates, and the others if no bucket reached them in this push."""
        return [u for u in urls if self.clients[u].stages_updates or u not in self._touched]

    def _finish(self, version: int, stats: PushStats) -> None:
        """Rank 0: commit on the members (unless the push was given up), read every answering
        server's version back, resume those with whole weights, record and log one outcome per
        server of the live list."""
        committing = [] if self._gave_up else list(self.members)
        # a server with `session_control` stages (its weights are whole whatever the commit did), so
        # it continues in the commit's round trip, and answers with the version it serves after it
        control = {u for u in committing if self.clients[u].session_control}
        with Phase(stats, "commit"):
            calls = {u: {"resume": True} if u in control else {} for u in committing}
            replies = self._each("end_weight_update", calls, timeout_s=self.config.timeout_s)
        errors = errors_of(replies)
        asked = [u for u in self.urls if u not in self._dead and (u in self.members or u in self._why)]
        with Phase(stats, "read_back"):
            # read back in the commit's reply where it carries the version served after the commit
            read = {u: replies[u] for u in asked if type(replies.get(u)) is int}
            read.update(self._read_versions([u for u in asked if u not in read], self.config.timeout_s))
            unread = [u for u in asked if not isinstance(read[u], int)]
            read.update(self._read_versions(unread, self.config.timeout_s))  # once more: a lost reply
        self._abort([u for u in committing if errors[u] is not None])  # no session is left open
        outcomes = {url: self._outcome(url, version, committing, errors, read.get(url)) for url in self.urls}
        resumed = {u for u in control if errors[u] is None}
        with Phase(stats, "continue"):
            self._resume([u for u in asked if u not in resumed], outcomes)
        committed = [u for u, o in outcomes.items() if o.committed]
        stats.outcomes, stats.servers_updated, stats.servers_dropped = (
            outcomes,
            len(committed),
            list(self.dropped),
        )
        if committed:
            self._pushed_version, self._given_up = version, 0
        elif self._gave_up:  # every server refused it: a catch-up push waits, longer each time
            self._given_up += 1
            self._given_up_until = time.monotonic() + min(60.0, 2.0**self._given_up)
        self._pushed_at = time.monotonic()

    def _outcome(self, url: str, version: int, committing: list[str], errors: dict, seen: Any) -> Outcome:
        """How `url` left the push: committed only if it reads `version` back after its commit (the
        read-back decides, not the reply's success: the version the server serves after the commit,
        from the commit's reply where it carries one, else from `get_weight_version`); otherwise
        dropped with the reason."""
        if url in committing and seen == version:
            if errors[url] is not None:
                logger.warning("server %s: the commit's reply failed (%s), yet it reads back %d", url,
                               errors[url], version)  # fmt: skip
            return Outcome(True, version)
        if url in committing:
            if errors[url] is not None:
                why = f"commit failed: {errors[url]}"
                if not isinstance(seen, int):
                    why += f"; reading its version back failed: {seen}"
            elif isinstance(seen, int):
                why = f"read back version {seen} after the commit"
            else:
                why = f"reading its version back failed: {seen}"
            self._drop([url], {url: why})
        elif self._gave_up and url in self.members:
            why = f"push aborted for every server: {self._gave_up}"
        else:
            why = self._why.get(url, "not in the weight group (not answering)")
        return Outcome(False, seen if isinstance(seen, int) else None, why)

    def _resume(self, asked: list[str], outcomes: dict[str, Outcome]) -> None:
        """Continue generation on the servers of `asked` with whole weights; the others (and any
        whose continue failed) are marked paused in their outcome."""
        resume = [u for u in asked if outcomes[u].committed or u in self._whole([u])]
        errors = self._all("continue_generation", resume, timeout_s=self.config.timeout_s)
        for url in asked:
            if url not in resume:
                outcomes[url].paused = True
                outcomes[url].reason += "; its weights may be a mix: kept paused until re-synced"
            elif errors[url] is not None:
                outcomes[url].paused = True
                logger.error("server %s: /continue_generation failed: %s", url, errors[url])

    def _flattens(self) -> bool:
        """Rank 0, at the start of an attempt: every member takes `flattened_bucket` buckets."""
        return (
            self.rank == 0
            and bool(self.members)
            and all(self.clients[u].flattened_buckets for u in self.members)
        )

    @staticmethod
    def _travels_flat(packer: Packer | None, bucket: Bucket) -> bool:
        """`bucket` travels as one uint8 tensor: when a `packer` is given (every member takes
        `flattened_bucket`) and its layout allows it (`buckets.flat_layout`)."""
        return packer is not None and flat_layout(bucket.tensors)

    @staticmethod
    def _pack(packer: Packer | None, stats: PushStats | None, resident: bool, bucket: Bucket) -> Bucket:
        """(gather thread) Set `bucket.flat` when it travels flat (a view where its tensors already
        lie back to back: `Packer.pack`); a bucket of `resident` weights that travels as they lie
        holds no memory of its own (`Bucket.held`)."""
        if bucket.flattened:
            assert packer is not None
            with Phase(stats, "flatten"):
                bucket.flat = packer.pack(bucket.tensors)
        storage = bucket.tensors[0].untyped_storage().data_ptr()
        packed = bucket.flat is not None and bucket.flat.untyped_storage().data_ptr() != storage
        bucket.held = not resident or bucket.copied or packed
        return bucket

    def _send_bucket(
        self, bucket: Bucket, version: int, stats: PushStats
    ) -> tuple[dict[str, str], InFlight | None]:
        """Broadcast one bucket, announced to every member first unless it was announced ahead (an
        ordered push), and await the replies unless the push is ordered; returns ({url: why} for
        the servers that failed it: every member, if the broadcast failed and none says why; the
        bucket in flight, its replies not yet awaited, or None)."""
        assert self.group is not None, "a push streams only over a built group"
        flat = bucket.flat
        self._touched.update(self.members)
        if bucket.futures is None:
            with Phase(stats, "announce"):
                self._announce([bucket], version)
        futures = bucket.futures
        assert futures is not None
        bucket.sent = True
        refused = self._answered_with_error(futures)
        if refused:  # refused before the broadcast (announced ahead): they will not receive it
            self._close_group()  # the members waiting for it fail fast rather than at their timeout
            failed = self._replies(futures)
            return {u: failed[u] for u in refused}, None
        device = "cuda" if self.backend == "nccl" else "cpu"
        try:
            with Phase(stats, "broadcast"):
                for tensor in [flat] if flat is not None else bucket.tensors:
                    self.group.broadcast(tensor.to(device), 0)
        except Exception as exc:
            logger.error("broadcast of a bucket failed (%s); finding the server that failed", exc)
            # a server that already answered with an error broke the collective; the others then fail
            # only because our end closes: they are not blamed
            early = self._answered_with_error(futures)
            self._close_group()
            failed = self._replies(futures)
            if early:
                return {u: failed[u] for u in early}, None
            return failed or {u: f"broadcast failed: {exc}" for u in self.members}, None
        broadcasts = 1 if flat is not None else len(bucket.tensors)
        sent = InFlight(
            futures, bucket.announced, bucket.nbytes, len(bucket.tensors), broadcasts, bucket.covered
        )
        if bucket.index is not None:
            return {}, sent
        return self._collect(sent, stats), None

    @staticmethod
    def _answered_with_error(futures: dict[str, Any]) -> list[str]:
        """The members whose reply to a bucket's announcement is already in, and an error."""
        return [u for u, f in futures.items() if f.done() and f.exception() is not None]

    def _announce(self, buckets: list[Bucket], version: int) -> None:
        """Send every member the description of `buckets` (names, dtypes, shapes; its receives then
        wait for the broadcasts; their index in the push to servers that receive in index order),
        in one request: `bucket.futures` are the members' replies, `bucket.announced` when. Several
        buckets (in order, to members with `bucket_batches`) go as the first and `more`: they share
        its replies, which come once all of them are received, so every bucket but the last is
        `covered`. The version travels with the last bucket only: a server that loads buckets as
        they arrive (SGLang) never labels a partial update with it."""
        assert self.group is not None
        first, rest = buckets[0], buckets[1:]

        def described(bucket: Bucket) -> dict[str, Any]:
            return {
                "names": bucket.names,
                "dtypes": [dtype_name(t.dtype) for t in bucket.tensors],
                "shapes": [list(t.shape) for t in bucket.tensors],
                "load_format": "flattened_bucket" if bucket.flattened else None,
            }

        head = described(first)
        extras: dict[str, Any] = {} if first.index is None else {"bucket": first.index}
        if rest:
            extras["more"] = [described(b) for b in rest]
        announced = time.perf_counter()
        futures = {
            url: self._bridge.submit(
                asyncio.wait_for(
                    self.clients[url].update_weights_from_distributed(
                        head["names"],
                        head["dtypes"],
                        head["shapes"],
                        self.group.group_name,
                        version if buckets[-1].last else None,
                        flattened=first.flattened,
                        **extras,
                    ),
                    2 * self.config.timeout_s,
                )
            )
            for url in self.members
        }
        for bucket in buckets:
            bucket.futures, bucket.announced, bucket.covered = futures, announced, bucket is not buckets[-1]

    def _collect(self, sent: InFlight, stats: PushStats) -> dict[str, str]:
        """Await a broadcast bucket's replies (none for a bucket a later one's reply covers) and
        count it; {url: why} for the servers that failed it."""
        with Phase(stats, "replies"):
            failed = {} if sent.covered else self._replies(sent.futures)
        stats.bucket_round_trips.append(time.perf_counter() - sent.announced)
        stats.bytes += sent.nbytes
        stats.tensors += sent.tensors
        stats.buckets += 1
        stats.broadcasts += sent.broadcasts
        stats.peak_bucket_bytes = max(stats.peak_bucket_bytes, sent.nbytes)
        return failed

    def _replies(self, futures: dict[str, Any]) -> dict[str, str]:
        """{url: why} for the bucket requests that failed (each is bounded by its own timeout)."""
        failed = {}
        for url, future in futures.items():
            try:
                future.result()
            except Exception as exc:
                why = f"bucket failed: {type(exc).__name__}: {exc}"
                logger.error("server %s: %s", url, why)
                failed[url] = why
        return failed

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        if self.rank == 0 and self._bridge is not None:
            self._leave_group()
        super().close()
