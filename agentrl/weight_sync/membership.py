"""The broadcast engine's weight group and who is in it: `GroupMembership`, the base that
`BroadcastEngine` (`broadcast.py`) pushes through.

The group is learner rank 0 (rank 0, hosts the rendezvous) plus every worker of every inference
server in it (engine i at `rank_offset = 1 + i × workers_per_server`, as SGLang numbers them),
separate from the training group; NCCL on GPUs, gloo on CPU. Group names carry a per-process tag,
so a learner that restarts never collides with the names a surviving server still holds from its
predecessor.

Membership follows the servers: a set-up that a server fails drops it and the group is rebuilt
without it (`_build_group`); before each push, servers the live server list dropped leave
(`_follow_list`), members probed down leave and servers back up (dropped ones that answer again,
members restarted on the same address: their version is not the last pushed) or new in the list
join (`_regroup`), each rejoin retried with backoff; a member that cannot be paused is dropped
before anything is broadcast (`_pause_members`). A dropped server rejoins at a later push once it
answers its liveness check (`alive`) again. Every drop is recorded with its reason for the push's
outcomes.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING, Any

import torch

from agentrl.inference.base import DistributedWeightUpdateClient, InferenceError
from agentrl.inference.weight_group import WeightGroup, join_group
from agentrl.log import get_logger
from agentrl.net import free_port
from agentrl.weight_sync.base import AdapterSpec, WeightSyncEngine
from agentrl.weight_sync.watch import DOWN, ServerWatch

if TYPE_CHECKING:
    from pathlib import Path

    from agentrl.config import BroadcastSyncConfig, InferenceConfig

logger = get_logger(__name__)


class GroupMembership(WeightSyncEngine):
    """Rank 0's weight group and its members, dropped servers and rejoin backoff; the push itself
    is `BroadcastEngine`'s. Every server's client must join a weight group
    (`DistributedWeightUpdateClient`): `init` refuses one that does not, naming the disk engine."""

    client_interface = DistributedWeightUpdateClient
    clients: dict[str, DistributedWeightUpdateClient]

    def __init__(
        self,
        config: BroadcastSyncConfig,
        urls: list[str],
        inference: InferenceConfig,
        rank: int,
        servers_file: str | Path | None = None,
        adapter: AdapterSpec | None = None,
    ) -> None:
        super().__init__(urls, inference, rank, servers_file, adapter)
        self.config = config
        self.backend = (
            config.backend if config.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        )
        self.members: list[str] = []  # servers in the current group
        self.dropped: list[str] = []
        self.group: WeightGroup | None = None
        self._generation = 0
        self._tag = secrets.token_hex(3)  # group names unique to this learner process
        self.watch: ServerWatch | None = None
        self._pushed_version: int | None = None
        self._pushed_at = 0.0  # time.monotonic() at the end of the last push
        self._attempts: dict[str, int] = {}  # rejoin attempts in a row, per server
        self._retry_at: dict[str, float] = {}
        self._stale_group: str | None = None  # a group our end closed mid-push, still held by the servers
        # one push's record (rank 0): why servers were dropped, and which stopped answering
        self._why: dict[str, str] = {}
        self._dead: set[str] = set()
        self._over_http = False  # adapters go to the servers over HTTP: group membership does not matter

    def _refusal(self, url: str, client: object) -> str:
        return (
            f"weight_sync.type: broadcast cannot update server {url}: its client {type(client).__name__} "
            f"(inference.type: {self.inference.type}) joins no weight group (it is not a "
            f"DistributedWeightUpdateClient); set weight_sync.type: disk, which loads weights from a "
            "directory every server can read"
        )

    def _build_group(self, urls: list[str], again: bool = True) -> None:
        """(Re)create the group with `urls`; servers that fail to join are dropped. Never raises: a
        set-up that fails twice with no server to blame drops them all (they rejoin later)."""
        self._leave_group()
        self._generation += 1
        name = f"agentrl_weights_{self._tag}_{self._generation}"
        port = self.config.master_port or free_port(self.config.master_address)
        if self.config.master_port and self._generation > 1:
            port = free_port(self.config.master_address)  # the fixed port may still be held
        world = 1 + len(urls) * self.config.workers_per_server
        futures = {
            url: self._bridge.submit(
                asyncio.wait_for(
                    self.clients[url].init_weights_update_group(
                        self.config.master_address,
                        port,
                        1 + i * self.config.workers_per_server,
                        world,
                        name,
                        self.backend,
                    ),
                    2 * self.config.timeout_s,
                )
            )
            for i, url in enumerate(urls)
        }
        try:
            group = join_group(
                self.config.master_address,
                port,
                0,
                world,
                name,
                self.backend,
                self.config.timeout_s,
            )
        except Exception as exc:
            # a server that already answered with an error held the rendezvous up; the others' joins
            # fail only because ours gave up: they are not blamed (nor waited for)
            early = [u for u, f in futures.items() if f.done() and f.exception() is not None]
            for url, future in futures.items():
                if url not in early:
                    future.cancel()
            failed = self._failed({u: futures[u] for u in early}) if early else self._failed(futures)
            if not failed:
                if again:
                    logger.error("weight group %s: set-up failed (%s); trying once more", name, exc)
                    self._build_group(urls, again=False)
                    return
                failed = dict.fromkeys(urls, f"weight group set-up failed twice: {exc}")
            logger.error(
                "weight group %s: %s did not join (%s); rebuilding without them", name, list(failed), exc
            )
            self._drop(list(failed), failed)
            self._build_group([u for u in urls if u not in failed])
            return
        failed = self._failed(futures)
        self.group, self.members = group, [u for u in urls if u not in failed]
        if failed:  # joined the collective but reported an error: do not trust it
            self._drop(list(failed), failed)
            self._build_group(self.members)
            return
        logger.info(
            "weight group %s: learner + %d server(s) on port %d (%s)", name, len(urls), port, self.backend
        )

    def _failed(self, futures: dict[str, Any]) -> dict[str, str]:
        failed = {}
        for url, future in futures.items():
            try:
                future.result()  # bounded by its own timeout
            except Exception as exc:
                logger.error("server %s failed to join the weight group: %s", url, exc)
                failed[url] = f"joining the weight group failed: {type(exc).__name__}: {exc}"
        return failed

    def _drop(self, urls: list[str], why: dict[str, str] | None = None) -> None:
        for url in urls:
            reason = (why or {}).get(url, "")
            self._why[url] = reason
            if url not in self.dropped:
                self.dropped.append(url)
                logger.error("server %s dropped from weight sync (%s); it rejoins once healthy", url, reason)

    def _leave_group(self) -> None:
        """Close our end first (a server still receiving then fails fast), then tell the members."""
        if self.group is not None:
            self._stale_group = self.group.group_name
            self.group.close()
            self.group = None
        if self._stale_group is not None:
            self._all("destroy_weights_update_group", self.members, self._stale_group, timeout_s=10)
            self._stale_group = None
        self.members = []

    def _follow_list(self) -> None:
        """Before a push: the servers the live list dropped leave (a member still up is told to
        destroy its group, then the group is rebuilt without them). New ones join in `_regroup`."""
        self._reread()
        removed = self._take_removed()
        if not removed:
            return
        assert self.watch is not None
        was_member = [u for u in removed if u in self.members]
        self.dropped = [u for u in self.dropped if u not in removed]
        for url in removed:
            self._attempts.pop(url, None)
            self._retry_at.pop(url, None)
        if was_member:
            logger.warning(
                "servers %s left the server list: rebuilding the weight group without them", was_member
            )
            keep = [u for u in self.members if u not in removed]
            self._build_group(keep)
        self.watch.forget(removed)
        self._forget(removed)

    def _regroup(self) -> None:
        """Before a push: members probed down leave the group; servers back up join it (dropped
        ones, and members restarted in place, whose version is not the one last pushed), and so do
        servers new in the live server list."""
        if self.watch is None:
            return
        self._follow_list()
        self.watch.probe_now([u for u in self.urls if u not in self.members])  # not the silent ones
        dead, back = self._changed(self.watch.fresh(self._pushed_at))
        if not dead and not back:
            return
        if dead:
            logger.error("servers %s stopped answering: leaving them out of this push", dead)
            self._dead.update(dead)
            self._drop(dead, dict.fromkeys(dead, "probed down before the push"))
        if back:
            self._take_back(back)
        # a restarted member holds no group: it is not asked to destroy the old one
        keep = self.members = [u for u in self.members if u not in dead and u not in back]
        self._build_group([u for u in self.urls if u in keep or u in back])

    def _changed(self, fresh: dict[str, Any]) -> tuple[list[str], list[str]]:
        """From the latest probes: (members probed down, servers up that should join: not members,
        or members restarted in place), outside their retry backoff. A member at the pushed version
        clears its rejoin count."""
        now = time.monotonic()
        dead = [u for u in self.members if fresh.get(u) == DOWN]
        back = []
        for url, v in fresh.items():
            restarted = url in self.members and self._pushed_version is not None and v != self._pushed_version
            if v == DOWN or self._retry_at.get(url, 0.0) > now:
                continue
            if url not in self.members or restarted:
                back.append(url)
            else:
                self._attempts.pop(url, None)  # a member at the pushed version: its rejoin worked
        return dead, back

    def _take_back(self, back: list[str]) -> None:
        """`back` join at this push: out of `dropped`, each with its next retry time should the
        rejoin not bring it to the version (backoff doubling up to a minute)."""
        added = [u for u in back if u not in self.members and u not in self.dropped]  # new in the list
        again = [u for u in back if u not in added]
        if added:
            logger.info("servers %s added: rebuilding the weight group with them", added)
        if again:
            logger.info("servers %s are up again: rebuilding the weight group with them", again)
        self.dropped = [u for u in self.dropped if u not in back]
        now = time.monotonic()
        for url in back:
            self._attempts[url] = self._attempts.get(url, 0) + 1
            self._retry_at[url] = now + min(60.0, 2.0 ** self._attempts[url])

    def _pause_members(self) -> None:
        """Pause every member (but those that pause as their session opens: `session_control`); one
        that cannot be paused is dead: rebuild the group without it before anything is broadcast (a
        dead peer would stall the others mid-bucket)."""
        apart = [u for u in self.members if not self.clients[u].session_control]
        errors = self._all("pause_generation", apart, timeout_s=self.config.timeout_s)
        dead = {url: f"/pause_generation failed: {exc}" for url, exc in errors.items() if exc is not None}
        if dead:
            self._dead.update(dead)
            self._drop(list(dead), dead)
            keep = self.members = [u for u in self.members if u not in dead]
            self._build_group(keep)

    async def _healthy(self, urls: list[str], timeout_s: float) -> list[str]:
        """Those of `urls` that answer within `timeout_s` (asked at once, not in turn): a stopped
        server (SIGSTOP, a hung host) is not alive, however long its client would wait to connect."""

        async def answers(url: str) -> bool:
            try:
                return bool(await asyncio.wait_for(self.clients[url].alive(), timeout_s))
            except (TimeoutError, InferenceError):
                return False

        found = await asyncio.gather(*(answers(u) for u in urls))
        return [url for url, ok in zip(urls, found, strict=True) if ok]
