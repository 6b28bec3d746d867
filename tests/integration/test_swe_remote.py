"""SWEEnv on a remote sandbox: a real `agentrl sandbox-server` process hosts the episode's
sandbox and the grader's; the gold fix earns 1 and no fix 0, as locally."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.config import EnvConfig
from agentrl.envs.base import Transcript, resolve
from agentrl.envs.registry import env_factory
from agentrl.envs.swe.env import SWEEnv
from tests.conftest import Processes
from tests.integration.test_sandbox_remote import KEY, start_server

pytestmark = [pytest.mark.slow, pytest.mark.integration]


async def test_swe_env_on_a_sandbox_server(
    processes: Processes, free_port: int, monkeypatch, tmp_path: Path
) -> None:
    url = start_server(processes, free_port, "--python-packages", "pytest", "--timeout", "60")
    monkeypatch.setenv("AGENTRL_SANDBOX_KEY", KEY)
    make_env = env_factory(EnvConfig(name="swe", sandbox={"type": "remote", "url": url, "timeout_s": 30}))
    task = SWEEnv.generate_tasks(1, seed=5, out_dir=str(tmp_path))[0]
    submit = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
    for fix, expected in ((True, 1.0), (False, 0.0)):
        env = make_env()
        demo = env.demonstrate(task)
        actions = [m["content"] for m in demo if m["role"] == "assistant"] if fix else [submit]
        messages = list(await env.reset(task))
        try:
            for text in actions:
                result = await env.step(text)
                messages += [{"role": "assistant", "content": text}, *(result.observation or [])]
            reward = await env.reward(Transcript(task, messages, "", len(actions), "done"))
        finally:
            await resolve(env.close())
        assert reward == expected, json.dumps(env.metrics)
        assert env.metrics["submitted"] == 1 and env.metrics["isolation"] != "none"
        if fix:
            assert messages == demo  # the same observations as the local tools give
