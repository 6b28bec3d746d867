"""Per-turn rewards: the agent loop keeps each env step's reward on the last generated token of
its turn (the final reward on the episode's last generated token), and the placement survives
the real TransferQueue (ZeroMQ over loopback TCP, MAC on) into the learner's token rewards."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.config import ZmqQueueConfig
from agentrl.envs.toy import CalculatorEnv
from agentrl.queue import create
from agentrl.types import Group
from tests.unit.queue.conftest import SECRET, put_all
from tests.unit.rollers.test_agent_loop import CALL, Turns, _run


@pytest.fixture
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


async def _stepped_episode(tokenizer):
    from agentrl.envs.base import as_step_result, resolve

    class Env(CalculatorEnv):
        async def step(self, action_text):
            step = as_step_result(await resolve(super().step(action_text)))
            return step._replace(reward=0.5 if step.done else 0.25)

    return await _run(tokenizer, Turns(tokenizer, [CALL, CALL, "10063"]), env=Env())


def _turn_ends(mask: np.ndarray) -> list[int]:
    """Indices of the last token of each run of generated tokens."""
    return [i for i in range(len(mask)) if mask[i] == 1 and (i + 1 == len(mask) or mask[i + 1] == 0)]


async def test_step_rewards_sit_on_the_last_token_of_their_turn(tokenizer) -> None:
    episode, _, _ = await _stepped_episode(tokenizer)
    assert episode.num_turns == 3 and episode.finish_reason == "done"
    ends = _turn_ends(episode.loss_mask)
    assert len(ends) == 3
    assert episode.reward_pos.tolist() == ends
    # steps 0.25, 0.25, 0.5; the outcome reward 1.0 (right answer) joins the last turn's step reward
    np.testing.assert_allclose(episode.turn_rewards, [0.25, 0.25, 1.5])
    assert episode.reward == pytest.approx(2.0)  # outcome-only estimators still see the total
    dense = episode.token_rewards()
    assert dense.sum() == pytest.approx(2.0) and np.flatnonzero(dense).tolist() == ends


async def test_per_turn_rewards_round_trip_through_the_zmq_queue(tokenizer, monkeypatch) -> None:
    monkeypatch.setenv("AGENTRL_QUEUE_SECRET", SECRET)
    stepped, _, _ = await _stepped_episode(tokenizer)
    outcome_only = stepped.__class__(stepped.tokens, stepped.loss_mask, stepped.logprobs, stepped.versions,
                                     reward=1.0)  # fmt: skip
    group = Group([stepped, outcome_only], prompt_id="calc")
    backend = create(ZmqQueueConfig(address="tcp://127.0.0.1:*"))
    server = backend.server(groups_per_step=1, max_staleness=1).start()
    try:
        await _put(backend, server.endpoint, group)
        consumer = backend.consumer("rank0", address=server.endpoint)
        try:
            (got,) = consumer.get_batch(1, learner_version=0, max_staleness=1, timeout_s=30).groups
        finally:
            consumer.close()
    finally:
        server.stop()
    a, b = got.episodes
    assert a.reward_pos.tolist() == stepped.reward_pos.tolist() == _turn_ends(a.loss_mask)
    np.testing.assert_array_equal(a.turn_rewards, stepped.turn_rewards)
    np.testing.assert_array_equal(a.token_rewards(), stepped.token_rewards())
    assert b.reward_pos.size == 0  # no per-turn rewards: the outcome sits on the last generated token
    assert np.flatnonzero(b.token_rewards()).tolist() == [_turn_ends(b.loss_mask)[-1]]


async def _put(backend, address: str, group: Group) -> None:
    import asyncio

    await asyncio.to_thread(put_all, lambda: backend.producer(address=address), [group])
