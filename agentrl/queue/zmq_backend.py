"""`queue.type: zmq`: the factory that builds the ZeroMQ queue's server, producers and consumers.

It sits beside, not inside, the modules it builds from (`zmq_server.py`, `zmq_producer.py`, `zmq_consumer.py` and, with
`queue.nixl`, `nixl_transport.py`), so none of those imports another through it."""

from __future__ import annotations

from typing import Any

from agentrl.queue.auth import Authenticator, load_secret
from agentrl.queue.base import Backend
from agentrl.queue.zmq_consumer import ZmqConsumer
from agentrl.queue.zmq_producer import ZmqProducer


def _auth_for(config: Any) -> Authenticator:
    return Authenticator(load_secret(config.secret_env) if config.auth == "mac" else None)


class ZmqBackend(Backend):
    """`create(config)` for `queue.type: zmq`."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def server(self, groups_per_step: int, max_staleness: int, **kwargs: Any) -> Any:
        from agentrl.queue.zmq_server import QueueServer

        return QueueServer(self.config, groups_per_step, max_staleness, **kwargs)

    def producer(self, address: str | None = None, name: str = "producer", **kwargs: Any) -> ZmqProducer:
        """`name` (e.g. `roller-3`) names the producer's lease in the queue's logs."""
        cls = ZmqProducer
        if self.config.nixl:
            from agentrl.queue.nixl_transport import NixlProducer as cls
        c = self.config
        return cls(
            address or c.address,
            _auth_for(c),
            c.producer_window_bytes,
            heartbeat_s=c.heartbeat_s,
            connect_timeout_s=c.connect_timeout_s,
            silent_timeout_s=c.silent_timeout_s,
            run_id=c.run_id,
            name=name,
            secret_env=c.secret_env,
        )

    def consumer(
        self, name: str = "rank0", server: Any = None, address: str | None = None, hello: dict | None = None
    ) -> ZmqConsumer:
        """With `server` (hosted in this process) the consumer uses its inproc socket: no MAC, no copy.
        `hello` (see `ZmqConsumer`) is checked by the queue; `queue.run_id`, when set, is added to it."""
        hello = {**(hello or {}), **({"r": self.config.run_id} if self.config.run_id else {})}
        if server is not None:
            return ZmqConsumer(server.inproc_address, name, Authenticator(None), server=server, hello=hello)
        return ZmqConsumer(
            address or self.config.address, name, _auth_for(self.config), hello=hello,
            connect_timeout_s=self.config.connect_timeout_s,
        )  # fmt: skip
