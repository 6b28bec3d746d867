"""`agentrl run` with every Prometheus port set to 0: while the run trains, the learner's, the
hosted queue's and the roller's endpoints are scraped (parsed with prometheus_client's parser)
and checked against the run's own records; when the run is stopped, every endpoint goes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
from pathlib import Path

import pytest

from agentrl.log import read_metrics
from tests.conftest import REPO, find_free_port
from tests.unit.observe.test_prometheus import one, scrape

pytestmark = [pytest.mark.slow, pytest.mark.integration]
pytest.importorskip("prometheus_client", reason="pip install 'agentrl[prometheus]'")

ROLES = ("learner", "queue", "roller-0")


def test_a_run_serves_learner_queue_and_roller_metrics_until_it_stops(
    tiny_model: Path, tmp_path: Path
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart.yaml", f"--run_dir={tmp_path}",
         f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0", "--learner.max_steps=1000",
         "--learner.groups_per_step=2", "--roller.group_size=4", "--roller.max_turns=2", "--max_staleness=1",
         f"--queue.address=tcp://127.0.0.1:{find_free_port()}", "--prometheus.learner_port=0",
         "--prometheus.queue_port=0", "--prometheus.roller_port=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    files = {role: tmp_path / "prometheus" / f"{role}.port" for role in ROLES}
    try:
        deadline = time.monotonic() + 300
        while not all(f.exists() for f in files.values()):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run's processes wrote no Prometheus port files in 300 s"
            time.sleep(1)
        ports = {role: int(f.read_text()) for role, f in files.items()}
        while (learner := scrape(ports["learner"])).get(("agentrl_learner_version", ()), 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the learner did not reach version 2"
            time.sleep(1)
        queue, roller = scrape(ports["queue"]), scrape(ports["roller-0"])
        records = read_metrics(tmp_path / "learner.jsonl")
        roller_after = scrape(ports["roller-0"])
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the learner's figures are those it logged for the steps it reported (one record per step,
    # each logged before the endpoint hears of it; a skipped step repeats its version)
    steps = int(one(learner, "agentrl_learner_steps_total"))
    logged = records[:steps]
    assert len(logged) == steps and logged[-1]["step"] == one(learner, "agentrl_learner_version")
    version = logged[-1]["step"]
    if "tokens_per_s" in logged[-1]:
        assert one(learner, "agentrl_learner_tokens_per_second") == pytest.approx(logged[-1]["tokens_per_s"])
    pushes = [r["sync/push_s"] for r in logged if "sync/push_s" in r]
    assert one(learner, "agentrl_learner_push_seconds_count") == len(pushes) == version
    assert one(learner, "agentrl_learner_push_seconds_sum") == pytest.approx(sum(pushes))
    staleness = sum(n for r in logged for k, n in r.items() if k.startswith("staleness/"))
    assert one(learner, "agentrl_learner_staleness_count") == staleness > 0  # trained groups only
    # the queue it hosts: at or past that version, its admission limit (v + k + 1) × groups_per_step
    queue_version = one(queue, "agentrl_queue_version")
    assert queue_version >= version
    assert one(queue, "agentrl_queue_admission_limit") == (queue_version + 1 + 1) * 2
    assert one(queue, "agentrl_queue_events_total", event="groups_in") >= 2 * version
    # the roller: its puts reached the queue; its episodes make whole groups
    put = one(roller, "agentrl_roller_groups_put_total")
    assert put >= 2 * version and one(roller, "agentrl_roller_episodes_total") >= 4 * put
    assert one(roller_after, "agentrl_roller_groups_put_total") >= put
    # each put's staleness is counted once the queue has told the roller its version, after the put
    assert (
        0
        < one(roller, "agentrl_roller_staleness_at_put_count")
        <= one(roller_after, "agentrl_roller_groups_put_total")
    )
    for role, f in files.items():  # stopped with their processes
        assert not f.exists(), role
        with pytest.raises(urllib.error.URLError):
            scrape(ports[role])


def test_a_colocated_run_serves_the_learner_metrics_until_it_stops(tiny_model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "run", "--config", "recipes/quickstart_colocated.yaml",
         f"--run_dir={tmp_path}", f"--learner.model_path={tiny_model}", "--learner.warmstart.steps=0",
         "--learner.max_steps=1000", "--learner.groups_per_step=2", "--roller.group_size=2",
         "--roller.max_new_tokens=8", "--prometheus.learner_port=0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    port_file = tmp_path / "prometheus" / "learner.port"
    try:
        deadline = time.monotonic() + 300
        while not port_file.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the colocated run wrote no Prometheus port file in 300 s"
            time.sleep(1)
        port = int(port_file.read_text())
        while (learner := scrape(port)).get(("agentrl_learner_version", ()), 0) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the learner did not reach version 2"
            time.sleep(1)
        records = read_metrics(tmp_path / "learner.jsonl")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    steps = int(one(learner, "agentrl_learner_steps_total"))
    logged = records[:steps]
    assert len(logged) == steps and logged[-1]["step"] == one(learner, "agentrl_learner_version") >= 2
    staleness = sum(n for r in logged for k, n in r.items() if k.startswith("staleness/"))
    assert one(learner, "agentrl_learner_staleness_count") == staleness > 0
    assert one(learner, "agentrl_learner_staleness_bucket", le="0.0") == staleness  # on-policy: all 0
    assert one(learner, "agentrl_learner_push_seconds_count") == 0  # colocated pushes no weights
    # the endpoint went with its rank; the ranks die of torchrun's SIGTERM without their cleanup,
    # so the port file stays behind, stale (as after a kill -9 of any process)
    with pytest.raises(urllib.error.URLError):
        scrape(port)
