"""One SWE episode token by token: the agent loop, a real HTTP server scripting SGLang's answers
(the gold fix, then submit), SWEEnv in a real bubblewrap sandbox, graded in a fresh one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import EnvConfig, RollerConfig
from agentrl.envs.registry import env_factory
from agentrl.envs.swe.env import SWEEnv
from agentrl.inference.sglang import SGLangClient
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer, render_conversation
from tests.unit.envs.sandbox.conftest import needs_bwrap

pytestmark = [pytest.mark.slow, needs_bwrap]
ENV = EnvConfig(name="swe", sandbox={"type": "local", "python_packages": ["pytest"], "memory_mb": 512})


async def test_scripted_gold_episode_earns_1_with_exact_tokens_and_masks(
    tiny_model: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    task = SWEEnv.generate_tasks(1, seed=11, out_dir=str(tmp_path))[0]
    make_env = env_factory(ENV)
    demo = make_env().demonstrate(task)
    turns = [m["content"] for m in demo if m["role"] == "assistant"]
    outputs = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id] for t in turns]
    served = iter(outputs)

    server = ScriptedServer(lambda ids, params: Reply(next(served)))
    url = await server.start()
    client = SGLangClient(url)
    env = make_env()
    renderer = ChatRenderer(tokenizer, env.tool_schemas)
    try:
        config = RollerConfig(max_turns=8, max_new_tokens=512, max_total_tokens=4096)
        episode = await run_episode(env, task, client, renderer, config)
    finally:
        await client.close()
        await server.stop()

    assert episode.finish_reason == "done" and episode.num_turns == len(turns)
    assert episode.reward == 1.0
    m = episode.metrics
    assert m["submitted"] == 1 and m["hit_limit"] == 0 and m["resolved"] == 1 and m["tool_errors"] == 0
    assert m["isolation"] == "bwrap" and env.sandbox is None  # closed by the loop

    # the episode is the chat template's render of the demonstration, token for token
    full = tokenizer.apply_chat_template(demo, tools=env.tool_schemas, tokenize=False)
    expected = tokenizer.encode(full, add_special_tokens=False)
    assert list(episode.tokens) == expected[: len(episode.tokens)]
    assert len(expected) - len(episode.tokens) <= 2  # only the template's closing "<|im_end|>\n"
    assert renderer.consistent_with_full_render(list(episode.tokens), demo)

    # loss mask: exactly the scripted generations are trained on
    generated = episode.tokens[episode.loss_mask.astype(bool)].tolist()
    assert generated == [t for out in outputs for t in out]
    starts = [len(r["input_ids"]) for r in server.requests]
    for start, out in zip(starts, outputs, strict=True):
        assert episode.loss_mask[start : start + len(out)].all()
        assert episode.tokens[start : start + len(out)].tolist() == out
    assert not episode.loss_mask[: starts[0]].any()
    gen = episode.loss_mask.astype(bool)
    assert np.all(episode.versions[~gen] == -1) and np.all(episode.logprobs[gen] == -0.5)

    # the warm start trains on exactly this layout: the demonstration rendered for supervised
    # learning is the episode the agent loop built, token for token and mask for mask
    ids, mask = render_conversation(renderer, demo)
    assert ids == episode.tokens.tolist() and mask == episode.loss_mask.tolist()


async def test_an_episode_cut_by_the_turn_limit_is_flagged(tiny_model: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    task = SWEEnv.generate_tasks(1, seed=12, out_dir=str(tmp_path))[0]
    explore = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -R"}}\n</tool_call>'
    reply = [*tokenizer.encode(explore, add_special_tokens=False), tokenizer.eos_token_id]
    server = ScriptedServer(lambda ids, params: Reply(reply))
    client = SGLangClient(await server.start())
    env = env_factory(ENV)()
    try:
        config = RollerConfig(max_turns=3, max_new_tokens=128, max_total_tokens=4096)
        episode = await run_episode(env, task, client, ChatRenderer(tokenizer, env.tool_schemas), config)
    finally:
        await client.close()
        await server.stop()
    assert episode.finish_reason == "max_turns" and episode.num_turns == 3
    m = episode.metrics
    assert m["hit_limit"] == 1 and m["submitted"] == 0 and m["steps"] == 3 and m["tool_calls"] == 3
    assert episode.reward == 0.0 and m["patch_lines"] == 0 and env.sandbox is None
