"""TransferQueue: streams trajectory groups from rollers to the learner (zmq; redis; nixl).

`create(config.queue)` gives the backend; see `base.py` for the producer/consumer
interfaces and `zmq_server.py` for the server the learner hosts."""

from agentrl.queue.base import Backend, Batch, Consumer, Producer, QueueError
from agentrl.queue.registry import create

__all__ = ["Backend", "Batch", "Consumer", "Producer", "QueueError", "create"]
