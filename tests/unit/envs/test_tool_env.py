"""ToolEnv end to end at the env level: tools from methods and functions, error observations."""

from __future__ import annotations

import json
import sys

import pytest

from agentrl.config import EnvConfig
from agentrl.envs.base import Env, StepResult, Transcript, as_step_result
from agentrl.envs.registry import env_factory, load_env_class
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import tool
from agentrl.envs.toy import CalculatorEnv, safe_eval


def lookup(key: str) -> str:
    """Look up a key.

    Args:
        key: The key.
    """
    return {"a": "1"}.get(key, "missing")


class Notes(ToolEnv):
    system_prompt = "Take notes."

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.notes: list[str] = []

    @tool
    def write(self, text: str) -> str:
        """Write a note.

        Args:
            text: The note.
        """
        self.notes.append(text)
        return f"saved {len(self.notes)}"


async def test_tools_from_methods_and_functions_render_and_run() -> None:
    env = Notes(tools=[lookup])
    assert [t["function"]["name"] for t in env.tool_schemas] == ["write", "lookup"]
    prompt = env.reset({"question": "note this"})
    assert prompt == [{"role": "system", "content": "Take notes."}, {"role": "user", "content": "note this"}]
    action = (
        '<tool_call>{"name": "write", "arguments": {"text": "hi"}}</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
    )
    result = await env.step(action)
    assert result.done is False
    assert result.observation == [
        {"role": "tool", "name": "write", "content": "saved 1"},
        {"role": "tool", "name": "lookup", "content": "1"},
    ]
    assert env.notes == ["hi"]  # state lives in the per-episode instance
    final = await env.step("All done.")
    assert final.done and final.observation is None and final.info["final"] == "All done."
    assert env.metrics == {"tool_calls": 2, "tool_errors": 0}


async def test_hostile_calls_become_counted_error_observations() -> None:
    env = Notes()
    env.reset({"question": "q"})
    result = await env.step(
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call><tool_call>{broken</tool_call>'
        '<tool_call>{"name": "write", "arguments": {"text": 5}}</tool_call>'
    )
    texts = [m["content"] for m in result.observation]
    assert "unknown tool 'rm_rf'; available tools: write" in texts[0]
    assert texts[1].startswith("Error: invalid arguments for write")
    assert "invalid JSON" in texts[2]
    assert env.metrics["tool_errors"] == 3
    assert env.metrics["tool_error_unknown_tool"] == 1 and env.metrics["tool_error_malformed"] == 1
    assert result.done is False  # the model gets to correct itself


async def test_calls_beyond_the_turn_limit_are_told_to_the_model_and_counted() -> None:
    env = Notes()
    env.reset({"question": "q"})
    result = await env.step('<tool_call>{"name": "write", "arguments": {"text": "n"}}</tool_call>' * 1000)
    assert len(env.notes) == 8 and len(result.observation) == 9
    assert "992 calls) were not run" in result.observation[-1]["content"]
    assert env.metrics["tool_calls_dropped"] == 992 and env.metrics["tool_error_too_many_calls"] == 1
    assert env.metrics["tool_errors"] == 1 and env.metrics["tool_calls"] == 9


def test_duplicate_tool_names_are_refused() -> None:
    with pytest.raises(ValueError, match="duplicate tool names"):
        ToolEnv(tools=[lookup, lookup])


def test_step_results_accept_plain_tuples() -> None:
    assert as_step_result(("obs", 1, True)) == StepResult("obs", 1.0, True, {})
    assert as_step_result(StepResult()).info == {}
    with pytest.raises(TypeError, match="must return"):
        as_step_result("nope")


def test_plain_env_rejects_unknown_options() -> None:
    with pytest.raises(TypeError, match="takes no options"):
        Env(color="red")


def test_calculator_env_rewards_the_right_final_number() -> None:
    tasks = CalculatorEnv.generate_tasks(50, seed=3)
    assert tasks == CalculatorEnv.generate_tasks(50, seed=3)  # reproducible
    assert all(str(safe_eval(t["expression"])) == t["answer"] for t in tasks)
    env = CalculatorEnv(format_bonus=0.1)
    env.reset(tasks[0])

    def transcript(text: str) -> Transcript:
        return Transcript(tasks[0], [], text, 2, "stop")

    assert env.reward(transcript(f"The answer is {tasks[0]['answer']}")) == 1.0
    assert env.reward(transcript("I don't know")) == 0.0
    env.metrics["tool_calls"] = 1
    assert env.reward(transcript("0")) == pytest.approx(0.1 if tasks[0]["answer"] != "0" else 1.1)


@pytest.mark.parametrize("expr", ["__import__('os')", "2**1000", "1/0", "1//0", "9" * 300, "a+1", "[1]*9"])
def test_safe_eval_refuses_hostile_expressions(expr: str) -> None:
    with pytest.raises((ValueError, ZeroDivisionError, SyntaxError)):
        safe_eval(expr)


def test_registry_builds_envs_from_config() -> None:
    make = env_factory(EnvConfig(name="toy_calculator", kwargs={"format_bonus": 0.2}, tool_timeout_s=3))
    env = make()
    assert isinstance(env, CalculatorEnv) and env.format_bonus == 0.2 and env.tool_timeout_s == 3
    assert make() is not env  # one instance per episode
    assert load_env_class("tests.unit.envs.test_tool_env:Notes") is Notes


def test_registry_finds_env_modules_in_the_current_directory(tmp_path, monkeypatch) -> None:
    (tmp_path / "scratch_envs").mkdir()
    (tmp_path / "scratch_envs" / "__init__.py").write_text("")
    (tmp_path / "scratch_envs" / "mine.py").write_text(
        "from agentrl.envs import ToolEnv\n\nclass Mine(ToolEnv):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    cls = load_env_class("scratch_envs.mine:Mine")
    assert cls.__name__ == "Mine" and sys.path[-1] == str(tmp_path)  # after the installed packages
    with pytest.raises(ValueError, match=r"cannot import 'scratch_envs\.absent'"):
        load_env_class("scratch_envs.absent:Mine")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (EnvConfig(name="nope"), "unknown env 'nope'"),
        (EnvConfig(name="no_such_module:Env"), "cannot import"),
        (EnvConfig(name="agentrl.envs.toy:safe_eval"), "not an agentrl Env subclass"),
        (EnvConfig(name="toy_calculator", kwargs={"colour": 1}), "env.kwargs"),
        (EnvConfig(name="agentrl.envs.base:Env", tool_parser="tags"), "env.tool_parser"),
    ],
)
def test_registry_errors_name_the_field(config: EnvConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        env_factory(config)


def test_lookup_env_needs_the_lookup_and_rewards_the_colour() -> None:
    from agentrl.envs.toy import LookupEnv

    tasks = LookupEnv.generate_tasks(20, seed=1)
    assert tasks == LookupEnv.generate_tasks(20, seed=1)
    assert len({json.dumps(t["table"], sort_keys=True) for t in tasks}) > 1  # each task hides its own table
    task = tasks[0]
    env = LookupEnv()
    assert env.reset(task) == [{"role": "user", "content": task["question"]}]
    found = env.step(f"<lookup> {task['animal']} </lookup>")
    assert found.observation == f" <result> {task['answer']} </result>" and not found.done
    assert env.step("<lookup> unicorn </lookup>").observation == " <result> unknown </result>"
    corrective = env.step("I have no idea")
    assert "<lookup> animal </lookup>" in corrective.observation and not corrective.done
    assert env.metrics == {"tool_calls": 3, "tool_errors": 2}
    done = env.step(f" <answer> {task['answer']} </answer>")
    assert done.done and env.reward(Transcript(task, [], "", 3, "done")) == 1.0
    wrong = LookupEnv()
    wrong.reset(task)
    wrong.step("<answer> nothing </answer>")
    assert wrong.reward(Transcript(task, [], "", 1, "done")) == 0.0
    assert LookupEnv.stop == ("</lookup>", "</answer>")


def test_lookup_weak_teacher_misreads_a_fixed_share_of_tasks() -> None:
    from agentrl.envs.toy import LookupEnv

    tasks = LookupEnv.generate_tasks(400, seed=2)

    def answered(env: LookupEnv, task: dict) -> str:
        demo = env.demonstrate(task)
        assert demo[1]["content"] == f"<lookup> {task['animal']} </lookup>"  # the lookup is always right
        assert demo[2]["content"] == f" <result> {task['answer']} </result>"
        return demo[3]["content"].split()[1]

    assert all(answered(LookupEnv(), t) == t["answer"] for t in tasks)  # the default teacher is exact
    teacher = LookupEnv(teacher_error_rate=0.3)
    wrong = [t["id"] for t in tasks if answered(teacher, t) != t["answer"]]
    assert 0.22 < len(wrong) / len(tasks) < 0.38
    assert wrong == [t["id"] for t in tasks if answered(LookupEnv(teacher_error_rate=0.3), t) != t["answer"]]
    with pytest.raises(ValueError, match="teacher_error_rate"):
        LookupEnv(teacher_error_rate=1.5)


def test_slow_lookup_takes_its_time_on_lookups_only() -> None:
    import asyncio

    from agentrl.envs.toy import SlowLookupEnv

    task = SlowLookupEnv.generate_tasks(1, seed=4)[0]
    env = SlowLookupEnv(latency_s=60.0, max_latency_s=60.0)  # every lookup takes a minute
    env.reset(task)

    async def episode() -> None:
        with pytest.raises(asyncio.TimeoutError):  # the lookup is still sleeping
            await asyncio.wait_for(env.step(f"<lookup> {task['animal']} </lookup>"), timeout=0.3)
        done = await asyncio.wait_for(env.step(f"<answer> {task['answer']} </answer>"), timeout=30)
        assert done.done  # answers do not wait

    asyncio.run(episode())
    assert env.metrics["tool_calls"] == 1
    assert env.reward(Transcript(task, [], "", 2, "done")) == 1.0
