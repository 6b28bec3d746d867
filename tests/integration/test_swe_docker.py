"""SWEEnv with Docker sandboxes, as recipes/swe_qwen.yaml runs it: the task's own image (the
repository at /testbed), a container per episode and one for grading, against a real dockerd
this module starts (the fixtures of test_sandbox_docker; skips with their reason where none can)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import EnvConfig
from agentrl.envs.base import Transcript, resolve
from agentrl.envs.registry import env_factory
from agentrl.envs.swe.env import SWEEnv, parse_patch
from tests.integration.test_sandbox_docker import build_task_image, docker_host, swe_base  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


async def test_swe_env_in_task_images(docker_host: str, swe_base: str, tmp_path: Path) -> None:  # noqa: F811
    task = SWEEnv.generate_tasks(1, seed=9, out_dir=str(tmp_path / "tasks"))[0]
    build_task_image(
        docker_host, swe_base, task["repo_dir"], tmp_path / "task-image", "agentrl/swe-env-task:1"
    )
    in_image = {**task, "image": "agentrl/swe-env-task:1", "repo_dir": None, "workdir": "/testbed"}
    sandbox = {"type": "docker", "docker_host": docker_host, "memory_mb": 256, "timeout_s": 30}
    make_env = env_factory(EnvConfig(name="swe", sandbox=sandbox, tool_timeout_s=5))
    path, old, new, _ = parse_patch(task["patch"])[0]
    fix = [
        call("bash", command="sleep 100"),  # killed inside the container; the episode goes on
        call("str_replace_editor", command="str_replace", path=path, old_str=old, new_str=new),
        call("submit"),
    ]
    for actions, expected in ((fix, 1.0), ([call("submit")], 0.0)):
        env = make_env()
        prompt = await env.reset(in_image)
        assert "/testbed" in prompt[-1]["content"]
        try:
            observations = []
            for text in actions:
                result = await env.step(text)
                observations += [m["content"] for m in result.observation or []]
            reward = await env.reward(Transcript(in_image, [], "", len(actions), "done"))
        finally:
            await resolve(env.close())
        assert reward == expected, (env.metrics, observations)
        assert env.metrics["isolation"] == "docker" and env.metrics["submitted"] == 1
        if actions is fix:
            assert "timed out" in observations[0] and "has been edited" in observations[1]
