"""Loading Search-R1's Parquet layout and NQ / HotpotQA-style JSON(L) into one task shape."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agentrl.envs.search.data import load_qa, normalize_task, write_tasks
from agentrl.rollers.tasks import read_task_file


def _search_r1_parquet(path: Path) -> None:
    """A file in the layout scripts/data_process/qa_search_train_merge.py writes."""
    rows = [
        {
            "id": "train_0",
            "question": "who wrote the song the twelfth of never?",
            "golden_answers": ["Jerry Livingston", "Paul Francis Webster"],
            "data_source": "nq",
            "prompt": [
                {"role": "user", "content": "Answer the given question. ... Question: who wrote ...?\n"}
            ],
            "ability": "fact-reasoning",
            "reward_model": {
                "style": "rule",
                "ground_truth": {"target": ["Jerry Livingston", "Paul Francis Webster"]},
            },
            "extra_info": {"split": "train", "index": 0},
        },
        {
            "id": "5a8b57f25542995d1e6f1371",
            "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
            "golden_answers": ["yes"],
            "data_source": "hotpotqa",
            "prompt": [{"role": "user", "content": "..."}],
            "ability": "fact-reasoning",
            "reward_model": {"style": "rule", "ground_truth": {"target": ["yes"]}},
            "extra_info": {"split": "train", "index": 1},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_search_r1_parquet(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    _search_r1_parquet(path)
    tasks = load_qa(path)
    assert [t["data_source"] for t in tasks] == ["nq", "hotpotqa"]
    assert tasks[0]["golden_answers"] == ["Jerry Livingston", "Paul Francis Webster"]
    assert tasks[0]["id"] == "train_0" and "prompt" not in tasks[0]
    # the roller reads the raw rows; the env normalises each one the same way
    raw = read_task_file(path)
    assert normalize_task(raw[1])["golden_answers"] == ["yes"]


def test_answers_from_reward_model_only(tmp_path: Path) -> None:
    row = {
        "question": "q?",
        "reward_model": {"ground_truth": {"target": ["a", "b"]}},
        "extra_info": {"index": 7},
    }
    task = normalize_task(row, data_source="triviaqa")
    assert task["golden_answers"] == ["a", "b"] and task["id"] == "triviaqa-7"


def test_nq_and_hotpotqa_jsonl(tmp_path: Path) -> None:
    nq = tmp_path / "nq_open.jsonl"
    nq.write_text(
        json.dumps({"question": "where is the eiffel tower", "answer": ["Paris", "Paris, France"]}) + "\n\n"
    )
    tasks = load_qa(nq)
    assert tasks[0]["golden_answers"] == ["Paris", "Paris, France"]
    assert tasks[0]["data_source"] == "nq_open" and tasks[0]["id"] == "nq_open-0"

    hotpot = tmp_path / "hotpot_dev.json"  # HotpotQA ships one JSON array with string answers
    hotpot.write_text(
        json.dumps([{"_id": "abc", "question": "Which is older?", "answer": "Ed Wood", "type": "comparison"}])
    )
    task = load_qa(hotpot, data_source="hotpotqa")[0]
    assert task == {
        "_id": "abc",
        "question": "Which is older?",
        "answer": "Ed Wood",
        "type": "comparison",
        "id": "abc",
        "golden_answers": ["Ed Wood"],
        "data_source": "hotpotqa",
    }


def test_bad_records_name_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "q?", "answer": ["a"]}) + "\n" + json.dumps({"question": "no answer?"}) + "\n"
    )
    with pytest.raises(ValueError, match=r"record 2: .*gold answers"):
        load_qa(bad)
    with pytest.raises(ValueError, match="non-empty 'question'"):
        normalize_task({"answer": "x"})
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:1: not JSON"):
        load_qa(broken)


def test_write_tasks_round_trips(tmp_path: Path) -> None:
    tasks = [{"id": "1", "question": "q?", "golden_answers": ["a", "b"], "data_source": "x"}]
    for name in ("t.jsonl", "t.parquet"):
        assert load_qa(write_tasks(tasks, tmp_path / name)) == tasks
