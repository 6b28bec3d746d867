"""The roller against a scripted SGLang server and a real ZeroMQ TransferQueue."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import EnvConfig, InferenceConfig, RollerConfig, ZmqQueueConfig
from agentrl.envs.registry import env_factory
from agentrl.envs.toy import CalculatorEnv, safe_eval
from agentrl.inference.router import from_config
from agentrl.inference.sglang import SGLangClient
from agentrl.queue.registry import create as create_queue
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.roller import Roller
from agentrl.rollers.tasks import read_task_file, task_stream
from tests.conftest import find_free_port
from tests.unit.inference.conftest import ServerThread


class CalculatorPolicy:
    """Scripted 'model': calls the calculator on the question, then answers with the tool's result
    (or, when `wrong`, with a wrong number). The server's weight version plays the learner's."""

    def __init__(self, tokenizer, wrong: bool = False) -> None:
        self.tok = tokenizer
        self.wrong = wrong

    def __call__(self, ids: list[int], params: dict) -> Reply:
        text = self.tok.decode(ids)
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
        if responses:
            answer = "0" if self.wrong else responses[-1]
            out = answer
        else:
            expression = re.findall(r"What is (.*?)\?", text)[-1]
            out = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
        return Reply([*self.tok.encode(out, add_special_tokens=False), self.tok.eos_token_id])


@pytest.fixture
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


async def _setup(
    tokenizer, groups_per_step: int, max_staleness: int, wrong: bool = False, client=None, **roller_kwargs
):
    """`client`: generate through it instead of a client of the scripted server."""
    server = ScriptedServer(CalculatorPolicy(tokenizer, wrong))
    url = await server.start()
    qcfg = ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none")
    backend = create_queue(qcfg)
    queue = backend.server(groups_per_step=groups_per_step, max_staleness=max_staleness).start()
    consumer = backend.consumer("rank0", server=queue)
    producer = backend.producer()
    make_env = env_factory(EnvConfig(name="toy_calculator"))
    config = RollerConfig(group_size=3, max_concurrent_episodes=12, **{"log_every_s": 60, **roller_kwargs})
    tasks = task_stream("builtin", CalculatorEnv, seed=0)
    client = client or SGLangClient(url)
    roller = Roller(
        config, make_env, tasks, client, ChatRenderer(tokenizer, make_env().tool_schemas), producer
    )

    async def close() -> None:
        await client.close()
        producer.close()
        consumer.close()
        queue.stop()
        await server.stop()

    return server, roller, consumer, close


async def test_groups_arrive_whole_and_exact(tokenizer) -> None:
    _server, roller, consumer, close = await _setup(
        tokenizer, groups_per_step=4, max_staleness=1, max_groups=4
    )
    try:
        stats = await roller.run()
        batch = await asyncio.to_thread(consumer.get_batch, 4, 0, 1, 10)
    finally:
        await close()
    assert stats.groups_put == 4 and stats.episodes == 12 and stats.groups_failed == 0
    assert len(batch.groups) == 4 and len({g.group_id for g in batch.groups}) == 4
    for group in batch.groups:
        assert len(group.episodes) == 3  # a GRPO group is never split
        assert len({e.tokens.tobytes() for e in group.episodes}) == 1  # deterministic scripted policy
        for ep in group.episodes:
            assert ep.reward == 1.0 and ep.finish_reason == "done" and ep.num_turns == 2
            gen = ep.loss_mask.astype(bool)
            assert np.all(ep.versions[gen] == 0) and np.all(ep.versions[~gen] == -1)
            assert np.all(ep.logprobs[gen] == -0.5)


async def test_admission_keeps_staleness_within_k_as_the_learner_advances(tokenizer) -> None:
    groups_per_step, k, steps = 2, 1, 5
    server, roller, consumer, close = await _setup(
        tokenizer, groups_per_step=groups_per_step, max_staleness=k
    )
    run = asyncio.create_task(roller.run())
    admitted_at: list[int] = []
    try:
        for version in range(steps):
            batch = await asyncio.to_thread(consumer.get_batch, groups_per_step, version, k, 30)
            assert batch.dropped_stale == 0
            assert all(s <= k for s in batch.staleness), batch.staleness
            assert all(g.is_admissible(version, k) for g in batch.groups)
            admitted_at += [g.metrics["admitted_version"] for g in batch.groups]
            consumer.ack(batch.group_ids)
            # the learner steps: new weights reach the server, the new version is published
            server.weight_version = version + 1
            consumer.publish_version(version + 1)
        roller.stop()
        await asyncio.wait_for(run, 30)
    finally:
        roller.stop()
        await close()
    # at most (v + k + 1) × groups_per_step groups were ever started while the learner was at v
    for i, v in enumerate(sorted(admitted_at)):
        assert i + 1 <= (v + k + 1) * groups_per_step


async def test_dynamic_sampling_drops_uniform_groups_and_gives_admission_back(tokenizer) -> None:
    _server, roller, _consumer, close = await _setup(
        tokenizer,
        groups_per_step=1,
        max_staleness=0,
        wrong=True,
        max_groups=3,
        drop_uniform_reward_groups=True,
    )
    run = asyncio.create_task(roller.run())
    try:
        for _ in range(200):
            if roller.stats.groups_dropped_uniform >= 3:
                break
            await asyncio.sleep(0.05)
        roller.stop()
        await asyncio.wait_for(run, 30)
    finally:
        await close()
    # with k=0 and one group per step only one group could ever be admitted at version 0,
    # unless dropped groups return their admission: three were dropped, so it was returned
    assert roller.stats.groups_dropped_uniform >= 3 and roller.stats.groups_put == 0


async def test_failed_groups_are_counted_and_release_admission(tokenizer) -> None:
    server, roller, _consumer, close = await _setup(
        tokenizer, groups_per_step=1, max_staleness=0, max_groups=1
    )
    server.script = lambda ids, params: Reply(
        [], finish="stop", logprobs=[0.0]
    )  # malformed: 0 ids, 1 logprob
    run = asyncio.create_task(roller.run())
    try:
        for _ in range(200):
            if roller.stats.groups_failed >= 2:
                break
            await asyncio.sleep(0.05)
        roller.stop()
        await asyncio.wait_for(run, 30)
    finally:
        await close()
    assert roller.stats.groups_failed >= 2 and roller.stats.groups_put == 0


def test_task_files(tmp_path: Path) -> None:
    good = tmp_path / "tasks.jsonl"
    good.write_text(
        '{"id": 1, "question": "a", "answer": "1"}\n\n{"id": 2, "question": "b", "answer": "2"}\n'
    )
    stream = task_stream(str(good), CalculatorEnv, seed=0)
    assert sorted(next(stream)["id"] for _ in range(2)) == [1, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        read_task_file(bad)
    with pytest.raises(ValueError, match="file not found"):
        read_task_file(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="task_kwargs"):
        next(task_stream(str(good), CalculatorEnv, seed=0, digits=2))
    generated = task_stream("builtin", CalculatorEnv, seed=1, digits=2)
    first = [next(generated) for _ in range(5)]
    assert all(str(safe_eval(t["expression"])) == t["answer"] for t in first)


async def test_roller_gives_up_after_too_many_failures_in_a_row(tokenizer) -> None:
    server, roller, _consumer, close = await _setup(
        tokenizer, groups_per_step=1, max_staleness=0, max_consecutive_failures=3
    )
    server.script = lambda ids, params: Reply([], finish="stop", logprobs=[0.0])  # always malformed
    try:
        stats = await asyncio.wait_for(roller.run(), 60)  # returns by itself
    finally:
        await close()
    assert stats.groups_failed >= 3 and roller.fatal.startswith("3 groups in a row failed")


async def test_an_engine_error_fails_the_group_with_the_servers_message(tokenizer, tiny_model: Path) -> None:
    """A server whose engine fails every request (NaN weights): the roller's request is lost with the
    server's own error after the router's retries — not resubmitted as an abort until the episode
    times out — and its group fails, counted."""
    nan_server = ServerThread(tiny_model)
    with torch.no_grad():
        for p in nan_server.engine.model.parameters():
            p.fill_(float("nan"))
    nan_server.start()
    inference = InferenceConfig(
        servers=[nan_server.url], max_retries=1, server_wait_s=2, request_timeout_s=120
    )
    _server, roller, _consumer, close = await _setup(
        tokenizer, groups_per_step=1, max_staleness=0, client=from_config(inference),
        max_consecutive_failures=1, episode_timeout_s=600,
    )  # fmt: skip
    try:
        stats = await asyncio.wait_for(roller.run(), 120)  # returns by itself: one failed group is fatal
    finally:
        await close()
        nan_server.stop()
    assert stats.groups_failed >= 1 and stats.groups_put == 0 and stats.episodes == 0
    assert re.search(r"request lost after \d failure\(s\).*HTTP 500.*logits are NaN", roller.fatal), (
        roller.fatal
    )
    assert "Timeout" not in roller.fatal
    router = roller.client.stats  # reported as roller/server_errors and roller/requests_lost
    assert router["server_errors"] >= 2 and router["lost"] >= 1


async def test_a_group_that_generated_nothing_is_counted_and_said_why(tokenizer, caplog, monkeypatch) -> None:
    monkeypatch.setattr(logging.getLogger("agentrl"), "propagate", True)
    # the calculator's prompt (system prompt and tool schema) is longer than 32 tokens
    _server, roller, consumer, close = await _setup(
        tokenizer, groups_per_step=1, max_staleness=0, max_groups=1, max_total_tokens=32
    )
    try:
        with caplog.at_level("WARNING", logger="agentrl.rollers.roller"):
            stats = await asyncio.wait_for(roller.run(), 60)
        group = consumer.get_batch(1, 0, 0, timeout_s=10).groups[0]
    finally:
        await close()
    assert stats.groups_no_generation == 1 and stats.no_generation == {"prompt too long": 3}
    assert all(ep.num_generated == 0 and ep.finish_reason == "context" for ep in group.episodes)
    said = " ".join(r.getMessage() for r in caplog.records)
    prompt = group.episodes[0].metrics["prompt_tokens"]
    assert f"generated no token (1 such groups): prompt too long ×3; its prompt is {prompt} tokens" in said
    assert "roller.max_total_tokens 32" in said


async def test_a_roller_without_a_learner_says_it_waits_for_the_learner(
    tokenizer, caplog, monkeypatch
) -> None:
    monkeypatch.setattr(logging.getLogger("agentrl"), "propagate", True)
    # groups_per_step 1 at max_staleness 0: one group is admitted, the next waits for version 1
    _server, roller, _consumer, close = await _setup(
        tokenizer, groups_per_step=1, max_staleness=0, log_every_s=0.2
    )
    try:
        with caplog.at_level("INFO", logger="agentrl.rollers.roller"):
            run = asyncio.create_task(roller.run())
            for _ in range(100):
                await asyncio.sleep(0.1)
                if any("waiting for the learner" in r.getMessage() for r in caplog.records):
                    break
            roller.stop()
            await asyncio.wait_for(run, 30)
    finally:
        await close()
    said = [r.getMessage() for r in caplog.records if "waiting for the learner" in r.getMessage()]
    assert said and "1 started, learner at version 0" in said[0] and "agentrl learner" in said[0]
