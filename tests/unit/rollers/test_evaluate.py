"""EM per data source on the synthetic held-out split: searching earns reward, guessing does not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import EnvConfig, RollerConfig
from agentrl.envs.registry import env_factory
from agentrl.envs.search.retriever import BM25Retriever
from agentrl.envs.search.server import RetrieverServer
from agentrl.envs.search.synthetic import build_world, make_synthetic
from agentrl.inference.sglang import SGLangClient
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.evaluate import evaluate, format_report, summarize


class ReaderPolicy:
    """A scripted 'model' that can read: it searches the question, then answers with the gold
    answer only if the retrieved text contains it. With `search=False` it guesses at once."""

    def __init__(self, tokenizer, golds: dict[str, str], search: bool) -> None:
        self.tok, self.golds, self.search = tokenizer, golds, search

    def __call__(self, ids: list[int], params: dict) -> Reply:
        text = self.tok.decode(ids)
        question = re.findall(r"Question: (.*?)\n", text)[-1]
        info = re.findall(r"<information>(Doc .*?)</information>", text, re.S)
        if self.search and not info:
            out = f"<think>I should look this up.</think>\n<search> {question} </search>"
        else:
            gold = self.golds[question]
            answer = gold if info and gold in info[-1] else "Paris"
            out = f"<think>done</think>\n<answer> {answer} </answer>"
        return Reply([*self.tok.encode(out, add_special_tokens=False), self.tok.eos_token_id])


@pytest.mark.parametrize("search", [True, False])
async def test_em_per_data_source_measures_search(tmp_path: Path, tiny_model: Path, search: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    paths = make_synthetic(tmp_path, seed=0, num_people=30)
    tasks = [q for q in build_world(0, 30)["qa"] if q["split"] == "test"]
    golds = {q["question"]: q["golden_answers"][0] for q in tasks}
    retriever = RetrieverServer(BM25Retriever(paths["corpus"]))
    retriever_url = await retriever.start()
    llm = ScriptedServer(ReaderPolicy(tokenizer, golds, search))
    client = SGLangClient(await llm.start())
    make_env = env_factory(EnvConfig(name="search_r1", kwargs={"retriever_url": retriever_url}))
    try:
        report = await evaluate(
            make_env, tasks, client, ChatRenderer(tokenizer), RollerConfig(max_turns=5, max_total_tokens=2048)
        )
    finally:
        await client.close()
        await llm.stop()
        await retriever.stop()
    assert report["overall"]["n"] == len(tasks) == 18
    assert set(report) == {"synthetic", "synthetic_2hop", "overall"}
    assert report["synthetic"]["n"] == 15 and report["synthetic_2hop"]["n"] == 3
    if search:
        assert report["overall"]["search_calls"] == 1.0
        assert report["overall"]["em"] >= 0.9 and report["synthetic_2hop"]["em"] >= 2 / 3
    else:
        assert report["overall"]["search_calls"] == 0.0 and report["overall"]["em"] == 0.0
    assert report["overall"]["answered"] == 1.0
    assert "synthetic_2hop" in format_report(report)


def test_summarize() -> None:
    rows = [
        {"data_source": "nq", "em": 1.0, "subem": 1.0, "answered": 1, "search_calls": 2},
        {"data_source": "nq", "em": 0.0, "subem": 1.0, "answered": 1, "search_calls": 0},
        {"data_source": "hotpotqa", "em": 0.0, "subem": 0.0, "answered": 0, "search_calls": 4},
    ]
    report = summarize(rows)
    assert report["nq"] == {"n": 2, "em": 0.5, "subem": 1.0, "answered": 1.0, "search_calls": 1.0}
    assert report["overall"]["n"] == 3 and report["overall"]["em"] == pytest.approx(1 / 3)


async def test_evaluate_config_uses_the_run_config(tmp_path: Path, tiny_model: Path) -> None:
    from agentrl.config import AgentRLConfig
    from agentrl.rollers.evaluate import evaluate_config

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    paths = make_synthetic(tmp_path, seed=2, num_people=30)
    golds = {q["question"]: q["golden_answers"][0] for q in build_world(2, 30)["qa"]}
    retriever = RetrieverServer(BM25Retriever(paths["corpus"]))
    retriever_url = await retriever.start()
    llm = ScriptedServer(ReaderPolicy(tokenizer, golds, search=True))
    config = AgentRLConfig(
        inference={"servers": [await llm.start()]},
        roller={"tokenizer_path": str(tiny_model), "task_kwargs": {"world_seed": 2, "num_people": 30}},
        env={"name": "search_r1", "kwargs": {"retriever_url": retriever_url}},
    )
    try:
        synthetic = await evaluate_config(config, limit=6)  # the held-out split of the configured world
        from_file = await evaluate_config(config, str(paths["test"]), limit=4)
    finally:
        await llm.stop()
        await retriever.stop()
    assert synthetic["overall"]["n"] == 6 and synthetic["overall"]["em"] >= 5 / 6
    assert from_file["overall"]["n"] == 4
    assert all(r["sampling_params"]["top_k"] == 1 for r in llm.requests)  # greedy
