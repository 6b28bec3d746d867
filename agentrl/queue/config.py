"""The queue's config section (`queue:`): one model per backend, chosen by `type`.

Kept beside the queue code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it. Imports nothing of the backends themselves.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from agentrl.section import Section


class ZmqQueueConfig(Section):
    """The TransferQueue over ZeroMQ, hosted by the learner or by `agentrl queue`."""

    type: Literal["zmq"] = "zmq"
    address: str = "tcp://127.0.0.1:5555"
    """Where the queue server binds (a hosting learner) and where producers (and, with
    `standalone`, the learner) connect."""
    capacity_groups: int = Field(1024, ge=1)
    """Groups held before producers are made to wait."""
    capacity_bytes: int = Field(1 << 30, ge=1 << 16)
    """Bytes held before producers are made to wait."""
    max_message_bytes: int = Field(256 << 20, ge=1 << 12)
    """Largest group accepted on the wire; larger ones are refused and counted."""
    durable: bool = False
    """Write each accepted group to a write-ahead log before acknowledging it, so a restarted queue
    (or the hosted queue of a resumed learner) delivers it. Off: the groups the queue held when it
    died (kill -9 of the learner hosting it) are lost, counted as `lost_undurable` (ledger, metric,
    WARNING at the next start), and rollers regenerate them."""
    wal_dir: str | None = None
    """Directory of the write-ahead log (defaults to `<run_dir>/queue_wal` when durable)."""
    selection: Literal["fifo", "oldest_first"] = "fifo"
    """Order in which admissible groups are handed to the learner."""
    wal_fsync: bool = False
    """Also fsync the write-ahead log before acknowledging (survives a machine crash, not only
    a crash of the queue process); costs one fsync per batch of puts. Without it, groups a machine
    crash cuts from the log's tail are counted as `lost_undurable` and named at the next start."""
    auth: Literal["mac", "none"] = "mac"
    """`mac`: every message carries a MAC under the shared secret in `secret_env`; messages that
    fail it are refused and counted. `none`: no authentication (trusted networks only)."""
    secret_env: str = "AGENTRL_QUEUE_SECRET"
    """Environment variable holding the shared secret that authenticates every message."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a learner rank may hold groups without acking before they are handed out again."""
    producer_window_bytes: int = Field(256 << 20, ge=1 << 16)
    """Bytes one producer may have sent and not yet acknowledged (bounds what a full server
    holds back on top of its capacity)."""
    nixl: bool = False
    """Move array payloads over NIXL (RDMA/UCX) with ZeroMQ as the control plane."""
    standalone: bool = False
    """The queue runs on its own (`agentrl queue --bind ...`) at `address`: the learner connects to
    it as a consumer instead of hosting (binding) one, so a durable queue outlives the learner."""
    run_id: str | None = None
    """The run this queue serves; producers and consumers naming another run are refused. None: a
    hosted queue takes the learner's run id (kept in `<run_dir>/run_id` across `--resume`), a
    standalone one its WAL's (durable) or a fresh one; clients adopt the first run id they hear."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between a producer's heartbeats, which renew its lease and detect a restarted server."""
    roller_lease_s: float = Field(10.0, gt=0)
    """Seconds without a message after which a producer's lease lapses: the queue takes back the
    admission credits of the groups it started and had not put (counted `admission_reclaimed`)."""
    connect_timeout_s: float = Field(30.0, gt=0)
    """A client that has heard nothing from the queue for this long after starting gives up with
    an error naming the address, the secret and the run to check."""
    silent_timeout_s: float = Field(120.0, gt=0)
    """A producer whose queue has gone silent for this long (learner gone for good) gives up; keep
    it above the time a learner takes to restart with `--resume`."""

    @model_validator(mode="after")
    def _check_timeouts(self) -> ZmqQueueConfig:
        if self.roller_lease_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"queue.roller_lease_s: must be at least 2 x queue.heartbeat_s ({2 * self.heartbeat_s}s); "
                "a lease shorter than two heartbeats lapses on one late message"
            )
        if self.standalone and any(h in self.address for h in ("*", "0.0.0.0", "[::]")):
            raise ValueError(
                f"queue.address: {self.address!r} is a bind address; with queue.standalone the learner "
                "connects to the standalone queue, so give its host (e.g. tcp://queue-host:5555)"
            )
        return self


class RedisQueueConfig(Section):
    """The TransferQueue over Redis Streams, for teams that already run Redis."""

    type: Literal["redis"] = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    """Redis server URL."""
    stream: str = "agentrl:groups"
    """Stream key the groups are appended to."""
    consumer_group: str = "learner"
    """Redis consumer group of the learner ranks."""
    capacity_groups: int = Field(1024, ge=1)
    """Pending groups before producers are made to wait."""
    selection: Literal["fifo", "oldest_first"] = "fifo"
    """Order in which admissible groups are handed to the learner."""
    lease_s: float = Field(600.0, gt=0)
    """Seconds a learner rank may hold groups without acking before another rank claims them."""
    heartbeat_s: float = Field(2.0, gt=0)
    """Seconds between a producer's heartbeats, which renew its lease on its admission credits."""
    roller_lease_s: float = Field(10.0, gt=0)
    """Seconds without a heartbeat after which a producer's admission credits are reclaimed
    (`admission_reclaimed`) and its lease is refused (it starts a fresh one)."""


QueueConfig = Annotated[ZmqQueueConfig | RedisQueueConfig, Field(discriminator="type")]
