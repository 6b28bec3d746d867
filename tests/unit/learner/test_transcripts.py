"""Transcripts: episodes laid out token for token as the agent loop lays them out (the README's
WordTools conversation rendered by the tiny model's real tokenizer and chat template), decoded
into `transcripts.jsonl`, read back, rendered by `agentrl show transcripts`; the flat-reward watch."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.learner.transcripts import (
    KEYS,
    RewardWatch,
    TranscriptWriter,
    read_transcripts,
    sample,
    select,
    turn_spans,
)
from agentrl.types import Episode, Group


def word_episode(tokenizer, task: dict, reward: float, version: int = 3) -> Episode:
    """A WordTools demonstration as an episode: the agent loop's layout (prompt, generated call,
    tool turn, generated answer), from the same renderer the roller uses."""
    from agentrl.rollers.chat import ChatRenderer, render_conversation
    from examples.word_tools import WordTools

    env = WordTools()
    ids, mask = render_conversation(ChatRenderer(tokenizer, env.tool_schemas), env.demonstrate(task))
    mask = np.asarray(mask, np.uint8)
    return Episode(ids, mask, np.where(mask == 1, -0.5, 0.0), np.where(mask == 1, version, -1), reward=reward,
                   num_turns=2, finish_reason="done", metrics={"tool_calls": 1, "tool_errors": 0})  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from agentrl.tiny_model import init_model

    return AutoTokenizer.from_pretrained(init_model("tiny", tmp_path_factory.mktemp("m") / "tiny"))


@pytest.fixture
def written(tokenizer, tmp_path: Path) -> tuple[Path, list[Group]]:
    from examples.word_tools import WordTools

    tasks = WordTools.generate_tasks(2)
    groups = [
        Group([word_episode(tokenizer, t, reward=float(i), version=3) for i in range(3)], group_id=f"g{n}",
              prompt_id=t["id"], metrics={"answer": t["answer"]})
        for n, t in enumerate(tasks)
    ]  # fmt: skip
    writer = TranscriptWriter(tmp_path, tokenizer.name_or_path, every=5, episodes=4)
    for step in (1, 2, 5):
        if writer.due(step):
            writer.write(step, groups)
    return tmp_path, groups


def test_the_file_has_the_schema_and_each_episodes_text_round_trips_to_its_tokens(tokenizer, written) -> None:
    run_dir, groups = written
    records = read_transcripts(run_dir)
    assert sorted({r["step"] for r in records}) == [1, 5]  # the first step, then every 5
    assert len(records) == 8
    episodes = {(g.group_id, i): ep for g in groups for i, ep in enumerate(g.episodes)}
    for r in records:
        assert tuple(r) == KEYS
        ep = episodes[(r["group_id"], r["episode"])]
        assert r["tokens"] == ep.tokens.tolist() and r["num_tokens"] == len(ep.tokens)
        assert r["reward"] == ep.reward and r["finish_reason"] == "done" and r["versions"] == [3, 3]
        assert r["metrics"] == {"tool_calls": 1, "tool_errors": 0}
        assert [t["source"] for t in r["turns"]] == ["prompt", "model", "env", "model"]
        text = "".join(t["text"] for t in r["turns"])
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == ep.tokens.tolist()  # the round trip
        model = [t["text"] for t in r["turns"] if t["source"] == "model"]
        answer = {g.prompt_id: g.metrics["answer"] for g in groups}[r["prompt_id"]]
        assert '"name": "count_letters"' in model[0] and model[1].startswith(answer)
        tool = next(t["text"] for t in r["turns"] if t["source"] == "env")
        assert "<tool_response>" in tool
        for t in r["turns"]:
            assert tokenizer.decode(ep.tokens[t["start"] : t["end"]].tolist()) == t["text"]


def test_a_sample_keeps_the_worst_and_the_best_episode(tokenizer) -> None:
    rewards = [0.5, 0.0, 0.7, 1.0, 0.2, 0.3]
    groups = [Group([Episode([1, 2], [0, 1], [0, -1], [-1, 0], reward=r) for r in rewards[i : i + 3]])
              for i in (0, 3)]  # fmt: skip
    picked = sample(groups, 3, seed=0)
    got = sorted(g.episodes[i].reward for g, i in picked)
    assert len(picked) == 3 and got[0] == 0.0 and got[-1] == 1.0
    assert len(sample(groups, 10, seed=0)) == 6


def test_turns_split_on_the_loss_mask() -> None:
    assert turn_spans(np.array([0, 0, 1, 1, 0, 1])) == [("prompt", 0, 2), ("model", 2, 4), ("env", 4, 5),
                                                          ("model", 5, 6)]  # fmt: skip
    assert turn_spans(np.array([0, 0, 0])) == [("prompt", 0, 3)]  # nothing generated: all prompt


def test_flat_rewards_are_counted_and_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    flat = [Group([Episode([1, 2], [0, 1], [0, -1], [-1, 0], reward=0.0) for _ in range(2)])]
    varied = [Group([Episode([1, 2], [0, 1], [0, -1], [-1, 0], reward=r) for r in (0.0, 1.0)])]
    watch = RewardWatch(tmp_path, limit=3)
    with caplog.at_level(logging.WARNING, logger="agentrl"):
        counts = [watch.observe(s, g) for s, g in enumerate([flat, flat, varied, flat, flat, flat], 1)]
    assert counts == [1, 2, 0, 1, 2, 3]
    (warning,) = [r.getMessage() for r in caplog.records if "nothing to learn" in r.getMessage()]
    assert "for 3 steps in a row" in warning and f"agentrl show transcripts {tmp_path}" in warning


def test_show_transcripts_renders_the_chosen_episodes(written) -> None:
    run_dir, _ = written
    runner = CliRunner()
    out = runner.invoke(app, ["show", "transcripts", str(run_dir), "--worst", "-n", "1"])
    assert out.exit_code == 0, out.output
    assert "reward 0 " in out.output and "count_letters" in out.output and "[model]" in out.output
    out = runner.invoke(app, ["show", "transcripts", str(run_dir), "--best", "-n", "1"])
    assert out.exit_code == 0 and "reward 2 " in out.output
    out = runner.invoke(app, ["show", "transcripts", str(run_dir), "--step", "3"])
    assert out.exit_code == 2 and "no transcripts for step 3" in out.output and "[1, 5]" in out.output
    out = runner.invoke(app, ["show", "transcripts", str(run_dir / "elsewhere")])
    assert out.exit_code == 2 and "learner.logging.transcripts_every" in out.output


def test_select_defaults_to_the_last_step() -> None:
    records = [{"step": s, "reward": r} for s, r in ((1, 0.0), (1, 1.0), (6, 0.5), (6, 0.25))]
    assert [r["reward"] for r in select(records)] == [0.5, 0.25]
    assert [r["reward"] for r in select(records, order="best", limit=2)] == [1.0, 0.5]
    assert [r["reward"] for r in select(records, step=1, order="worst")] == [0.0, 1.0]
