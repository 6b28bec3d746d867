"""SearchR1Env token by token: scripted SGLang server, real retriever server, real agent loop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import EnvConfig, RollerConfig
from agentrl.envs.registry import env_factory
from agentrl.envs.search.client import RetrieverClient
from agentrl.envs.search.env import CORRECTION, PROMPT_TEMPLATE, SearchR1Env, SearchToolEnv, information_block
from agentrl.envs.search.retriever import BM25Retriever
from agentrl.envs.search.server import RetrieverServer
from agentrl.inference.sglang import SGLangClient
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer

DOCS = [
    {"id": "0", "contents": '"Quorvel Guild"\nThe Quorvel Guild was founded by Dravo Kelmir in 1811.'},
    {"id": "1", "contents": '"Dravo Kelmir"\nDravo Kelmir was a luthier born in Sulketra.'},
    {"id": "2", "contents": '"Sulketra"\nSulketra is a small town known for its orchards.'},
]
TASK = {
    "id": "q1",
    "question": "Who founded the Quorvel Guild?",
    "golden_answers": ["Dravo Kelmir"],
    "data_source": "t",
}


@pytest.fixture
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture
async def retriever_url(tmp_path: Path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    server = RetrieverServer(BM25Retriever(corpus))
    url = await server.start()
    yield f"{url}/retrieve"
    await server.stop()


def _ids(tokenizer, text: str, eos: bool = False) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


async def _run(tokenizer, turns: list[list[int]], env, task=TASK, max_turns: int = 6):
    replies = iter(turns)
    stops = []

    def script(ids, params):
        stops.append(params.get("stop"))
        return Reply(next(replies))

    server = ScriptedServer(script)
    client = SGLangClient(await server.start())
    renderer = ChatRenderer(tokenizer, env.tool_schemas or None)
    try:
        episode = await run_episode(env, task, client, renderer, RollerConfig(max_turns=max_turns))
    finally:
        await client.close()
        await server.stop()
    return episode, renderer, stops


async def test_search_then_answer_token_by_token(tokenizer, retriever_url: str) -> None:
    search = _ids(tokenizer, "<think>I need to look it up.</think>\n<search> Quorvel Guild Kelmir </search>")
    answer = _ids(tokenizer, "<think>Doc 1 says it.</think>\n<answer> Dravo Kelmir </answer>", eos=True)
    env = SearchR1Env(retriever_url=retriever_url, topk=2)
    episode, renderer, stops = await _run(tokenizer, [search, answer], env)

    client = RetrieverClient(retriever_url, topk=2)
    hits = (await client.search(["Quorvel Guild Kelmir"]))[0]
    await client.close()
    info_text = information_block(hits)
    assert info_text.startswith(
        '\n\n<information>Doc 1(Title: "Quorvel Guild") The Quorvel Guild was founded'
    )
    assert "Doc 2(Title: " in info_text and info_text.endswith("</information>\n\n")
    info = renderer.encode(info_text)
    prompt = renderer.prompt_ids(
        [{"role": "user", "content": PROMPT_TEMPLATE.format(question=TASK["question"])}]
    )

    assert episode.tokens.tolist() == prompt + search + info + answer
    mask = [0] * len(prompt) + [1] * len(search) + [0] * len(info) + [1] * len(answer)
    assert episode.loss_mask.tolist() == mask  # retrieved text is never trained on
    gen = episode.loss_mask.astype(bool)
    assert np.all(episode.versions[~gen] == -1) and np.all(episode.logprobs[~gen] == 0)
    assert stops == [["</search>", "</answer>"]] * 2
    assert episode.reward == 1.0 and episode.finish_reason == "done" and episode.num_turns == 2
    m = episode.metrics
    assert (m["search_calls"], m["tool_calls"], m["em"], m["answered"], m["format_ok"]) == (1, 1, 1.0, 1, 1)
    assert m["data_source"] == "t"


async def test_invalid_action_gets_the_corrective_message(tokenizer, retriever_url: str) -> None:
    rambling = _ids(tokenizer, "I think it was somebody famous.")
    wrong = _ids(tokenizer, "<answer> Sulketra </answer>", eos=True)
    episode, renderer, _ = await _run(tokenizer, [rambling, wrong], SearchR1Env(retriever_url=retriever_url))
    correction = renderer.encode(CORRECTION)
    start = episode.tokens.tolist().index(rambling[0], int(episode.metrics["prompt_tokens"]))
    block = slice(start + len(rambling), start + len(rambling) + len(correction))
    assert episode.tokens[block].tolist() == correction and not episode.loss_mask[block].any()
    assert "<search>" in CORRECTION and "</answer>" in CORRECTION
    assert episode.reward == 0.0 and episode.metrics["invalid_actions"] == 1 and episode.metrics["em"] == 0.0


async def test_after_max_turns_the_last_turn_is_answer_only(tokenizer, retriever_url: str) -> None:
    search = _ids(tokenizer, "<search> Dravo Kelmir </search>")
    env = SearchR1Env(retriever_url=retriever_url, max_turns=2)
    episode, _, _ = await _run(tokenizer, [search] * 5, env)
    # two searched turns, then a third whose search is not run: the episode ends there
    assert episode.num_turns == 3 and episode.finish_reason == "done"
    assert episode.metrics["search_calls"] == 2 and episode.reward == 0.0 and episode.metrics["answered"] == 0

    final = _ids(tokenizer, "<answer>the Dravo Kelmir</answer>", eos=True)
    env = SearchR1Env(retriever_url=retriever_url, max_turns=2)
    episode, _, _ = await _run(tokenizer, [search, search, final], env)
    assert episode.reward == 1.0 and episode.metrics["search_calls"] == 2


async def test_format_reward_and_subem(tokenizer, retriever_url: str) -> None:
    search = _ids(tokenizer, "<think>look up</think><search> Quorvel </search>")
    wrong = _ids(tokenizer, "<think>ok</think><answer> Sulketra </answer>", eos=True)
    env = SearchR1Env(retriever_url=retriever_url, format_reward=0.2)
    episode, _, _ = await _run(tokenizer, [search, wrong], env)
    assert episode.reward == pytest.approx(0.2)

    long_answer = _ids(tokenizer, "<answer> It was Dravo Kelmir. </answer>", eos=True)
    env = SearchR1Env(retriever_url=retriever_url, metric="subem")
    episode, _, _ = await _run(tokenizer, [long_answer], env)
    assert episode.reward == 1.0 and episode.metrics["em"] == 0.0 and episode.metrics["subem"] == 1.0


async def test_search_r1_parquet_rows_are_accepted(tokenizer, retriever_url: str) -> None:
    row = {
        "id": "train_0",
        "question": "Who founded the Quorvel Guild?",
        "golden_answers": None,
        "data_source": "nq",
        "prompt": [{"role": "user", "content": "ignored"}],
        "reward_model": {"style": "rule", "ground_truth": {"target": ["Dravo Kelmir"]}},
    }
    answer = _ids(tokenizer, "<answer> Dravo Kelmir </answer>", eos=True)
    episode, _, _ = await _run(tokenizer, [answer], SearchR1Env(retriever_url=retriever_url), task=row)
    assert episode.reward == 1.0 and episode.metrics["data_source"] == "nq"


async def test_tool_calling_variant(tokenizer, retriever_url: str) -> None:
    call = _ids(
        tokenizer,
        '<tool_call>\n{"name": "search", "arguments": {"query": "Quorvel Guild founder"}}\n</tool_call>',
        eos=True,
    )
    answer = _ids(tokenizer, "<answer> Dravo Kelmir </answer>", eos=True)
    make = env_factory(EnvConfig(name="search_r1_tools", kwargs={"retriever_url": retriever_url, "topk": 1}))
    env = make()
    assert isinstance(env, SearchToolEnv) and [t["function"]["name"] for t in env.tool_schemas] == ["search"]
    episode, _, _ = await _run(tokenizer, [call, answer], env)
    text = tokenizer.decode(episode.tokens.tolist())
    assert '<tool_response>\nDoc 1(Title: "Quorvel Guild") The Quorvel Guild was founded' in text
    assert episode.reward == 1.0 and episode.metrics["tool_calls"] == 1 and episode.metrics["em"] == 1.0


def test_registry_and_options() -> None:
    env = env_factory(
        EnvConfig(name="search_r1", kwargs={"retriever_url": "http://x:1/retrieve", "topk": 5})
    )()
    assert isinstance(env, SearchR1Env) and env.topk == 5 and env.stop == ("</search>", "</answer>")
    with pytest.raises(ValueError, match="tool options do not apply"):
        env_factory(EnvConfig(name="search_r1", tool_parser="tags"))
    with pytest.raises(ValueError, match="em or subem"):
        SearchR1Env(metric="f1")
