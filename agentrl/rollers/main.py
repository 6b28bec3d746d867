"""`agentrl roller`: wire a roller process from the run config and run it.

    agentrl roller --config roller.yaml --queue tcp://learner:5555 --servers http://a:30000,http://b:30000

The roller needs its own section plus the env, inference and queue sections; each
component is built from its own section. SIGINT/SIGTERM stop admitting new groups and
let in-flight groups finish and be put, so no admitted work is lost.

The roller's identity is `roller.index` (else `$AGENTRL_ROLLER_INDEX`, else 0): its lease in
the queue is named `roller-<index>` and the ids (and task numbers) of the groups the queue
acknowledged go to
`<run_dir>/roller-<index>.groups` (metrics to `roller.jsonl`, as before). Its tasks come from the queue's
shared cursor (`tasks.TaskSource`). With `reward.url` set, episodes are also scored by that
`agentrl serve-reward`, which is checked (reachable, and of `reward.kind`) before the first
group. Exit codes: 0 when done or when the queue says the run is over; 1 when the queue is
unreachable, refuses it, goes silent, or too many groups failed, or the reward model is
unreachable or of the wrong kind at start; a ValueError (shown by the CLI as one line, exit 2) when
the env, its tasks or its prompts do not fit the config: the longest of the first tasks' prompts
must leave room for a turn within `roller.max_total_tokens` and the model's context (`rollers/env_check.py`).
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger

logger = get_logger(__name__)


def tokenizer_path(config: AgentRLConfig) -> str:
    """The roller's tokenizer: its own setting, else the served model, else the learner's model."""
    return config.roller.tokenizer_path or config.inference.model_path or config.learner.model_path


def roller_index(config: AgentRLConfig) -> int:
    """`roller.index`, else `$AGENTRL_ROLLER_INDEX` (set by `agentrl run`), else 0."""
    if config.roller.index is not None:
        return config.roller.index
    raw = os.environ.get("AGENTRL_ROLLER_INDEX", "0")
    if not raw.isdigit():
        raise ValueError(
            f"AGENTRL_ROLLER_INDEX={raw!r}: must be a non-negative integer (or set --roller.index)"
        )
    return int(raw)


def request_adapter(config: AgentRLConfig) -> str | None:
    """The adapter base the roller's requests name: `agentrl-lora` in a LoRA run pushing adapters
    (`learner.lora`, `weight_sync.lora_mode: adapter`) to servers that serve them by name (vLLM,
    SGLang), so each request names the newest served `agentrl-lora-v<N>` and its tokens are
    labelled N; None otherwise (the embedded server applies the pushed adapter to every request)."""
    from agentrl.inference.registry import adapter_base
    from agentrl.weight_sync.base import pushed_adapter

    adapter = pushed_adapter(config.learner.lora, config.weight_sync.lora_mode, config.learner.model_path)
    return adapter_base(config.inference, adapter)


async def run_roller(config: AgentRLConfig) -> int:
    from transformers import AutoTokenizer

    from agentrl.envs.base import live_services
    from agentrl.envs.registry import env_factory, task_env_class
    from agentrl.inference.router import from_config as create_router
    from agentrl.queue.registry import create as create_queue
    from agentrl.rewards.client import RewardModelClient, RewardModelError
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.env_check import model_context, require_budget
    from agentrl.rollers.roller import Roller
    from agentrl.rollers.tasks import TaskSource

    index = roller_index(config)
    name = f"roller-{index}"
    make_env = env_factory(config.env)
    env_cls = task_env_class(config.env)  # an agent env runs the tasks of the env it names
    tasks = TaskSource(config.roller.tasks, env_cls, config.roller.seed, **config.roller.task_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(config))
    renderer = ChatRenderer(tokenizer, make_env().tool_schemas or None)
    # before the first episode: a prompt that leaves no room for a turn is an error naming the budget
    context = model_context(tokenizer_path(config), config.inference.context_length)
    await require_budget(make_env, tasks, renderer, config.roller, context)
    reward_model = RewardModelClient(config.reward) if config.reward.url else None
    if reward_model is not None:
        try:
            info = await reward_model.check()
        except RewardModelError as exc:
            await reward_model.close()
            logger.error("%s", exc)
            return 1
        logger.info("reward model: %s (%s) at %s, weight %g", info.get("model_path"), info.get("kind"),
                    reward_model.url, config.reward.weight)  # fmt: skip
    # a router even over one server: requests wait out a server's restart (inference.server_wait_s)
    # and skip servers behind the admissible window: the run's max_staleness as the queue tells it
    # (this roller's own config until the queue's first reply)
    client = create_router(config.inference, config.max_staleness, request_adapter(config))
    backend = create_queue(config.queue)
    producer = backend.producer(name=name)
    producer.on_max_staleness = functools.partial(setattr, client, "max_staleness")
    producer.on_version = client.learner_version  # the window's top: the learner's version
    # the launcher's live list, carried by the queue (`inference.server_list.Follower`): the
    # servers for the router, the env services' URLs for new episodes and retriever-like clients
    producer.on_servers = client.set_servers
    producer.on_services = live_services.update
    metrics = MetricsLogger(config.run_dir, name="roller")
    groups_file = os.path.join(config.run_dir, f"{name}.groups")
    roller = Roller(
        config.roller, make_env, tasks, client, renderer, producer, metrics, groups_file, reward_model
    )

    endpoint = None
    if config.prometheus.roller_port is not None:
        from agentrl.observe.prometheus import RollerCollector, serve

        port = (
            config.prometheus.roller_port and config.prometheus.roller_port + index
        )  # 0 stays 0: a free port
        endpoint = serve(RollerCollector(roller), port, config.run_dir, name)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, roller.stop)
    logger.info(
        "%s: %s episodes × %d per group, servers %s, queue %s",
        name,
        config.env.name,
        config.roller.group_size,
        client.url,
        getattr(config.queue, "address", config.queue.type),
    )
    try:
        stats = await roller.run()
    finally:
        await client.close()
        if reward_model is not None:
            await reward_model.close()
        producer.close()
        metrics.close()
        if endpoint is not None:
            endpoint.stop()
    logger.info(
        "roller done: %d groups put, %d dropped (uniform reward), %d failed",
        stats.groups_put,
        stats.groups_dropped_uniform,
        stats.groups_failed,
    )
    if roller.fatal:
        logger.error("roller gave up: %s", roller.fatal)
        return 1
    if roller.finished:
        logger.info("roller exits: %s", roller.finished)
    return 0
