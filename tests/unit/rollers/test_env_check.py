"""The env check: prompt budgets against the tiny model's real chat template, demonstrations
replayed through the real parser, tools and reward, malformed calls."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agentrl.config import AgentRLConfig, EnvConfig, RollerConfig
from agentrl.envs.registry import load_env_class
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.env_check import check_env, prompt_budget
from tests.unit.envs.unit_env import UnitConverter

QUICKSTART_BUDGET = {"max_total_tokens": 256, "max_new_tokens": 24, "max_turns": 3}


class WrongReward(UnitConverter):
    """Its demonstration answers right, but its reward pays for nothing."""

    def reward(self, transcript):
        return 0.0


class Fragile(UnitConverter):
    """Raises on a malformed call instead of answering it with an error."""

    async def step(self, action_text):
        if "no_such" in action_text:
            raise KeyError("no_such_tool")
        return await super().step(action_text)


@pytest.fixture
def renderer(tiny_model: Path) -> ChatRenderer:
    return ChatRenderer(AutoTokenizer.from_pretrained(tiny_model), UnitConverter().tool_schemas)


async def test_a_prompt_over_the_budget_names_its_length_the_fields_and_a_budget_that_fits(renderer) -> None:
    tasks = UnitConverter.generate_tasks(4)
    roller = RollerConfig(**QUICKSTART_BUDGET)
    budget = await prompt_budget(UnitConverter, tasks, renderer, roller, context=4096)
    length = max(len(renderer.prompt_ids(UnitConverter().prompt(t))) for t in tasks)
    assert budget.prompt_tokens == length > 256
    assert budget.problem.startswith(
        f"the prompt of task {budget.task_id!r} is {length} tokens (chat template with 2"
    )
    assert "roller.max_total_tokens 256" in budget.problem and "roller.max_new_tokens 24" in budget.problem
    suggested = 64 * -(-(length + 3 * 48) // 64)
    assert f"--roller.max_total_tokens {suggested}" in budget.problem
    fitted = await prompt_budget(
        UnitConverter, tasks, renderer, roller.model_copy(update={"max_total_tokens": suggested}), 4096
    )
    assert fitted.problem is None and fitted.warnings == []
    # a context smaller than prompt + one turn is the model's limit, not the roller's
    small = await prompt_budget(UnitConverter, tasks, renderer, roller, context=length)
    assert f"does not fit the model's context of {length} tokens" in small.problem
    # room for one turn but not for max_turns: a warning, not an error
    tight = await prompt_budget(
        UnitConverter, tasks, renderer, roller.model_copy(update={"max_total_tokens": length + 30}), None
    )
    assert tight.problem is None and "episodes may end with finish 'context'" in tight.warnings[0]


def _config(name: str, tiny_model: Path, **roller) -> AgentRLConfig:
    return AgentRLConfig(env=EnvConfig(name=name), roller=RollerConfig(**{**QUICKSTART_BUDGET, **roller}),
                         learner={"model_path": str(tiny_model)})  # fmt: skip


def _findings(report) -> dict[str, tuple[str, str]]:
    return {f.check: (f.status, f.result) for f in report.findings}


async def test_env_check_replays_the_demonstration_and_tries_malformed_calls(tiny_model: Path) -> None:
    report = await check_env(
        _config(
            "tests.unit.envs.unit_env:UnitConverter", tiny_model, max_total_tokens=640, max_new_tokens=64
        ),
        str(tiny_model),
    )
    found = _findings(report)
    assert not report.failed, report.findings
    assert found["tools"] == ("ok", "factor, multiply")
    assert found["demonstration reward"] == ("ok", "1, 1, 1, 1 (an empty answer: 0)")
    assert "2 call(s), each answered as demonstrated" in found["demonstrations replayed"][1]
    for case in ("broken JSON", "unknown tool", "wrong arguments", "unclosed call"):
        status, result = found[f"malformed: {case}"]
        assert status == "ok" and "Error" in result, (case, result)
    assert [s["function"]["name"] for s in report.schemas] == ["factor", "multiply"]


async def test_env_check_reports_the_budget_a_reward_that_pays_nothing_and_a_crash(tiny_model: Path) -> None:
    found = _findings(
        await check_env(_config("tests.unit.envs.unit_env:UnitConverter", tiny_model), str(tiny_model))
    )
    status, result = found["prompt budget"]
    assert status == "fail" and "roller.max_total_tokens 256" in result and "tokens (chat template" in result
    assert (
        found["demonstration turns"][0] == "fail"
        and "roller.max_new_tokens 24 cuts it" in found["demonstration turns"][1]
    )
    found = _findings(await check_env(_config(f"{__name__}:WrongReward", tiny_model), str(tiny_model)))
    assert found["demonstration reward"][0] == "fail"
    assert "a demonstration should earn the top reward" in found["demonstration reward"][1]
    found = _findings(await check_env(_config(f"{__name__}:Fragile", tiny_model), str(tiny_model)))
    assert found["malformed: unknown tool"] == ("fail", "raised KeyError: 'no_such_tool'")


def test_a_class_the_module_lacks_is_named_as_missing_with_the_closest() -> None:
    module = "tests.unit.envs.unit_env"
    with pytest.raises(
        ValueError,
        match=rf"'{module}' \(.*\) has no class 'UnitConvrt'; did you mean {module}:UnitConverter\?",
    ):
        load_env_class(f"{module}:UnitConvrt")
    with pytest.raises(ValueError, match=r"unknown env 'toy_lookupp' \(did you mean toy_lookup\?\)"):
        load_env_class("toy_lookupp")


async def test_env_check_of_an_agent_env_draws_the_named_envs_tasks_and_says_what_it_leaves_out(
    tiny_model: Path,
) -> None:
    config = _config("agent", tiny_model)
    config.env = EnvConfig(
        name="agent", kwargs={"agent": "examples.lookup_agent:solve", "tasks_from": "toy_lookup"}
    )
    found = _findings(await check_env(config, str(tiny_model)))
    assert found["tasks"][0] == "ok" and "'table'" in found["tasks"][1]  # the lookup env's tasks
    assert found["agent"][0] == "warn" and "left out" in found["agent"][1]
