"""The TransferQueue's interfaces (`registry.py` picks a backend by `config.type`).

Rollers hold a `Producer` (asyncio): `put(group)` returns once the queue has taken the
group (after its write-ahead-log write when durable) and waits while the queue is full;
`acquire_start(n)` is the admission gate (a roller starts a group only while it can still be
trained on within `max_staleness`, docs/architecture.md "TransferQueue") and hands out
the next `n` numbers of the run's shared task cursor. The zmq backend keeps a producer's
admitted-but-unput groups under a lease that its heartbeat renews (see `zmq_admission.py`).
Learner ranks hold a `Consumer` (blocking, usable from a torch loop): `get_batch` hands
out whole groups admissible at the learner's version, `ack` removes them once trained on,
`publish_version` tells admission and staleness the learner's real version.

Several learner data-parallel ranks take *disjoint shares*: each rank is its own
consumer (a distinct `name`, e.g. `rank3`) and calls
`get_batch(groups_per_step // world_size, ...)`; the server hands every group to exactly
one rank, and only rank 0 needs to `publish_version`. A rank that restarts under the same
name gets back the groups it held and had not acked.

    backend = create(config.queue)
    server = backend.server(groups_per_step=..., max_staleness=...)   # zmq only
    producer = backend.producer()          # in a roller
    consumer = backend.consumer("rank0", server=server)
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agentrl.types import Group

DROP_REASONS = (None, "stale", "skipped")
"""`Consumer.ack(..., dropped=)`: trained on, or dropped as too stale / in a step the learner skipped."""


def check_drop_reason(dropped: str | None) -> None:
    """Refuse an `ack(dropped=...)` reason the queue would not count."""
    if dropped not in DROP_REASONS:
        raise ValueError(f"dropped must be one of {DROP_REASONS}, got {dropped!r}")


class QueueError(RuntimeError):
    """The queue refused a request or could not be reached."""


class QueueUnavailable(QueueError):
    """The queue cannot be reached, refuses this client's credentials or run, or went silent:
    the message names what to check. A producer that raised it raises it for every later call."""


class RunOver(QueueError):
    """The learner finished the run this queue serves: a roller exits cleanly."""


class LeaseLapsed(QueueError):
    """This producer's lease lapsed (no heartbeat within the lease; e.g. a network partition):
    the queue took its admission credits back, so groups admitted under it are refused. The
    producer has already started a fresh lease; admissions from now on are valid."""


@dataclass(frozen=True)
class Admission:
    """What `acquire_start(n)` grants: the learner version at the time, and tasks
    `first_task .. first_task + n - 1` of the run's shared task cursor (-1: the backend has none)."""

    version: int
    first_task: int = -1


@dataclass
class Batch:
    """Whole groups admissible at the requested learner version, plus what happened on the way."""

    groups: list[Group]
    learner_version: int
    dropped_stale: int = 0
    """Groups found inadmissible (too stale) while serving this request; not trained on, counted."""
    ages_s: list[float] = field(default_factory=list)
    """Seconds each group waited in the queue before being handed out."""
    staleness: list[int] = field(default_factory=list)
    """`learner_version - min(versions)` of each group (with per-token staleness, over the
    generated tokens still in its loss mask)."""
    stale_tokens_masked: float = 0.0
    """Per-token staleness: the share of the batch's generated tokens taken out of the loss mask
    as older than the bound (`Group.without_stale_tokens`); 0 when staleness is judged per group."""

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    def __len__(self) -> int:
        return len(self.groups)


class Producer(abc.ABC):
    """Roller side (asyncio).

    `max_staleness`: the run's, as the queue told this producer (None until it has), so a roller
    knows the admissible window without its own config; `on_max_staleness(k)` is called when it
    learns (or the queue changes) it, and `on_version(v)` with the learner's version each time
    the queue reports it (it may go down: a learner resumed from an older checkpoint).

    The launcher's live list (`inference.server_list`) reaches a roller through its queue: every
    backend's producer is a `server_list.Follower` of what the queue carries (the zmq replies,
    Redis's `<stream>:servers` key read by the producer's heartbeat), and calls `on_servers(epoch,
    urls)` once for each newer epoch, in order (the roller's router swaps its server set), and
    `on_services(epoch, services)` when the env services' URLs moved (`envs.base.live_services`).
    A hook that raises is logged; the producer's calls go on."""

    max_staleness: int | None = None
    on_max_staleness: Callable[[int], None] | None = None
    on_version: Callable[[int], None] | None = None
    on_servers: Callable[[int, list[str]], None] | None = None
    on_services: Callable[[int, dict[str, str]], None] | None = None

    @abc.abstractmethod
    async def put(self, group: Group) -> None:
        """Hand one group to the queue; returns once acknowledged, waits while the queue is full."""

    @abc.abstractmethod
    async def acquire_start(self, n: int = 1) -> Admission:
        """Wait for permission to start `n` new groups; returns the version and the tasks granted."""

    @abc.abstractmethod
    async def release_start(self, n: int = 1) -> None:
        """Give back admission for `n` started groups that will never be put (abandoned)."""

    @abc.abstractmethod
    async def current_version(self) -> int:
        """The learner version last published to the queue."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets; pending puts are abandoned."""


def mask_stale(groups: list[Group], learner_version: int, max_staleness: int) -> tuple[list[Group], float]:
    """Per-token staleness on groups about to be handed out: copies without their tokens older
    than the bound in the loss mask, and the share of generated tokens taken out."""
    generated = sum(e.num_generated for g in groups for e in g.episodes)
    pairs = [g.without_stale_tokens(learner_version, max_staleness) for g in groups]
    masked = sum(n for _, n in pairs)
    return [g for g, _ in pairs], (masked / generated if generated else 0.0)


class Consumer(abc.ABC):
    """Learner side (blocking).

    `per_token_staleness` (`learner.staleness: token`): a group stays admissible while any of its
    generated tokens is within `max_staleness` (`Group.is_admissible(..., per_token=True)`), and
    its older tokens leave the loss mask before it is handed out (`Batch.stale_tokens_masked`);
    a group with none left is dropped as stale, as a group is under the per-group rule."""

    per_token_staleness: bool = False

    def _hand_out(
        self,
        groups: list[Group],
        ages_s: list[float],
        learner_version: int,
        max_staleness: int,
        dropped: int,
        staleness: list[int] | None = None,
    ) -> Batch:
        """The `Batch` of the groups `get_batch` took: with per-token staleness, their tokens older
        than the bound leave the loss mask first (`mask_stale`). `staleness`: each group's, where the
        queue already computed it at `learner_version` (a pass over every token's version is not
        free: ~0.2 ms per MiB of group)."""
        masked = 0.0
        if self.per_token_staleness:
            groups, masked = mask_stale(groups, learner_version, max_staleness)
            staleness = None  # masking changes a group's oldest generated token
        return Batch(
            groups=groups,
            learner_version=learner_version,
            dropped_stale=dropped,
            ages_s=ages_s,
            staleness=staleness if staleness is not None else [g.staleness(learner_version) for g in groups],
            stale_tokens_masked=masked,
        )

    @abc.abstractmethod
    def get_batch(
        self, num_groups: int, learner_version: int, max_staleness: int, timeout_s: float | None = None
    ) -> Batch:
        """`num_groups` whole groups admissible at `learner_version`; `TimeoutError` after `timeout_s`."""

    @abc.abstractmethod
    def ack(self, group_ids: list[str], dropped: str | None = None) -> None:
        """The learner is done with these groups: the queue forgets them (and their WAL records).

        `dropped=None`: trained on. `dropped="stale"` / `"skipped"`: not trained on (too stale;
        or the learner skipped the whole step, e.g. no trainable tokens) — counted under
        `dropped_<reason>`, and their admission is returned so rollers start replacements."""

    @abc.abstractmethod
    def publish_version(self, version: int) -> None:
        """Tell the queue the learner's version (admission and staleness use it)."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, Any]:
        """Queue depth, bytes, groups in/out, dropped for staleness, ages at consumption."""

    def finish(self) -> None:  # noqa: B027 - a no-op is the right default, not a missing override
        """The run is over: tell the producers (they get `RunOver`: the zmq queue answers so, Redis
        keeps a `finished` flag that their calls read)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets; unacked groups go back to the queue when this name reconnects."""


class Backend(abc.ABC):
    """Builds the server and clients of one backend from its config section."""

    @abc.abstractmethod
    def producer(self, **kwargs: Any) -> Producer: ...

    @abc.abstractmethod
    def consumer(self, name: str = "rank0", **kwargs: Any) -> Consumer: ...

    def server(self, groups_per_step: int, max_staleness: int, **kwargs: Any) -> Any:
        raise QueueError(f"the {type(self).__name__} backend has no server to host")
