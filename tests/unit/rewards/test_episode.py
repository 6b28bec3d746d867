"""An episode scored by a served reward model (a real scorer app over the tiny classifier) against
a scripted SGLang server: reward = env reward + weight × score, placed on the last generated token,
greedy turns ask for temperature 0 / top-k 1, and a scorer that fails fails the episode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import RollerConfig
from agentrl.envs.base import Env
from agentrl.inference.sglang import SGLangClient
from agentrl.rewards.client import RewardModelClient, RewardModelError
from agentrl.rewards.config import RewardConfig
from agentrl.rewards.scorer import load_scorer
from agentrl.rewards.server import make_app
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer
from tests.conftest import find_free_port


class TwoTurnEnv(Env):
    """Turn 1 earns a step reward of 0.25 and gets an observation; turn 2 ends; final reward 1."""

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": task["question"]}]

    def step(self, action_text):
        self.turn += 1
        if self.turn == 1:
            return [{"role": "user", "content": "go on"}], 0.25, False, {}
        return None, 0.0, True, {}

    def reward(self, transcript):
        return 1.0


@pytest.fixture
async def policy(tiny_model: Path):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    server = ScriptedServer(
        lambda ids, params: Reply([*tok.encode("fine", add_special_tokens=False), tok.eos_token_id])
    )
    client = SGLangClient(await server.start())
    yield client, server, ChatRenderer(tok)
    await client.close()
    await server.stop()


async def test_the_reward_models_score_joins_the_final_reward(policy, tiny_rm, serve_app) -> None:
    client, server, renderer = policy
    scorer = load_scorer(str(tiny_rm), RewardConfig(batch_wait_ms=0))
    rm = RewardModelClient(RewardConfig(url=await serve_app(make_app(scorer)), weight=0.5))
    config = RollerConfig(max_turns=3, max_new_tokens=8)
    try:
        ep = await run_episode(TwoTurnEnv(), {"question": "hi?"}, client, renderer, config, rm)
        greedy = await run_episode(
            TwoTurnEnv(), {"question": "hi?"}, client, renderer, config, rm, greedy=True
        )
    finally:
        await rm.close()
    messages = [
        {"role": "user", "content": "hi?"}, {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "go on"}, {"role": "assistant", "content": "fine"},
    ]  # fmt: skip
    score = scorer.score(scorer.render([messages]))[0]
    assert ep.metrics["reward_model_score"] == pytest.approx(score, abs=1e-5)
    assert ep.metrics["rule_reward"] == 1.25 and ep.metrics["reward_model_s"] > 0
    assert ep.reward == pytest.approx(1.25 + 0.5 * score, abs=1e-5)
    # per turn: 0.25 on turn 1's last token, final + 0.5 × score on the episode's last generated one
    last = int(np.flatnonzero(ep.loss_mask)[-1])
    assert ep.reward_pos[-1] == last and ep.turn_rewards[-1] == pytest.approx(1 + 0.5 * score, abs=1e-5)
    assert float(ep.token_rewards().sum()) == pytest.approx(ep.reward, abs=1e-5)
    assert greedy.reward == pytest.approx(ep.reward, abs=1e-5)
    sampled, argmax = server.requests[0]["sampling_params"], server.requests[-1]["sampling_params"]
    assert (sampled["temperature"], sampled["top_k"]) == (1.0, -1)
    assert (argmax["temperature"], argmax["top_k"], argmax["top_p"]) == (0.0, 1, 1.0)


async def test_a_scorer_that_is_gone_fails_the_episode_naming_it(policy) -> None:
    client, _, renderer = policy
    url = f"http://127.0.0.1:{find_free_port()}"
    rm = RewardModelClient(RewardConfig(url=url, timeout_s=2, batch_wait_ms=0))
    try:
        with pytest.raises(RewardModelError, match=f"{url}/score: cannot reach it"):
            await run_episode(TwoTurnEnv(), {"question": "hi?"}, client, renderer, RollerConfig(), rm)
    finally:
        await rm.close()
