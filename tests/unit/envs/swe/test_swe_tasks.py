"""SWE tasks: the instance layout, the planted-bug generator, and grading through a real
local sandbox (the right patch scores 1, a wrong or missing one 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import LocalSandboxConfig
from agentrl.envs.sandbox import create
from agentrl.envs.sandbox.local import available_isolation
from agentrl.envs.swe.grading import extract_patch, grade_patch, prepare_repo
from agentrl.envs.swe.synthetic import BANK, _diff, generate
from agentrl.envs.swe.tasks import SweTask, load_tasks, save_tasks

LEVEL = available_isolation(424242 if __import__("os").geteuid() == 0 else None)[0]
SANDBOX = LocalSandboxConfig(isolation=LEVEL, min_isolation="none", timeout_s=60, python_packages=["pytest"])


@pytest.mark.parametrize("template", BANK, ids=[t.name for t in BANK])
def test_every_planted_bug_breaks_only_its_hidden_tests(template) -> None:
    good, bad = {}, {}
    exec(template.source, good)
    exec(template.source.replace(*template.bug), bad)
    for call, expected in template.visible:
        assert eval(call, good) == eval(expected) and eval(call, bad) == eval(expected), call
    for call, expected in template.hidden:
        assert eval(call, good) == eval(expected), call
        assert eval(call, bad) != eval(expected), call


def test_swe_bench_rows_load_and_round_trip(tmp_path: Path) -> None:
    row = {
        "instance_id": "astropy__astropy-12907", "repo": "astropy/astropy", "base_commit": "d16bfe05",
        "problem_statement": "separability_matrix is wrong for nested models", "patch": "diff ...",
        "test_patch": "diff ...", "FAIL_TO_PASS": '["tests/test_a.py::test_x"]', "PASS_TO_PASS": "[]",
        "version": "4.3", "environment_setup_commit": "298ccb47",
    }  # fmt: skip
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n\n")
    [task] = load_tasks(tmp_path / "t.jsonl")
    assert task.FAIL_TO_PASS == ["tests/test_a.py::test_x"] and task.PASS_TO_PASS == []
    assert task.metadata == {"version": "4.3", "environment_setup_commit": "298ccb47"}
    assert "patch" not in task.prompt_view()
    assert load_tasks(save_tasks([task], tmp_path / "again.jsonl")) == [task]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"instance_id": "x", "problem_statement": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: .*FAIL_TO_PASS"):
        load_tasks(tmp_path / "bad.jsonl")


def test_generator_is_deterministic_and_hides_the_failing_tests(tmp_path: Path) -> None:
    first, second = generate(tmp_path / "a", 6, seed=3), generate(tmp_path / "b", 6, seed=3)
    assert [t.patch for t in first] == [t.patch for t in second]
    assert len({t.metadata["bug_function"] for t in first}) > 1
    for task in first:
        repo = Path(task.repo_dir)
        assert repo.is_dir() and (repo / "pytest.ini").exists()
        hidden_file = task.FAIL_TO_PASS[0].split("::")[0]
        assert not (repo / hidden_file).exists()  # only in test_patch
        assert all((repo / t.split("::")[0]).exists() for t in task.PASS_TO_PASS)
        assert task.metadata["bug_function"] in task.problem_statement


async def test_right_patch_scores_one_wrong_patch_zero(tmp_path: Path) -> None:
    tasks = generate(tmp_path, 2, seed=1)
    for task in tasks:
        gold = await grade_patch(SANDBOX, task, task.patch, timeout=60)
        assert gold.reward == 1.0, gold.log
        assert all(gold.fail_to_pass.values()) and all(gold.pass_to_pass.values())
        none = await grade_patch(SANDBOX, task, "", timeout=60)
        assert none.reward == 0.0
        assert not any(none.fail_to_pass.values()) and all(none.pass_to_pass.values())
    # fixing the bug but breaking another helper is still 0
    task = tasks[0]
    other = next(f for f in task.metadata["functions"] if f != task.metadata["bug_function"])
    package = task.repo.split("/")[1]
    source = (Path(task.repo_dir) / package / "core.py").read_text()
    good_line, bad_line = next(t.bug for t in BANK if t.name == task.metadata["bug_function"])
    fixed_but_broken = source.replace(bad_line, good_line, 1).replace(
        f"def {other}(", f"def {other}(*args):\n    return None\n\n\ndef _old_{other}("
    )
    wrong = await grade_patch(
        SANDBOX, task, _diff(f"{package}/core.py", source, fixed_but_broken), timeout=60
    )
    assert wrong.reward == 0.0
    assert all(wrong.fail_to_pass.values()) and not all(wrong.pass_to_pass.values())
    garbage = await grade_patch(
        SANDBOX, task, "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n", timeout=60
    )
    assert (garbage.reward, garbage.patch_applied) == (0.0, False)


async def test_edits_made_in_a_sandbox_are_graded_from_their_diff(tmp_path: Path) -> None:
    [task] = generate(tmp_path, 1, seed=7)
    package = task.repo.split("/")[1]
    box = create(SANDBOX)
    await box.start(task.repo_dir)
    try:
        await prepare_repo(box)
        source = (await box.read_file(f"{package}/core.py")).decode()
        good_line, bad_line = next(t.bug for t in BANK if t.name == task.metadata["bug_function"])
        await box.write_file(f"{package}/core.py", source.replace(bad_line, good_line, 1))
        await box.exec("python3 -c 'print(1)' > scratch.txt")  # unrelated new file: harmless in the diff
        patch = await extract_patch(box)
    finally:
        await box.close()
    assert f"+++ b/{package}/core.py" in patch
    assert (await grade_patch(SANDBOX, task, patch, timeout=60)).reward == 1.0


def test_cli_module_writes_tasks(tmp_path: Path) -> None:
    from agentrl.envs.swe.synthetic import main

    assert main([str(tmp_path / "out"), "--n", "2"]) == 0
    assert len(load_tasks(tmp_path / "out" / "tasks.jsonl")) == 2
    assert isinstance(load_tasks(tmp_path / "out" / "tasks.jsonl")[0], SweTask)
