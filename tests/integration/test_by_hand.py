"""The run `agentrl run` does, with each component started by hand as on separate nodes:
`agentrl serve`, then `agentrl learner` (hosting the queue, pushing weights to the server), then
`agentrl roller`, each given the others' addresses on its command line and nothing else."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from agentrl.net import wait_healthy
from tests.conftest import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _log(path: Path):
    return path.open("wb")


def test_learner_roller_and_server_started_by_hand_close_the_loop(
    processes, tiny_model: Path, tmp_path: Path
):
    env = {**os.environ, "AGENTRL_QUEUE_SECRET": "a-secret-shared-by-hand-0123456789", "OMP_NUM_THREADS": "1"}
    http, queue = find_free_port(), find_free_port()
    url, address = f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{queue}"
    recipe = ["--config", "recipes/quickstart.yaml", f"--learner.model_path={tiny_model}"]

    # node B: an inference server
    server = processes.agentrl("serve", "--model", str(tiny_model), "--port", str(http), env=env,
                               stdout=_log(tmp_path / "serve.log"), stderr=-2)  # fmt: skip
    wait_healthy([url], [server])
    # node A: the learner, hosting the queue, told where the server is
    learner = processes.agentrl(
        "learner", *recipe, f"--run_dir={tmp_path / 'learner'}", "--learner.warmstart.steps=0",
        "--learner.max_steps=3", "--learner.groups_per_step=2", f"--queue.address={address}",
        "--inference.servers", f"[{url}]", env=env, stdout=_log(tmp_path / "learner.log"), stderr=-2,
    )  # fmt: skip
    # node B: a roller, told where the queue and the server are
    roller_proc = processes.agentrl(
        "roller", *recipe, f"--run_dir={tmp_path / 'roller'}", "--queue", address, "--servers", url,
        "--roller.group_size=4", "--roller.max_turns=2", "--roller.max_concurrent_episodes=16",
        env=env, stdout=_log(tmp_path / "roller.log"), stderr=-2,
    )  # fmt: skip

    assert learner.wait(timeout=300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
    rows = read_metrics(tmp_path / "learner" / "learner.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["sync/servers_updated"] == 1 and r["sync/servers_dropped"] == 0 for r in rows)
    with urllib.request.urlopen(f"{url}/get_weight_version", timeout=10) as reply:
        assert str(json.loads(reply.read())["weight_version"]) == "3"  # the server has the last push
    queue_final = json.loads((tmp_path / "learner" / "queue_final.json").read_text())
    assert queue_final["groups_out"] >= 6 and queue_final["refused_auth"] == 0
    roller_proc.send_signal(signal.SIGTERM)  # the job is done: stop the roller as an operator would
    assert roller_proc.wait(timeout=60) in (0, -signal.SIGTERM, 130, 143)
    roller = read_metrics(tmp_path / "roller" / "roller.jsonl")
    assert roller and roller[-1]["roller/version_regressions"] == 0
    assert max(r.get("roller/version", 0) for r in roller) >= 1  # the roller saw the learner's pushes
