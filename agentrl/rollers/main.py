"""`agentrl roller`: wire a roller process from the run config and run it.

    agentrl roller --config roller.yaml --queue tcp://learner:5555 --servers http://a:30000,http://b:30000

The roller needs its own section plus the env, inference and queue sections; each
component is built from its own section. SIGINT/SIGTERM stop admitting new groups and
let in-flight groups finish and be put, so no admitted work is lost.
"""

from __future__ import annotations

import asyncio
import signal

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger

logger = get_logger(__name__)


def tokenizer_path(config: AgentRLConfig) -> str:
    """The roller's tokenizer: its own setting, else the served model, else the learner's model."""
    return config.roller.tokenizer_path or config.inference.model_path or config.learner.model_path


async def run_roller(config: AgentRLConfig) -> int:
    from transformers import AutoTokenizer

    from agentrl.envs.registry import env_factory, load_env_class
    from agentrl.inference.router import from_config as create_router
    from agentrl.queue.base import create as create_queue
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.roller import Roller
    from agentrl.rollers.tasks import task_stream

    make_env = env_factory(config.env)
    env_cls = load_env_class(config.env.name)
    tasks = task_stream(config.roller.tasks, env_cls, config.roller.seed, **config.roller.task_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(config))
    renderer = ChatRenderer(tokenizer, make_env().tool_schemas or None)
    # a router even over one server: requests wait out a server's restart (inference.server_wait_s)
    # and skip servers behind the admissible window (run-wide max_staleness, as the learner's)
    client = create_router(config.inference, config.max_staleness)
    producer = create_queue(config.queue).producer()
    metrics = MetricsLogger(config.run_dir, name="roller")
    roller = Roller(config.roller, make_env, tasks, client, renderer, producer, metrics)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, roller.stop)
    logger.info(
        "roller: %s episodes × %d per group, servers %s, queue %s",
        config.env.name,
        config.roller.group_size,
        client.url,
        getattr(config.queue, "address", config.queue.type),
    )
    try:
        stats = await roller.run()
    finally:
        await client.close()
        producer.close()
        metrics.close()
    logger.info(
        "roller done: %d groups put, %d dropped (uniform reward), %d failed",
        stats.groups_put,
        stats.groups_dropped_uniform,
        stats.groups_failed,
    )
    if roller.fatal:
        logger.error("roller gave up: %s (roller.max_consecutive_failures)", roller.fatal)
        return 1
    return 0
