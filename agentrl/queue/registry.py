"""The queue backends by name (`queue.type`), and `create()`, which builds the one a config names.

The interfaces are in `base.py`; each backend is one module plus one entry here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrl.plugins import Registry, UnknownName
from agentrl.queue.base import Backend, QueueError

if TYPE_CHECKING:
    from agentrl.queue.config import RedisQueueConfig, ZmqQueueConfig

BACKENDS: Registry[type[Backend]] = Registry(
    "queue.type",
    None,  # a backend's config is a section of its own in agentrl/queue/config.py: built-ins only
    {"zmq": "agentrl.queue.zmq_backend:ZmqBackend", "redis": "agentrl.queue.redis_backend:RedisBackend"},
)


def create(config: ZmqQueueConfig | RedisQueueConfig) -> Backend:
    """The backend named by `config.type`."""
    try:
        cls = BACKENDS.get(config.type)
    except UnknownName as exc:
        raise QueueError(str(exc)) from None
    return cls(config)
