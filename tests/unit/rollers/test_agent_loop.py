"""The agent loop, token by token, against a real HTTP server that scripts SGLang answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import RollerConfig
from agentrl.envs.base import Env
from agentrl.envs.toy import CalculatorEnv
from agentrl.inference.sglang import SGLangClient
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer

TASK = {"id": "t1", "question": "What is 347 * 29?", "expression": "347 * 29", "answer": "10063"}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n</tool_call>'


@pytest.fixture
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


class Turns:
    """Scripts turn i's reply; an optional abort splits a turn in two requests."""

    def __init__(self, tokenizer, texts: list[str], abort_first_after: int | None = None) -> None:
        eos = tokenizer.eos_token_id
        self.outputs = [[*tokenizer.encode(t, add_special_tokens=False), eos] for t in texts]
        self.abort_after = abort_first_after
        self.turn = 0
        self.pending: list[int] | None = None

    def __call__(self, ids: list[int], params: dict) -> Reply:
        if self.pending is not None:  # the resumed half of an aborted turn, under new weights
            rest, self.pending = self.pending, None
            self.turn += 1
            return Reply(rest, logprobs=[-0.25] * len(rest), weight_version=1)
        out = self.outputs[self.turn]
        if self.abort_after is not None and self.turn == 0:
            self.pending = out[self.abort_after :]
            return Reply(out[: self.abort_after], finish="abort", weight_version=0)
        self.turn += 1
        return Reply(out, logprobs=[-0.5] * len(out), weight_version=0 if self.abort_after is None else 1)


async def _run(tokenizer, script, env=None, config=None):
    server = ScriptedServer(script)
    url = await server.start()
    client = SGLangClient(url)
    env = env or CalculatorEnv()
    renderer = ChatRenderer(tokenizer, env.tool_schemas)
    try:
        episode = await run_episode(env, TASK, client, renderer, config or RollerConfig(max_turns=4))
    finally:
        await client.close()
        await server.stop()
    return episode, server, renderer


async def test_tool_episode_is_exact_token_by_token(tokenizer) -> None:
    script = Turns(tokenizer, [CALL, "10063"])
    episode, server, renderer = await _run(tokenizer, script)
    env = CalculatorEnv()
    messages = [
        *env.prompt(TASK),
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "10063"},
        {"role": "assistant", "content": "10063"},
    ]
    full = tokenizer.apply_chat_template(messages, tools=env.tool_schemas, tokenize=False)
    expected = tokenizer.encode(full, add_special_tokens=False)
    # the full render ends with "<|im_end|>\n"; the episode stops right after the model's <|im_end|>
    assert list(episode.tokens) == expected[:-1]
    assert renderer.consistent_with_full_render(list(episode.tokens), messages)

    prompt = renderer.prompt_ids(env.prompt(TASK))
    gen1, gen2 = script.outputs
    n_obs = len(episode.tokens) - len(prompt) - len(gen1) - len(gen2)
    mask = [0] * len(prompt) + [1] * len(gen1) + [0] * n_obs + [1] * len(gen2)
    assert episode.loss_mask.tolist() == mask
    gen = episode.loss_mask.astype(bool)
    assert np.all(episode.logprobs[gen] == -0.5) and np.all(episode.logprobs[~gen] == 0)
    assert np.all(episode.versions[gen] == 0) and np.all(episode.versions[~gen] == -1)
    assert episode.reward == 1.0 and episode.num_turns == 2 and episode.finish_reason == "done"
    assert episode.metrics["tool_calls"] == 1 and episode.metrics["tool_errors"] == 0
    # token-in: the second request is exactly the ids so far, never re-tokenized text
    assert server.requests[1]["input_ids"] == list(episode.tokens[: len(prompt) + len(gen1) + n_obs])


async def test_aborted_generation_resumes_with_new_version_tags(tokenizer) -> None:
    script = Turns(tokenizer, [CALL, "10063"], abort_first_after=5)
    episode, server, renderer = await _run(tokenizer, script)
    prompt_len = len(renderer.prompt_ids(CalculatorEnv().prompt(TASK)))
    first_turn = script.outputs[0]
    # request 2 resubmits prompt + the 5 tokens generated before the abort
    assert server.requests[1]["input_ids"] == list(episode.tokens[: prompt_len + 5])
    assert server.requests[1]["sampling_params"]["max_new_tokens"] == RollerConfig().max_new_tokens - 5
    turn = slice(prompt_len, prompt_len + len(first_turn))
    assert episode.tokens[turn].tolist() == first_turn
    assert episode.versions[turn].tolist() == [0] * 5 + [1] * (len(first_turn) - 5)
    assert episode.logprobs[turn].tolist() == [-0.5] * 5 + [-0.25] * (len(first_turn) - 5)
    assert episode.metrics["resumed_generations"] == 1
    assert episode.reward == 1.0


async def test_malformed_tool_call_is_an_observation_not_a_crash(tokenizer) -> None:
    script = Turns(
        tokenizer,
        ["<tool_call>{broken json</tool_call>", '<tool_call>{"name": "nope"}</tool_call>', "I give up"],
    )
    episode, _, _ = await _run(tokenizer, script)
    assert episode.finish_reason == "done" and episode.num_turns == 3
    assert episode.metrics["tool_errors"] == 2 and episode.reward == 0.0
    text = tokenizer.decode(episode.tokens.tolist())
    assert "invalid JSON" in text and "unknown tool 'nope'" in text


async def test_limits_end_episodes_with_a_reason(tokenizer) -> None:
    loop_forever = Turns(tokenizer, [CALL] * 10)
    episode, _, _ = await _run(tokenizer, loop_forever, config=RollerConfig(max_turns=3))
    assert episode.finish_reason == "max_turns" and episode.num_turns == 3

    cut = lambda ids, params: Reply([300] * params["max_new_tokens"], finish="length")  # noqa: E731
    episode, _, _ = await _run(tokenizer, cut, config=RollerConfig(max_new_tokens=7))
    assert episode.finish_reason == "length" and episode.num_generated == 7

    context = Turns(tokenizer, [CALL] * 10)
    episode, _, _ = await _run(tokenizer, context, config=RollerConfig(max_turns=10, max_total_tokens=400))
    assert episode.finish_reason == "context"
    # every request respected the remaining context budget
    assert episode.num_tokens <= 400 + 200  # the last observation may overshoot; generation never does

    slow = lambda ids, params: Reply([300, 2], delay_s=5)  # noqa: E731
    episode, _, _ = await _run(tokenizer, slow, config=RollerConfig(episode_timeout_s=0.3))
    assert episode.finish_reason == "timeout" and episode.num_generated == 0


class Continuation(Env):
    """A Search-R1-style env: observations are raw text inside the same assistant turn."""

    stop = ("</search>",)

    def reset(self, task):
        return [{"role": "user", "content": task["question"]}]

    def step(self, action_text):
        if "<search>" in action_text:
            return "\n\n<information>Doc 1(Title: Math) 347 * 29 = 10063</information>\n\n", 0.0, False, {}
        return None, 0.0, True, {}

    def reward(self, transcript):
        return float("10063" in transcript.final_text)


async def test_raw_text_observations_continue_the_turn(tokenizer) -> None:
    search = tokenizer.encode("<search> 347 * 29 </search>", add_special_tokens=False)
    answer = [*tokenizer.encode("<answer> 10063 </answer>", add_special_tokens=False), tokenizer.eos_token_id]
    replies = iter([Reply(search), Reply(answer)])
    seen_stop = []

    def script(ids, params):
        seen_stop.append(params.get("stop"))
        return next(replies)

    episode, _server, renderer = await _run(tokenizer, script, env=Continuation())
    info = tokenizer.encode(
        "\n\n<information>Doc 1(Title: Math) 347 * 29 = 10063</information>\n\n", add_special_tokens=False
    )
    prompt = renderer.prompt_ids([{"role": "user", "content": TASK["question"]}])
    assert episode.tokens.tolist() == prompt + search + info + answer
    assert episode.loss_mask.tolist() == [0] * len(prompt) + [1] * len(search) + [0] * len(info) + [1] * len(
        answer
    )
    assert seen_stop == [["</search>"], ["</search>"]]
    assert episode.reward == 1.0


async def test_env_close_runs_even_when_the_server_fails(tokenizer) -> None:
    closed = asyncio.Event()

    class Closing(CalculatorEnv):
        def close(self):
            closed.set()

    client = SGLangClient("http://127.0.0.1:9", timeout_s=2, connect_timeout_s=1)
    env = Closing()
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):
        await run_episode(env, TASK, client, ChatRenderer(tokenizer, env.tool_schemas), RollerConfig())
    await client.close()
    assert closed.is_set()


async def test_demonstrations_render_exactly_like_sampled_episodes(tokenizer) -> None:
    from agentrl.rollers.chat import render_conversation

    script = Turns(tokenizer, [CALL, "10063"])
    episode, _, renderer = await _run(tokenizer, script)
    ids, mask = render_conversation(renderer, CalculatorEnv().demonstrate(TASK))
    assert ids == episode.tokens.tolist()
    assert mask == episode.loss_mask.tolist()


@pytest.mark.parametrize(
    "content",
    [
        "42",
        "",
        "line1\nline2\n",
        "\u2063slot0\u2063 and \u2063slot1\u2063",
        "{{ messages }} {% if x %}",
        "  padded  ",
    ],
)
def test_cached_observation_layout_matches_a_full_render(tokenizer, content: str) -> None:
    renderer = ChatRenderer(tokenizer, CalculatorEnv().tool_schemas)
    messages = [{"role": "tool", "name": "calculator", "content": content}, {"role": "tool", "content": "x"}]
    assert renderer.observation_text(messages) == renderer._render_delta(messages)
    assert isinstance(renderer._layouts[next(iter(renderer._layouts))], list)  # the fast path was taken
    user = [{"role": "user", "content": content}]
    assert renderer.observation_text(user) == renderer._render_delta(user)


async def test_tag_protocol_demonstrations_render_like_sampled_episodes(tokenizer) -> None:
    from agentrl.envs.toy import LookupEnv
    from agentrl.rollers.chat import render_conversation

    task = LookupEnv.generate_tasks(1, seed=3)[0]
    look = tokenizer.encode(f"<lookup> {task['animal']} </lookup>", add_special_tokens=False)
    answer = tokenizer.encode(f" <answer> {task['answer']} </answer>", add_special_tokens=False)
    replies = iter([Reply(look), Reply(answer)])  # stopped by the env's stop strings, no end-of-turn token
    server = ScriptedServer(lambda ids, params: next(replies))
    client = SGLangClient(await server.start())
    env = LookupEnv()
    try:
        episode = await run_episode(env, task, client, ChatRenderer(tokenizer, None), RollerConfig())
    finally:
        await client.close()
        await server.stop()
    assert episode.reward == 1.0 and episode.finish_reason == "done"
    ids, mask = render_conversation(ChatRenderer(tokenizer, None), LookupEnv().demonstrate(task))
    assert ids == episode.tokens.tolist()
    assert mask == episode.loss_mask.tolist()
