"""The Prometheus `/metrics` endpoints, scraped over real HTTP and parsed with prometheus_client's
own parser (`text_string_to_metric_families`): each value is checked against the state of the
component it reports (the learner after three steps, a real ZeroMQ queue server holding groups,
a roller after its groups went to that queue, the embedded inference server after a generate)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest

pytest.importorskip("prometheus_client", reason="pip install 'agentrl[prometheus]'")
from prometheus_client.parser import text_string_to_metric_families

from agentrl.config import AgentRLConfig, ZmqQueueConfig
from agentrl.learner.loop import build_learner, run
from agentrl.learner.main import open_prometheus
from agentrl.log import MetricsLogger, read_metrics
from agentrl.observe.prometheus import LearnerExporter, RollerCollector, serve
from agentrl.queue.registry import create as create_queue
from agentrl.weight_sync.base import PushStats
from tests.conftest import find_free_port
from tests.unit.learner.source import ListSource, learner_config, make_groups
from tests.unit.queue.conftest import make_group, put_all


def parse(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one exposition."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def one(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


class Pushes:
    """Weight sync's outside edge: records each push and reports it as the engines do."""

    def __init__(self) -> None:
        self.seconds: list[float] = []

    def push(self, weights, version: int) -> PushStats:
        self.seconds.append(0.01 * version)
        return PushStats(version, seconds=self.seconds[-1], bytes=1000, servers_updated=1)


def test_learner_endpoint_reports_the_steps_run(tiny_model: Path, tmp_path: Path) -> None:
    cfg = learner_config(model_path=str(tiny_model), groups_per_step=2, max_steps=3, micro_batch_tokens=64,
                         lr=1e-3, batch_timeout_s=0.1)  # fmt: skip
    learner = build_learner(cfg, tmp_path)
    exporter = LearnerExporter()
    endpoint = serve(exporter, 0, tmp_path, "learner")
    try:
        assert scrape(endpoint.port)[("agentrl_learner_steps_total", ())] == 0
        metrics, sync = MetricsLogger(tmp_path), Pushes()
        run(learner, ListSource(make_groups(6)), 1, sync, metrics, exporter=exporter)
        metrics.close()
        got = scrape(endpoint.port)
    finally:
        endpoint.stop()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert one(got, "agentrl_learner_steps_total") == 3 and one(got, "agentrl_learner_version") == 3
    assert one(got, "agentrl_learner_tokens_per_second") == pytest.approx(rows[-1]["tokens_per_s"])
    assert one(got, "agentrl_learner_push_seconds_count") == 3
    assert one(got, "agentrl_learner_push_seconds_sum") == pytest.approx(sum(sync.seconds))
    # the staleness histogram holds what the learner logged as staleness/<k>, step by step
    logged: dict[int, float] = {}
    for row in rows:
        for key, n in row.items():
            if key.startswith("staleness/"):
                logged[int(key.split("/")[1])] = logged.get(int(key.split("/")[1]), 0) + n
    assert logged == {0: 2, 1: 2, 2: 2}  # groups made at version 0, trained at versions 0, 1, 2
    for bound in (0, 1, 2, 16):
        below = sum(n for k, n in logged.items() if k <= bound)
        assert one(got, "agentrl_learner_staleness_bucket", le=str(float(bound))) == below
    assert one(got, "agentrl_learner_staleness_count") == 6
    assert one(got, "agentrl_learner_staleness_sum") == 0 * 2 + 1 * 2 + 2 * 2
    assert not (tmp_path / "prometheus" / "learner.port").exists()  # stopped: its port file is gone
    with pytest.raises(urllib.error.URLError):
        scrape(endpoint.port)


def test_queue_endpoint_from_the_config_matches_the_server(tmp_path: Path) -> None:
    cfg = AgentRLConfig(run_dir=str(tmp_path), prometheus={"queue_port": 0, "learner_port": 0})
    qcfg = ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none")
    backend = create_queue(qcfg)
    server = backend.server(groups_per_step=2, max_staleness=1).start()
    exporter, endpoints = open_prometheus(cfg, server)
    try:
        ports = {
            role: int((tmp_path / "prometheus" / f"{role}.port").read_text()) for role in ("learner", "queue")
        }
        assert sorted(e.port for e in endpoints) == sorted(ports.values()) and exporter is not None
        put_all(backend.producer, [make_group(seed=i) for i in range(3)])
        got, state = scrape(ports["queue"]), server.metrics()
    finally:
        for endpoint in endpoints:
            endpoint.stop()
        server.stop()
    assert state["depth"] == 3 and state["bytes"] > 0
    assert one(got, "agentrl_queue_depth") == 3 and one(got, "agentrl_queue_bytes") == state["bytes"]
    assert one(got, "agentrl_queue_inflight") == 0 and one(got, "agentrl_queue_version") == 0
    for name, key in (("admission_credits_held", "leased"), ("admission_started", "started"),
                      ("admission_limit", "admission_limit"), ("leases", "leases")):  # fmt: skip
        assert one(got, f"agentrl_queue_{name}") == state[key], name
    assert one(got, "agentrl_queue_admission_limit") == (0 + 1 + 1) * 2
    assert one(got, "agentrl_queue_events_total", event="groups_in") == state["groups_in"] == 3
    assert not list((tmp_path / "prometheus").glob("*.port"))


async def test_roller_endpoint_counts_its_episodes_and_puts(tiny_model: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tests.unit.rollers.test_roller import _setup

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    _server, roller, _consumer, close = await _setup(
        tokenizer, groups_per_step=2, max_staleness=1, max_groups=2
    )
    endpoint = serve(RollerCollector(roller), 0, tmp_path, "roller-0")
    try:
        before = await asyncio.to_thread(scrape, endpoint.port)
        stats = await roller.run()
        got = await asyncio.to_thread(scrape, endpoint.port)
    finally:
        endpoint.stop()
        await close()
    assert one(before, "agentrl_roller_episodes_total") == 0
    assert stats.groups_put == 2 and stats.episodes == 6
    assert one(got, "agentrl_roller_groups_put_total") == 2 and one(got, "agentrl_roller_episodes_total") == 6
    assert (
        one(got, "agentrl_roller_groups_failed_total") == 0
        and one(got, "agentrl_roller_episodes_in_flight") == 0
    )
    assert one(got, "agentrl_roller_version") == stats.newest_version
    assert one(got, "agentrl_roller_admission_credits_held") == roller.producer.held
    assert one(got, "agentrl_roller_staleness_at_put_count") == 2
    assert one(got, "agentrl_roller_staleness_at_put_bucket", le="0.0") == sum(
        1 for s in stats.staleness_at_put if s == 0
    )


async def test_embedded_server_answers_metrics_on_its_port(tiny_model: Path) -> None:
    from tests.unit.inference.conftest import ServerThread

    server = ServerThread(tiny_model).start()
    try:
        async with aiohttp.ClientSession() as s:
            body = {"input_ids": [5, 17, 42], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
            async with s.post(server.url + "/generate", json=body) as r:
                assert r.status == 200
            for _ in range(100):  # the engine drops the finished request from its batch at its next turn
                if server.engine.num_running == 0:
                    break
                await asyncio.sleep(0.05)
            async with s.get(server.url + "/metrics") as r:
                assert r.status == 200 and r.content_type == "text/plain"
                got = parse(await r.text())
        engine = server.engine
        assert one(got, "agentrl_server_decode_steps_total") == engine.steps >= 3
        assert one(got, "agentrl_server_weight_version") == int(engine.weight_version)
        assert one(got, "agentrl_server_requests_running") == engine.num_running == 0
        assert one(got, "agentrl_server_paused") == 0
    finally:
        server.stop()


def test_agentrl_queue_serves_its_endpoint_while_it_runs(processes, tmp_path: Path) -> None:
    """The `agentrl queue` process: its endpoint comes up with it (port 0: the port file), reports
    the groups a producer put, and goes away when the process is stopped."""
    import os
    import signal
    import time

    port = find_free_port()
    proc = processes.agentrl(
        "queue", "--bind", f"tcp://127.0.0.1:{port}", f"--run_dir={tmp_path}", "--prometheus.queue_port=0",
        "--queue.auth=none", "--learner.groups_per_step=3", "--max_staleness=1",
    )  # fmt: skip
    port_file = tmp_path / "prometheus" / "queue.port"
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "agentrl queue wrote no Prometheus port file in 60 s"
        time.sleep(0.1)
    metrics_port = int(port_file.read_text())
    empty = scrape(metrics_port)
    assert one(empty, "agentrl_queue_depth") == 0 and one(empty, "agentrl_queue_version") == 0
    assert one(empty, "agentrl_queue_admission_limit") == (0 + 1 + 1) * 3
    backend = create_queue(ZmqQueueConfig(address=f"tcp://127.0.0.1:{port}", auth="none"))
    put_all(backend.producer, [make_group(seed=i) for i in range(2)])
    got = scrape(metrics_port)
    assert one(got, "agentrl_queue_depth") == 2 and one(got, "agentrl_queue_bytes") > 0
    assert one(got, "agentrl_queue_events_total", event="groups_in") == 2
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not port_file.exists()
    with pytest.raises(urllib.error.URLError):
        scrape(metrics_port)
