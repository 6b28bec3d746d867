"""Task files checked against the fields each env declares it needs (`Env.required_task_fields`):
a task that lacks one is refused when the task source opens the file, naming file, line and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.envs.base import Env
from agentrl.envs.search.env import SearchR1Env, SearchToolEnv
from agentrl.envs.swe.env import SWEEnv
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.toy import CalculatorEnv, LookupEnv
from agentrl.rollers.tasks import TaskSource, read_task_file


def _jsonl(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_task_missing_a_required_field_is_refused_at_start_naming_file_line_and_field(tmp_path: Path):
    good = {"question": "What is 2 + 2?", "answer": "4"}
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps(good) + "\n\n" + json.dumps(good) + "\n" + json.dumps({"question": "q"}) + "\n"
    )
    with pytest.raises(
        ValueError, match=r"tasks\.jsonl:4: the task lacks field 'answer', which CalculatorEnv"
    ):
        TaskSource(str(path), CalculatorEnv, seed=0)
    _jsonl(path, {"answer": "4"})  # none of the prompt's alternatives
    with pytest.raises(ValueError, match=r":1: the task lacks field 'messages' or 'prompt' or 'question'"):
        TaskSource(str(path), CalculatorEnv, seed=0)
    _jsonl(path, {"question": "q", "answer": None})  # null counts as missing
    with pytest.raises(ValueError, match="lacks field 'answer'"):
        read_task_file(path, CalculatorEnv)
    _jsonl(path, {"prompt": "p", "answer": "4"}, {"messages": [], "answer": "4"})  # alternatives suffice
    assert len(TaskSource(str(path), CalculatorEnv, seed=0)._tasks) == 2
    assert read_task_file(_jsonl(path, {"x": 1}))  # no env given: nothing to check against


def test_parquet_rows_are_checked_too(tmp_path: Path):
    pq = pytest.importorskip("pyarrow.parquet", reason="Parquet task files need pyarrow (agentrl[search])")
    import pyarrow as pa

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answers": ["x"]}, {"question": "b"}]), path)
    with pytest.raises(ValueError, match=r"train\.parquet: row 1: the task lacks field 'golden_answers' or"):
        TaskSource(str(path), SearchR1Env, seed=0)


def test_an_env_without_declared_fields_accepts_any_task(tmp_path: Path):
    class Free(Env):
        def reset(self, task):
            return "hi"

    assert Free.missing_task_fields({}) == []
    assert len(read_task_file(_jsonl(tmp_path / "t.jsonl", {"a": 1}), Free)) == 1


@pytest.mark.parametrize(
    ("env_cls", "kwargs"),
    [
        (CalculatorEnv, {}),
        (LookupEnv, {}),
        (SearchR1Env, {"num_people": 20}),
        (SearchToolEnv, {"num_people": 20}),
    ],
)
def test_each_builtin_envs_own_tasks_have_the_fields_it_declares(env_cls: type[Env], kwargs: dict):
    """The declarations refuse nothing the env itself produces, and name at least one field."""
    assert env_cls.required_task_fields
    for task in env_cls.generate_tasks(8, seed=0, **kwargs):
        assert env_cls.missing_task_fields(task) == []


def test_swe_tasks_need_their_instance_fields_and_a_repository(tmp_path: Path):
    from agentrl.envs.swe.synthetic import generate

    tasks = [t.to_dict() for t in generate(tmp_path / "swe", 1, seed=0)]
    assert SWEEnv.missing_task_fields(tasks[0]) == []
    no_repo = {k: v for k, v in tasks[0].items() if k not in ("repo_dir", "image")}
    assert SWEEnv.missing_task_fields(no_repo) == ["'repo_dir' or 'image'"]
    assert ToolEnv.missing_task_fields({"question": "q"}) == []
