"""Every weight push is a transaction: failures injected at each step, embedded servers.

Two real `agentrl serve` processes on the tiny model (one pair for the module); server A sits
behind a loopback proxy (tests/fault_proxy.py) that answers 5xx to the request a test names.
Failure points: group set-up, bucket k of n (first, middle, last; refused before the server
sees it, or its reply lost after the server staged it), the commit, the version read-back; a
server SIGSTOP'd mid-push; `transactional: all`; last, a dead server. After each push no
exception has reached the caller, and for every server: the version it reads back now equals
the one the learner recorded for it, it is not left paused, and its log-probs are those of
the weights of that version (the embedded server stages buckets, so an aborted push leaves it
whole on its previous weights)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from agentrl.config import BroadcastSyncConfig, InferenceConfig
from agentrl.weight_sync.base import Resident
from agentrl.weight_sync.registry import create
from tests.conftest import Processes, find_free_port
from tests.fault_proxy import FaultProxy
from tests.integration.test_weight_sync import learner_logprobs, perturb, server_probe, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TIMEOUT_S = 5.0
BUCKET = "/update_weights_from_distributed"


class Fleet:
    """The module's two servers (A behind the proxy), the learner's model and its history."""

    def __init__(self, model_dir: Path, processes: Processes) -> None:
        self.model_dir = model_dir
        self.processes = processes
        self.ports = [find_free_port(), find_free_port()]
        self.procs = [
            self.processes.agentrl("serve", "--model", str(model_dir), "--port", str(p)) for p in self.ports
        ]
        self.direct = [f"http://127.0.0.1:{p}" for p in self.ports]
        wait_healthy(self.direct, timeout_s=120)
        self.proxy = FaultProxy(self.direct[0]).start()
        self.urls = [self.proxy.url, self.direct[1]]  # what the learner pushes to
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.version = 0
        self.states = {0: {k: v.clone() for k, v in self.model.state_dict().items()}}

    def engine(self, transactional: str = "any", bucket_mb: float = 0.1):
        config = BroadcastSyncConfig(bucket_mb=bucket_mb, timeout_s=TIMEOUT_S, transactional=transactional)
        engine = create(config, InferenceConfig(servers=self.urls, connect_timeout_s=2.0))
        engine.init()
        return engine

    def push(self, engine, resident: bool = False):
        """Train a step (perturb), push it; the stats of the push. `resident`: the tensors come as
        the learner's own (`Resident`: gathered whole, announced in one request per server)."""
        self.version += 1
        perturb(self.model, self.version)
        self.states[self.version] = {k: v.clone() for k, v in self.model.state_dict().items()}
        weights = {n: p.detach() for n, p in self.model.named_parameters()}
        if resident:
            return engine.push(lambda: Resident(weights.items()), self.version)
        return engine.push(lambda: iter(weights.items()), self.version)

    def check(self, stats, urls: list[str] | None = None) -> None:
        """Each server reads back the version the learner recorded for it, is not paused, and
        serves exactly the weights of that version."""
        for pushed, direct in zip(self.urls, self.direct, strict=True):
            if urls is not None and pushed not in urls:
                continue
            outcome = stats.outcomes[pushed]
            info = model_info(direct)
            assert int(info["weight_version"]) == outcome.version, (pushed, outcome, info)
            assert not info["paused"] and not outcome.paused, (pushed, outcome)
            version, output_ids, logprobs = server_probe(direct)
            assert version == outcome.version
            reference = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            reference.load_state_dict(self.states[version], strict=False)
            ours = learner_logprobs(reference, output_ids)
            assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 1e-4, (pushed, version)


def model_info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/model_info", timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def fleet(tiny_model: Path):
    processes = Processes()
    try:
        fleet = Fleet(tiny_model, processes)
        yield fleet
        fleet.proxy.stop()
    finally:
        processes.stop_all()


@pytest.fixture
def engine(fleet: Fleet):
    engines = []

    def make(transactional: str = "any", bucket_mb: float = 0.1):
        engines.append(fleet.engine(transactional, bucket_mb))
        return engines[-1]

    yield make
    fleet.proxy.clear()
    for e in engines:
        e.close()


def _buckets(fleet: Fleet) -> int:
    from agentrl.weight_sync.buckets import iter_buckets

    return sum(1 for _ in iter_buckets(fleet.model.named_parameters(), int(0.1 * (1 << 20))))


def at_bucket(k: int) -> str:
    """The body text of the k-th bucket's announcement (1-based; the embedded server takes the
    bucket's index, an agentrl extra that the client sends last)."""
    return f'"bucket": {k - 1}}}'


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_bucket_refused_twice_drops_only_that_server_and_it_is_resynced(fleet, engine, where) -> None:
    n = _buckets(fleet)
    assert n >= 3
    k = {"first": 1, "middle": n // 2 + 1, "last": n}[where]
    sync = engine()
    # bucket k fails in attempt 1 and in its redo (buckets are announced ahead of the broadcast,
    # so the failed attempt has announced more than k: counted by index, not by request)
    fleet.proxy.fail(BUCKET, nth=1, count=2, only_if=at_bucket(k))
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[b].committed and stats.outcomes[b].version == fleet.version
    assert not stats.outcomes[a].committed and stats.outcomes[a].version == fleet.version - 1
    assert "failed twice" in stats.outcomes[a].reason and stats.servers_updated == 1
    fleet.check(stats)
    fleet.proxy.clear()
    stats = fleet.push(sync)  # back up: it rejoins and is brought to the version
    assert all(o.committed for o in stats.outcomes.values()), stats.outcomes
    fleet.check(stats)


def test_a_lost_reply_on_the_last_bucket_is_redone_and_committed(fleet, engine) -> None:
    """The server staged the last bucket but the learner saw a 500: the attempt is aborted on
    both (nothing applied) and redone; both commit the version."""
    sync = engine()
    fleet.proxy.fail(BUCKET, nth=_buckets(fleet), status=502, forward=True)
    stats = fleet.push(sync)
    assert stats.attempts == 2 and all(o.committed for o in stats.outcomes.values()), stats.outcomes
    assert fleet.proxy.failed == [f"{BUCKET} 502 (after forwarding)"]
    fleet.check(stats)


def test_a_lost_reply_mid_push_closes_the_group_under_buckets_announced_ahead_and_is_redone(
    fleet, engine, caplog
) -> None:
    """The first bucket's reply is lost (the server staged it); the learner sees that only after
    the second bucket's broadcast, when later buckets were already announced from the gather
    thread: their receives are released by closing the group (not left to time out), and the
    push is redone and committed on both."""
    sync = engine()
    assert _buckets(fleet) >= 3
    fleet.proxy.fail(BUCKET, nth=1, count=1, status=502, forward=True, only_if=at_bucket(1))
    with caplog.at_level("WARNING", logger="agentrl.weight_sync.broadcast"):
        stats = fleet.push(sync)
    assert stats.attempts == 2 and all(o.committed for o in stats.outcomes.values()), stats.outcomes
    assert fleet.proxy.failed == [f"{BUCKET} 502 (after forwarding)"]
    assert any("announced were never broadcast" in r.getMessage() for r in caplog.records)
    fleet.check(stats)


def test_a_push_to_the_embedded_server_pauses_in_begin_and_continues_and_reads_back_in_the_commit(
    fleet, engine
) -> None:
    """From the second push on (the first begin's reply says `session_control`), a push to the
    embedded server makes no /pause_generation, /continue_generation or version read of its own:
    begin pauses, the commit continues and answers the version, which the outcome is judged by."""
    sync = engine()
    fleet.check(fleet.push(sync))
    fleet.proxy.requests.clear()
    stats = fleet.push(sync)
    paths = [path for path, _ in fleet.proxy.requests]
    assert "/pause_generation" not in paths and "/continue_generation" not in paths, paths
    begin = [body for path, body in fleet.proxy.requests if path == "/begin_weight_update"]
    end = [body for path, body in fleet.proxy.requests if path == "/end_weight_update"]
    assert [json.loads(b) for b in begin] == [{"pause_generation": True}]
    assert [json.loads(b) for b in end] == [{"continue_generation": True}]
    assert all(o.committed for o in stats.outcomes.values()), stats.outcomes
    fleet.check(stats)


def test_a_resident_push_is_announced_in_one_request_and_a_lost_reply_to_it_is_redone(fleet, engine) -> None:
    """The learner's own tensors (`Resident`) are gathered whole and announced to the embedded
    server in one request (`more`: the buckets after the first, packed only as they are sent);
    its reply covers them all. That reply lost (after forwarding): the attempt fails at the last
    bucket, the push is redone and commits on both servers, every byte intact."""
    sync = engine(bucket_mb=0.03)  # a dozen buckets of one size: the packer reuses its slots
    fleet.proxy.requests.clear()
    stats = fleet.push(sync, resident=True)
    announced = [json.loads(body) for path, body in fleet.proxy.requests if path == BUCKET]
    assert len(announced) == 1 and announced[0]["bucket"] == 0, announced
    assert 1 + len(announced[0]["more"]) == stats.buckets > 6  # over twice the packer's three slots
    assert stats.attempts == 1
    fleet.check(stats)
    fleet.proxy.fail(BUCKET, nth=1, status=502, forward=True)
    stats = fleet.push(sync, resident=True)
    assert stats.attempts == 2 and all(o.committed for o in stats.outcomes.values()), stats.outcomes
    assert fleet.proxy.failed == [f"{BUCKET} 502 (after forwarding)"]
    fleet.check(stats)


def test_a_refused_commit_leaves_that_server_whole_on_its_previous_version(fleet, engine) -> None:
    sync = engine()
    fleet.proxy.fail("/end_weight_update", nth=1, skip_if="abort", status=503)
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[b].committed and not stats.outcomes[a].committed, stats.outcomes
    assert "commit failed" in stats.outcomes[a].reason and stats.outcomes[a].version == fleet.version - 1
    fleet.check(stats)
    fleet.proxy.clear()
    fleet.check(fleet.push(sync))


def test_a_failed_version_read_back_is_recorded_as_unknown_never_as_committed(fleet, engine) -> None:
    sync = engine()
    # A commits, but the reply (which carries the version it serves) is lost, and from then on its
    # /model_info answers 500: the learner cannot verify the commit
    fleet.proxy.fail(
        "/end_weight_update",
        nth=1,
        skip_if="abort",
        status=503,
        forward=True,
        on_request=lambda: fleet.proxy.fail("/model_info", nth=1, count=10**6),
    )
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[b].committed
    outcome = stats.outcomes[a]
    assert not outcome.committed and outcome.version is None and "reading its version back" in outcome.reason
    assert not model_info(fleet.direct[0])["paused"]  # resumed: a staging server's weights are whole
    fleet.check(stats, urls=[b])
    fleet.proxy.clear()
    fleet.check(fleet.push(sync))


def test_a_group_set_up_refused_drops_that_server_from_the_push(fleet, engine) -> None:
    fleet.proxy.fail("/init_weights_update_group", nth=1, count=2)  # at start-up, then at the rejoin
    sync = engine()
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[b].committed and not stats.outcomes[a].committed, stats.outcomes
    assert "joining the weight group failed" in stats.outcomes[a].reason
    fleet.check(stats)
    fleet.check(fleet.push(sync))


def test_transactional_all_keeps_every_server_on_the_previous_version(fleet, engine) -> None:
    sync = engine("all")
    fleet.proxy.fail(BUCKET, nth=1, count=2, only_if=at_bucket(2))  # in the attempt and its redo
    stats = fleet.push(sync)
    assert stats.servers_updated == 0 and stats.servers_dropped == [], stats.outcomes
    for outcome in stats.outcomes.values():
        assert not outcome.committed and outcome.version == fleet.version - 1
        assert "aborted for every server" in outcome.reason
    fleet.check(stats)
    fleet.proxy.clear()
    fleet.check(fleet.push(sync))


def test_a_server_stopped_mid_push_is_dropped_and_resynced_once_it_answers(fleet, engine) -> None:
    """SIGSTOP server B when A's second bucket arrives, SIGCONT it later than the push's
    timeouts: the push completes on A without raising; B, once it answers, is brought to the
    version by the next push."""
    sync = engine()
    stopped = fleet.procs[1].pid

    def stop() -> None:
        os.kill(stopped, signal.SIGSTOP)
        threading.Timer(3 * TIMEOUT_S, os.kill, (stopped, signal.SIGCONT)).start()

    fleet.proxy.fail(BUCKET, nth=2, on_request=stop)
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[a].committed and not stats.outcomes[b].committed, stats.outcomes
    assert "stopped answering" in stats.outcomes[b].reason
    fleet.check(stats, urls=[a])
    wait_healthy(fleet.direct[1:], timeout_s=60)
    stats = fleet.push(sync)
    assert all(o.committed for o in stats.outcomes.values()), stats.outcomes
    fleet.check(stats)


def test_with_one_server_dead_a_refused_bucket_is_redone_on_the_other(fleet, engine) -> None:
    """Last in the module: kills server B."""
    sync = engine()
    fleet.procs[1].send_signal(signal.SIGKILL)
    fleet.procs[1].wait()
    fleet.proxy.fail(BUCKET, nth=2, count=1)
    stats = fleet.push(sync)
    a, b = fleet.urls
    assert stats.outcomes[a].committed and stats.attempts == 2, stats.outcomes
    assert not stats.outcomes[b].committed and stats.outcomes[b].version is None
    fleet.check(stats, urls=[a])
