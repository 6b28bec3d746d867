"""Third-party backends: a separate distribution, built and installed here, registers an inference
backend, an env and a sandbox through entry points, and `agentrl run` uses all three by name
without any change in agentrl."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import find_free_port, run_agentrl

PYPROJECT = """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "agentrl-tinyplugin"
version = "0.1"

[project.entry-points."agentrl.inference_backends"]
tiny_embedded = "agentrl_tinyplugin:BACKEND"

[project.entry-points."agentrl.envs"]
tiny_lookup = "agentrl_tinyplugin:TinyLookupEnv"

[project.entry-points."agentrl.sandboxes"]
tiny_box = "agentrl_tinyplugin:TinyBox"
"""

PLUGIN = '''
"""A thin inference backend over agentrl's embedded server, an env whose reward runs a command in
its sandbox, and a sandbox that runs commands as plain child processes (no isolation: a test
fixture). Each leaves a marker file in $TINYPLUGIN_MARKS when used."""

import asyncio
import dataclasses
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from agentrl.envs.sandbox import ExecResult, Sandbox, create
from agentrl.envs.toy import LookupEnv
from agentrl.inference.backends import EMBEDDED


def _mark(what):
    Path(os.environ["TINYPLUGIN_MARKS"], f"{what}-{os.getpid()}").touch()


class TinyOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str


def _serve(model_path, host, port, config):
    _mark(f"served_{config.options['tag']}")
    return EMBEDDED.serve(model_path, host, port, config)


def _client(url, config, **kwargs):
    _mark("client")
    return EMBEDDED.client(url, config, **kwargs)


BACKEND = dataclasses.replace(
    EMBEDDED, name="tiny_embedded", serve=_serve, client=_client, options=TinyOptions, help="tiny"
)


class TinyBox(Sandbox):
    def __init__(self, config):
        self.config = config
        self.workdir = None

    async def start(self, image_or_spec=None):
        self.workdir = tempfile.mkdtemp(prefix="tinybox-")

    async def exec(self, cmd, timeout=None, env=None):
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        proc = await asyncio.create_subprocess_exec(
            *argv, cwd=self.workdir, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        _mark("exec")
        return ExecResult(proc.returncode, out.decode(), err.decode())

    async def write_file(self, path, data):
        Path(self.workdir, path).write_bytes(data.encode() if isinstance(data, str) else data)

    async def read_file(self, path):
        return Path(self.workdir, path).read_bytes()

    async def close(self):
        self.workdir = None


class TinyLookupEnv(LookupEnv):
    def __init__(self, sandbox, **kwargs):
        super().__init__(**kwargs)
        self.box = create(sandbox)
        self.greeting = sandbox.options["greeting"]

    async def reward(self, transcript):
        await self.box.start()
        try:
            said = await self.box.exec(["echo", self.greeting])
        finally:
            await self.box.close()
        assert said.stdout.strip() == self.greeting, said
        return super().reward(transcript)
'''


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin, built and installed (`pip install --target`) into a directory of its own."""
    root = tmp_path_factory.mktemp("plugin")
    src, target = root / "src", root / "site"
    (src / "agentrl_tinyplugin").mkdir(parents=True)
    (src / "pyproject.toml").write_text(PYPROJECT)
    (src / "agentrl_tinyplugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target), str(src)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    assert list(target.glob("agentrl_tinyplugin-0.1.dist-info/entry_points.txt"))
    return target


def test_run_uses_an_installed_inference_backend_env_and_sandbox(
    plugin_path: Path, tiny_model: Path, tmp_path: Path
) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {
        "PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")]),
        "TINYPLUGIN_MARKS": str(marks),
    }
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=2", "--learner.groups_per_step=1",
        "--learner.warmstart.steps=0", "--roller.group_size=2", "--roller.max_turns=1",
        f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        "--inference.type=tiny_embedded", "--inference.options.tag=hi", "--env.name=tiny_lookup",
        "--env.sandbox.type=tiny_box", "--env.sandbox.options.greeting=hello",
        timeout=600, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir / "learner.jsonl")] == [1, 2]
    made = {p.name.split("-")[0] for p in marks.iterdir()}
    assert made == {"served_hi", "client", "exec"}, sorted(p.name for p in marks.iterdir())
    resolved = (run_dir / "config.resolved.yaml").read_text()
    assert "type: tiny_embedded" in resolved and "type: tiny_box" in resolved


def test_an_unknown_name_lists_the_registered_ones(plugin_path: Path, tiny_model: Path) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(plugin_path), os.environ.get("PYTHONPATH", "")])}
    result = run_agentrl(
        "config", "show", f"--learner.model_path={tiny_model}", "--inference.type=tiny_embeded",
        "--env.sandbox.type=tiny_bx", env=env,
    )  # fmt: skip
    assert result.returncode != 0
    assert (
        "unknown backend 'tiny_embeded' (did you mean tiny_embedded?); registered: embedded, sglang, vllm, tiny_embedded"
        in result.stderr
    )
    assert (
        "unknown backend 'tiny_bx' (did you mean tiny_box?); registered: local, docker, remote, tiny_box"
        in result.stderr
    )
