"""`agentrl learner` + `agentrl roller` whose inference servers are two strict SGLang 0.5.23
stand-ins (tests/sglang_standin.py: each rule names its source in the 0.5.23 wheel).

Four learner steps, a push after each: every push pauses the servers with generations in
flight (they come back aborted and the roller resubmits), runs inside begin/end, and is
checked against the exported weights; the first push fails midway on one server (a bucket
it received but could not load), whose session is closed and which is pushed to again in
the redo, so it stays usable; the test reads the version as a client would (`/model_info`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.inference.sglang import SGLangClient
from tests.conftest import REPO, find_free_port
from tests.sglang_standin import digest
from tests.unit.weight_sync.test_standin_push import start_standin

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 4


def test_learner_and_roller_against_strict_sglang_standins(
    processes, tiny_model: Path, tmp_path: Path
) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    servers = [
        start_standin(processes, "--vocab-size", str(vocab), "--token-interval-s", "0.02") for _ in range(2)
    ]
    urls = [s.url for s in servers]
    address = f"tcp://127.0.0.1:{find_free_port()}"
    env = {**os.environ, "AGENTRL_QUEUE_SECRET": "s" * 32, "OMP_NUM_THREADS": "1"}
    common = [
        f"--run_dir={tmp_path}", f"--queue.address={address}", "--inference.type=sglang",
        f"--inference.servers=[{', '.join(urls)}]", "--learner.groups_per_step=2", "--max_staleness=1",
        "--env.name=toy_lookup",
    ]  # fmt: skip
    # the second server's first weight update fails midway (armed before the learner starts: on a quiet
    # machine all four steps can finish before a poll sees push 1 land, so arming after it raced)
    servers[1].fail_updates(1)
    learner = processes.start(
        [sys.executable, "-m", "agentrl", "learner", *common, f"--learner.model_path={tiny_model}",
         f"--learner.max_steps={STEPS}", "--learner.warmstart.steps=0", "--learner.batch_timeout_s=0.5",
         "--weight_sync.type=broadcast", "--weight_sync.backend=gloo", "--weight_sync.timeout_s=30",
         "--weight_sync.bucket_mb=1"],
        env=env,
    )  # fmt: skip
    roller = processes.start(
        [sys.executable, "-m", "agentrl", "roller", *common, f"--roller.tokenizer_path={tiny_model}",
         "--roller.group_size=2", "--roller.max_new_tokens=24", "--roller.max_turns=2",
         "--roller.max_concurrent_episodes=8"],
        env=env,
    )  # fmt: skip

    try:
        _, err = learner.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        learner.kill()
        _, err = learner.communicate()
        raise AssertionError(f"learner did not finish: {err.decode()[-4000:]}") from None
    assert learner.returncode == 0, err.decode()[-3000:]
    log = err.decode()

    from safetensors.torch import load_file

    exported = {}
    for f in sorted((tmp_path / "hf" / "latest").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    for server in servers:
        state = server.state()
        calls = state["calls"]
        assert not state["refused"], state["refused"]  # no request broke SGLang's rules
        assert (
            calls.count("/begin_weight_update") == calls.count("/end_weight_update") and not state["session"]
        )
        assert state["weight_version"] == str(STEPS) and not state["paused"]
        assert state["weights"] and all(digest(exported[n]) == d for n, d in state["weights"].items())
        assert calls.count("/pause_generation") >= STEPS - 1 and "/get_weight_version" not in calls
    assert sum(s.state()["aborted"] for s in servers) > 0  # pauses landed on generations in flight
    assert "update_weights_from_distributed" in log and "scripted failure" in log  # a push failed midway
    assert servers[1].state()["calls"].count("/init_weights_update_group") >= 2  # the group was rebuilt

    async def version() -> list[int]:
        async with SGLangClient(urls[0]) as a, SGLangClient(urls[1]) as b:
            return [await a.get_weight_version(), await b.get_weight_version()]

    assert asyncio.run(version()) == [STEPS, STEPS]
    assert roller.poll() is None  # the roller kept going through every push


SHIM = '''"""sglang.launch_server for the test: records SGLang's flags, then serves tests/sglang_standin.py."""
import argparse, json, pathlib, runpy, sys

parser = argparse.ArgumentParser()
for flag in ("--model-path", "--host", "--port", "--dtype", "--weight-version"):
    parser.add_argument(flag, required=True)
opts, rest = parser.parse_known_args()
pathlib.Path(__file__).with_name(f"argv-{opts.port}.json").write_text(json.dumps(sys.argv[1:]))
vocab = json.loads(pathlib.Path(opts.model_path, "config.json").read_text())["vocab_size"]
sys.argv = ["tests.sglang_standin", "--port", opts.port, "--vocab-size", str(vocab), "--device", "cpu"]
runpy.run_module("tests.sglang_standin", run_name="__main__")
'''


def test_agentrl_run_starts_sglang_servers_and_trains_against_them(tiny_model: Path, tmp_path: Path) -> None:
    """`agentrl run --inference.type sglang` plans `agentrl serve --backend sglang` per server
    (inference/sglang_launch.py), which starts `python -m sglang.launch_server` with SGLang's
    flags; here that module is a shim serving the strict stand-in, so the whole path (config,
    plan, launcher, SGLang's command line, health, weight sync, the roller's SGLang client) runs."""
    shim = tmp_path / "shim" / "sglang"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    (shim / "launch_server.py").write_text(SHIM)
    env = {
        **os.environ,
        "AGENTRL_SGLANG_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "shim"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}",
         f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0", "--learner.max_steps=2",
         "--learner.groups_per_step=2", "--learner.batch_timeout_s=0.5", "--inference.type=sglang",
         "--weight_sync.backend=gloo", "--weight_sync.timeout_s=30", "--weight_sync.bucket_mb=1",
         "--roller.group_size=2", "--roller.max_new_tokens=16", "--roller.max_turns=2",
         f"--queue.address=tcp://127.0.0.1:{find_free_port()}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    (argv_file,) = shim.glob("argv-*.json")
    argv = json.loads(argv_file.read_text())
    assert (
        argv[argv.index("--model-path") + 1] == str(tiny_model)
        and argv[argv.index("--weight-version") + 1] == "0"
    )
    steps = [json.loads(line) for line in (run_dir / "learner.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["sync/servers_updated"] == 1 for s in steps)
    logs = run_dir / "logs"
    assert "SGLang is healthy on" in (logs / "server0.log").read_text()
    assert "has the weight-update session API" in (logs / "learner.log").read_text()  # SGLang's admin path
    assert "served its first request" in (logs / "roller0.log").read_text()
