"""ReMax's greedy baseline on a real roller: the embedded server (tiny model), a real ZeroMQ queue.

ReMax (Li et al. 2023, arXiv 2310.10505, Algorithm 1): for each prompt x, sample y ~ π(·|x) and
decode ȳ greedily; the gradient weight of y is r(x, y) − r(x, ȳ). The roller runs the greedy
episode beside each group's sampled ones and sends its reward as `metrics["greedy_reward"]`; it
is not an episode of the group (not trained on)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.config import RollerConfig, ZmqQueueConfig
from agentrl.envs.base import Env, Transcript
from agentrl.inference.sglang import SGLangClient
from agentrl.learner.advantages import remax
from agentrl.queue.registry import create as create_queue
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.roller import Roller
from tests.conftest import find_free_port
from tests.unit.inference.conftest import ServerThread

TASKS = [{"id": f"t{i}", "question": f"Say something about the number {i}."} for i in range(2)]


class LengthEnv(Env):
    """One turn; the reward is the answer's length in characters / 10, so sampled episodes'
    rewards differ from each other and from the greedy one's."""

    def reset(self, task):
        return [{"role": "user", "content": task["question"]}]

    def step(self, action_text):
        return None, 0.0, True

    def reward(self, transcript: Transcript) -> float:
        return len(transcript.final_text) / 10


@pytest.fixture(scope="module")
def server(tiny_model: Path):
    srv = ServerThread(tiny_model).start()
    yield srv
    srv.stop()


async def test_each_group_carries_its_greedy_episodes_reward_as_the_remax_baseline(
    tiny_model, server
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    renderer = ChatRenderer(tokenizer)
    config = RollerConfig(
        group_size=4, max_groups=len(TASKS), max_turns=1, max_new_tokens=12, max_concurrent_episodes=10,
        log_every_s=60, greedy_baseline=True,
    )  # fmt: skip
    backend = create_queue(ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none"))
    queue = backend.server(groups_per_step=len(TASKS), max_staleness=1).start()
    consumer, producer = backend.consumer("rank0", server=queue), backend.producer()
    client = SGLangClient(server.url)
    try:
        roller = Roller(config, LengthEnv, iter(TASKS), client, renderer, producer)
        stats = await roller.run()
        batch = await asyncio.to_thread(consumer.get_batch, len(TASKS), 0, 1, 30)
        # the reference: the same task decoded greedily on its own, twice (greedy is deterministic)
        reference = {}
        for task in TASKS:
            runs = [
                await run_episode(LengthEnv(), task, client, renderer, config, greedy=True) for _ in range(2)
            ]
            assert runs[0].tokens.tolist() == runs[1].tokens.tolist()
            reference[task["id"]] = runs[0]
    finally:
        await client.close()
        producer.close()
        consumer.close()
        queue.stop()

    assert stats.groups_put == len(TASKS) and stats.greedy_episodes == len(TASKS)
    assert stats.episodes == len(TASKS) * config.group_size  # the greedy episodes are not the group's
    groups = sorted(batch.groups, key=lambda g: g.prompt_id)
    assert [g.prompt_id for g in groups] == [t["id"] for t in TASKS]
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    sampled_rewards, greedy_rewards = [], []
    for group in groups:
        assert len(group.episodes) == config.group_size
        greedy = reference[group.prompt_id]
        assert group.metrics["greedy_reward"] == greedy.reward
        # the greedy episode took the argmax at every step (checked by a direct HF forward)
        gen = np.flatnonzero(greedy.loss_mask)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(greedy.tokens[None], dtype=torch.long)).logits[0]
        assert gen.size and logits[gen - 1].argmax(-1).tolist() == greedy.tokens[gen].tolist()
        sampled_rewards.append(group.rewards)
        greedy_rewards.append(group.metrics["greedy_reward"])
    # sampled episodes differ from the greedy one (else the baseline would prove nothing)
    assert any(len({*r.tolist(), b}) > 1 for r, b in zip(sampled_rewards, greedy_rewards, strict=True))
    # the learner's estimator on what the roller sent equals Algorithm 1's r(x, y) − r(x, ȳ)
    advantages = remax(sampled_rewards, greedy_rewards)
    for adv, group in zip(advantages, groups, strict=True):
        by_hand = [ep.reward - group.metrics["greedy_reward"] for ep in group.episodes]
        assert adv.tolist() == pytest.approx(by_hand, abs=1e-12)
