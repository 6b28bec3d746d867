"""SWEEnv against real local sandboxes (bubblewrap here): the gold fix earns 1, no fix or a
wrong fix 0, hostile commands become observations and the episode goes on."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agentrl.config import EnvConfig, LocalSandboxConfig
from agentrl.envs.base import Transcript, resolve
from agentrl.envs.registry import env_factory
from agentrl.envs.sandbox import SandboxError
from agentrl.envs.swe.env import SWEEnv, parse_patch
from tests.unit.envs.sandbox.conftest import needs_bwrap

SANDBOX = LocalSandboxConfig(python_packages=["pytest"], memory_mb=512, timeout_s=30, max_processes=32)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return SWEEnv.generate_tasks(3, seed=7, out_dir=str(tmp_path_factory.mktemp("swe")))


async def play(env: SWEEnv, task: dict, actions: list[str]) -> tuple[float, list, dict]:
    """Run `actions` as the model's turns (stopping when the env says done), then grade."""
    messages = list(await env.reset(task))
    finish = "max_turns"
    try:
        for text in actions:
            messages.append({"role": "assistant", "content": text})
            result = await env.step(text)
            if result.done:
                finish = "done"
                break
            messages.extend(result.observation)
        transcript = Transcript(task, messages, actions[-1], len(actions), finish, dict(env.metrics))
        reward = await env.reward(transcript)
    finally:
        await resolve(env.close())
    return reward, messages, env.metrics


@needs_bwrap
async def test_gold_demonstration_earns_1_and_matches_the_real_tools(tasks) -> None:
    task = tasks[0]
    env = SWEEnv(sandbox=SANDBOX)
    demo = env.demonstrate(task)
    assert demo[-1]["content"] == call("submit") and "patch" not in json.dumps(demo[:2])
    actions = [m["content"] for m in demo if m["role"] == "assistant"]
    reward, messages, metrics = await play(env, task, actions)
    assert reward == 1.0
    # the demonstration's observations are exactly what the real tools answered
    assert messages == demo
    assert metrics["submitted"] == 1 and metrics["hit_limit"] == 0 and metrics["resolved"] == 1
    assert metrics["tool_errors"] == 0 and metrics["steps"] == len(actions)
    assert metrics["tests_failed"] == 0 and metrics["tests_passed"] == len(task["FAIL_TO_PASS"]) + len(
        task["PASS_TO_PASS"]
    )
    assert metrics["isolation"] == "bwrap" and env.sandbox is None


@needs_bwrap
async def test_no_fix_and_wrong_fix_earn_0(tasks) -> None:
    task = tasks[1]
    reward, _, metrics = await play(SWEEnv(sandbox=SANDBOX), task, [call("submit")])
    assert reward == 0.0 and metrics["submitted"] == 1 and metrics["patch_lines"] == 0

    # a "fix" that makes the buggy function's tests unreachable: the module no longer imports
    path, _, _, _ = parse_patch(task["patch"])[0]
    wrong = [call("bash", command=f"echo 'raise SystemExit' >> {path}"), call("submit")]
    reward, _, metrics = await play(SWEEnv(sandbox=SANDBOX), task, wrong)
    assert reward == 0.0 and metrics["patch_lines"] == 1 and metrics["patch_applied"] == 1
    assert metrics["tests_passed"] == 0 and metrics["tests_failed"] > 0

    # editing the visible tests to pass does not help: the hidden FAIL_TO_PASS tests decide
    cheat = [call("bash", command="rm -rf tests && mkdir tests"), call("submit")]
    reward, _, metrics = await play(SWEEnv(sandbox=SANDBOX), task, cheat)
    assert reward == 0.0 and metrics["resolved"] == 0


@needs_bwrap
async def test_gold_fix_by_bash_without_submit_is_graded_and_flagged(tasks) -> None:
    task = tasks[2]
    env = SWEEnv(sandbox=SANDBOX, max_steps=2)
    patch = task["patch"]
    apply = call(
        "bash", command=f"cat > /tmp/fix.diff <<'EOF'\n{patch}EOF\ngit apply /tmp/fix.diff && echo applied"
    )
    reward, messages, metrics = await play(env, task, [apply, call("bash", command="git status --short")])
    assert "applied" in messages[3]["content"]
    assert reward == 1.0, json.dumps(metrics)  # the diff is what counts ...
    assert (
        metrics["submitted"] == 0 and metrics["step_limit"] == 1 and metrics["hit_limit"] == 1
    )  # ... flagged


@needs_bwrap
async def test_hostile_commands_are_observations_and_the_episode_goes_on(tasks) -> None:
    task = tasks[0]
    env = SWEEnv(sandbox=SANDBOX, tool_timeout_s=5.0, max_tool_output_chars=2000)
    hostile = [
        ("sleep 100", "timed out"),
        ("yes flood | head -c 50000000", "truncated"),
        ("bomb(){ bomb|bomb& }; bomb; sleep 2; echo survived", "Cannot fork"),
        ("python3 -c 'x = bytearray(2 << 30)'", "exit code"),
        ("python3 -c 'import urllib.request as u; u.urlopen(\"http://1.1.1.1\", timeout=3)'", "exit code"),
        ("cat /root/.bashrc /etc/shadow; ls /work/..", "exit code"),
        ("sleep 1000 & disown; setsid sleep 1000 & echo started", "started"),
    ]
    actions = [call("bash", command=cmd) for cmd, _ in hostile]
    actions += [call("str_replace_editor", command="str_replace", path="nope.py", old_str="a", new_str="b")]
    actions += [m["content"] for m in env.demonstrate(task) if m["role"] == "assistant"]
    reward, messages, metrics = await play(env, task, actions)
    observations = [m["content"] for m in messages if m["role"] == "tool"]
    for (cmd, marker), seen in zip(hostile, observations, strict=False):
        assert marker in seen, (cmd, seen[-300:])
        assert len(seen) <= 2000
    assert "Memory" in observations[3] or "memory" in observations[3] or "137" in observations[3]
    assert "exit code 0" not in observations[4]  # no network
    assert "No such file" in observations[5] or "Permission denied" in observations[5]
    assert "does not exist" in observations[7]
    assert reward == 1.0  # after all that, the fix still lands and is graded
    assert metrics["tool_errors"] == 1 and metrics["submitted"] == 1


@needs_bwrap
async def test_a_turn_without_a_tool_call_ends_the_episode_unsubmitted(tasks) -> None:
    reward, _, metrics = await play(SWEEnv(sandbox=SANDBOX), tasks[1], ["I think it is fixed."])
    assert reward == 0.0 and metrics["submitted"] == 0 and metrics["steps"] == 1


def test_registry_passes_the_sandbox_section_and_closing_unstarted_is_a_no_op(tmp_path: Path) -> None:
    config = EnvConfig(name="swe", sandbox={"type": "local", "memory_mb": 256}, kwargs={"max_steps": 3})
    env = env_factory(config)()
    assert isinstance(env, SWEEnv) and env.sandbox_config.memory_mb == 256 and env.max_steps == 3
    assert env.close() is None
    assert env.command_timeout_s == pytest.approx(min(30.0 * 0.8, 60.0))
    assert [t.name for t in env.tools] == ["bash", "str_replace_editor", "submit"]
    from_dict = SWEEnv(sandbox={"memory_mb": 300, "timeout_s": 5})
    assert from_dict.sandbox_config.type == "local" and from_dict.command_timeout_s == 5.0


def test_generated_tasks_are_deterministic_and_reused(tmp_path: Path) -> None:
    first = SWEEnv.generate_tasks(2, seed=3, out_dir=str(tmp_path))
    again = SWEEnv.generate_tasks(2, seed=3, out_dir=str(tmp_path))
    assert first == again and len(first) == 2
    assert all(Path(t["repo_dir"]).is_absolute() and Path(t["repo_dir"]).is_dir() for t in first)
    assert [p.name for p in tmp_path.iterdir()] == ["seed3-n2"]  # no staging directories left
    other = SWEEnv.generate_tasks(2, seed=4, out_dir=str(tmp_path))
    assert [t["patch"] for t in other] != [t["patch"] for t in first]


def test_parse_patch_gives_unique_hunks() -> None:
    patch = (
        "--- a/pkg/m.py\n+++ b/pkg/m.py\n@@ -1,3 +1,3 @@\n def f():\n-    return 1\n+    return 2\n \n"
        "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1,2 @@\n+x = 1\n+y = 2\n"
    )
    assert parse_patch(patch) == [
        ("pkg/m.py", "def f():\n    return 1\n", "def f():\n    return 2\n", False),
        ("new.py", "", "x = 1\ny = 2", True),
    ]


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0, reason="private sandbox uids need root")
async def test_a_root_dir_the_sandbox_uid_cannot_traverse_is_refused_at_start(tmp_path: Path, tasks) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    env = SWEEnv(sandbox=SANDBOX.model_copy(update={"root_dir": str(hidden / "boxes")}))
    with pytest.raises(SandboxError, match=r"root_dir: .* not traversable"):
        await env.reset(tasks[0])
    await resolve(env.close())
    assert not list((hidden / "boxes").iterdir())
