"""`BroadcastEngine` pushing into strict SGLang 0.5.23 stand-ins (tests/sglang_standin.py).

The stand-ins build their gloo group with torch's `_new_process_group_helper`, as SGLang's
`init_custom_process_group` does, and receive through the group's cuda backend, as a GPU
SGLang does: so these pushes show the learner's group reaches a GPU SGLang. Every push runs
inside begin/end (balanced on every path), buckets travel flattened where the server takes
it, and a server that fails a bucket midway is dropped, left out of generation with its
session closed, and brought back with full weights at the next push."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import pytest
import torch

from agentrl.config import BroadcastSyncConfig, InferenceConfig
from agentrl.inference.sglang import SGLangClient
from agentrl.weight_sync.registry import create
from tests.conftest import find_free_port
from tests.sglang_standin import digest

pytestmark = pytest.mark.slow


@dataclass
class StandIn:
    """One stand-in process (torch names process groups per process, so one per server)."""

    url: str
    proc: subprocess.Popen

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/_standin/state", timeout=10) as reply:
            return json.loads(reply.read())

    def fail_updates(self, count: int = 1) -> None:
        body = json.dumps({"count": count}).encode()
        urllib.request.urlopen(
            urllib.request.Request(f"{self.url}/_standin/fail_updates", body, method="POST")
        )


def start_standin(processes, *flags: str) -> StandIn:
    port = find_free_port()
    cmd = [sys.executable, "-m", "tests.sglang_standin", "--port", str(port), *flags]
    proc = processes.start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/ping", timeout=2)
            return StandIn(url, proc)
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"stand-in exited with {proc.returncode}") from None
            time.sleep(0.2)
    raise TimeoutError(f"stand-in at {url} did not answer /ping")


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 8, generator=gen),
        "norm.weight": torch.randn(7, generator=gen).to(
            torch.bfloat16
        ),  # 14 bytes: the next fp32 is unaligned
        "layer.0.weight": torch.randn(8, 8, generator=gen),
        "layer.1.weight": torch.randn(8, 8, generator=gen).to(torch.bfloat16),
        "head.weight": torch.randn(64, 8, generator=gen),
    }


def _engine(urls: list[str]):
    engine = create(
        BroadcastSyncConfig(backend="gloo", bucket_mb=1, timeout_s=20),
        InferenceConfig(type="sglang", servers=urls),
    )
    engine.init()
    return engine


def _balanced(state: dict) -> bool:
    calls = state["calls"]
    return calls.count("/begin_weight_update") == calls.count("/end_weight_update") and not state["session"]


@pytest.fixture
def standins(processes):
    return [start_standin(processes) for _ in range(2)]


def _assert_pushed(server: StandIn, weights: dict[str, torch.Tensor], version: int) -> None:
    state = server.state()
    assert state["weight_version"] == str(version) and not state["paused"] and _balanced(state), state
    assert state["weights"] == {name: digest(t) for name, t in weights.items()}
    assert not state["refused"], state["refused"]


def test_pushes_run_inside_a_session_and_reach_every_server(standins) -> None:
    engine = _engine([s.url for s in standins])
    try:
        for version in (1, 2):
            weights = _weights(version)
            stats = engine.push(lambda w=weights: iter(w.items()), version)
            assert stats.servers_updated == 2 and stats.servers_dropped == []
            for server in standins:
                _assert_pushed(server, weights, version)
        # one bucket of 5 tensors whose fp32 after the 14-byte bf16 is unaligned: sent one by one
        assert stats.buckets == 1 and stats.broadcasts == 5
    finally:
        engine.close()


def test_aligned_buckets_travel_as_one_flattened_broadcast(standins) -> None:
    engine = _engine([s.url for s in standins])
    weights = {k: v for k, v in _weights(3).items() if k != "norm.weight"}
    try:
        stats = engine.push(lambda: iter(weights.items()), 1)
        assert stats.buckets == 1 and stats.broadcasts == 1
        for server in standins:
            _assert_pushed(server, weights, 1)
    finally:
        engine.close()


def test_a_bucket_failing_midway_keeps_sessions_balanced_and_the_server_comes_back(standins) -> None:
    good, bad = standins
    engine = _engine([good.url, bad.url])
    try:
        engine.push(lambda: iter(_weights(1).items()), 1)
        # one failed bucket on a live server: the push is redone with it, and it ends up complete
        bad.fail_updates(1)
        weights = _weights(2)
        stats = engine.push(lambda: iter(weights.items()), 2)
        assert stats.servers_updated == 2 and stats.servers_dropped == [] and stats.attempts == 2
        for server in standins:
            _assert_pushed(server, weights, 2)

        async def serves() -> int:
            async with SGLangClient(bad.url) as client:
                return (await client.generate([1, 2], {"max_new_tokens": 3})).weight_version

        assert asyncio.run(serves()) == 2
        # failing the redo too: dropped, session closed, kept paused (its weights are a mix)
        bad.fail_updates(2)
        weights = _weights(3)
        stats = engine.push(lambda: iter(weights.items()), 3)
        assert stats.servers_updated == 1 and stats.servers_dropped == [bad.url] and stats.attempts == 3
        _assert_pushed(good, weights, 3)
        state = bad.state()
        assert _balanced(state) and state["paused"]
        weights = _weights(4)
        stats = engine.push(lambda: iter(weights.items()), 4)  # alive (/ping) while paused: it rejoins
        assert stats.servers_updated == 2 and stats.servers_dropped == []
        for server in standins:
            _assert_pushed(server, weights, 4)
        assert asyncio.run(serves()) == 4
    finally:
        engine.close()


def test_an_older_sglang_without_the_session_routes_is_pushed_to_tensor_by_tensor(processes) -> None:
    old = start_standin(processes, "--no-session-api")
    engine = _engine([old.url])
    weights = {k: v for k, v in _weights(4).items() if k != "norm.weight"}
    try:
        stats = engine.push(lambda: iter(weights.items()), 1)
        assert stats.servers_updated == 1 and stats.broadcasts == len(weights)
        state = old.state()
        assert state["weight_version"] == "1" and state["weights"] == {
            n: digest(t) for n, t in weights.items()
        }
        assert "/begin_weight_update" in state["calls"] and engine.clients[old.url].has_session is False
    finally:
        engine.close()


def test_servers_follow_the_live_list_a_new_one_catches_up_a_removed_one_leaves(
    standins, tmp_path, caplog
) -> None:
    """The launcher's live list (`inference.server_list`): a server added to it is behind until
    the catch-up push gives it the current weights (logged as added, not as up again); one
    removed from it is pushed to no more."""
    from agentrl.inference import server_list

    first, second = standins
    path = tmp_path / "servers.json"
    server_list.write(path, 1, [first.url])
    engine = create(
        BroadcastSyncConfig(backend="gloo", bucket_mb=1, timeout_s=20),
        InferenceConfig(type="sglang", servers=[first.url]),
        servers_file=path,
    )
    engine.init()
    try:
        w1 = _weights(1)
        assert engine.push(lambda: iter(w1.items()), 1).servers_updated == 1
        server_list.write(path, 2, [first.url, second.url])
        deadline = time.monotonic() + 30  # the next probe round sees the new server
        while (late := engine.behind(1)) != [second.url]:
            assert time.monotonic() < deadline, late
            time.sleep(0.1)
        with caplog.at_level("INFO", logger="agentrl.weight_sync.membership"):
            stats = engine.push(lambda: iter(w1.items()), 1)  # the learner loop's catch-up push
        assert stats.servers_updated == 2 and engine.members == [first.url, second.url]
        said = [r.getMessage() for r in caplog.records]
        assert f"servers ['{second.url}'] added: rebuilding the weight group with them" in said, said
        assert not any("up again" in m for m in said), said
        _assert_pushed(second, w1, 1)
        server_list.write(path, 3, [second.url])
        w2 = _weights(2)
        stats = engine.push(lambda: iter(w2.items()), 2)
        assert stats.servers_updated == 1 and engine.members == [second.url] and stats.servers_dropped == []
        _assert_pushed(second, w2, 2)
        assert first.state()["weight_version"] == "1" and first.url not in engine.clients
    finally:
        engine.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_bucket_refused_with_400_twice_is_recorded_truly_and_resynced(processes, where) -> None:
    """SGLang loads each bucket as it arrives: a server whose bucket k of n is refused (a 400
    from a proxy in front of it, every server alive) on the attempt and on its redo is dropped,
    its version read back is the one recorded for it (the version travels with the last bucket
    only, so a partial update never carries it), and it is kept paused (its weights may be a
    mix) until the next push brings it back; the other server commits."""
    from agentrl.weight_sync.buckets import iter_buckets
    from tests.fault_proxy import FaultProxy

    good, bad = start_standin(processes), start_standin(processes)
    proxy = FaultProxy(bad.url).start()
    engine = create(
        BroadcastSyncConfig(backend="gloo", bucket_mb=0.001, timeout_s=3),
        InferenceConfig(type="sglang", servers=[good.url, proxy.url], connect_timeout_s=2.0),
    )
    engine.init()
    try:
        engine.push(lambda: iter(_weights(1).items()), 1)
        n = sum(1 for _ in iter_buckets(_weights(2).items(), int(0.001 * (1 << 20))))
        assert n == 3  # embed | norm + layer.0 + layer.1 | head
        k = {"first": 1, "middle": 2, "last": n}[where]
        proxy.fail("/update_weights_from_distributed", nth=k, count=1, status=400)
        proxy.fail("/update_weights_from_distributed", nth=2 * k, count=1, status=400)
        weights = _weights(2)
        stats = engine.push(lambda: iter(weights.items()), 2)
        assert stats.buckets == n and stats.outcomes[good.url].committed
        _assert_pushed(good, weights, 2)
        outcome, state = stats.outcomes[proxy.url], bad.state()
        assert not outcome.committed and "failed twice" in outcome.reason and outcome.paused, outcome
        assert state["weight_version"] == str(outcome.version) == "1" and state["paused"], state
        assert _balanced(state)
        proxy.clear()
        weights = _weights(3)
        stats = engine.push(lambda: iter(weights.items()), 3)
        assert all(o.committed and not o.paused for o in stats.outcomes.values()), stats.outcomes
        for server in (good, bad):
            _assert_pushed(server, weights, 3)
    finally:
        engine.close()
        proxy.stop()


def test_a_lost_commit_reply_is_judged_by_the_version_read_back_and_a_stopped_server_comes_back(
    processes,
) -> None:
    """A proxy loses `/end_weight_update`'s reply (the stand-in never sees it): the version read
    back decides (committed), and the session left open is closed. Then the other stand-in is
    SIGSTOP'd when the first bucket reaches the proxied one: the push completes on the proxied
    one without raising and drops the stopped one; continued, it is brought back by the next push
    (its stale session closed first)."""
    import os
    import signal
    import threading

    from tests.fault_proxy import FaultProxy

    proxied, other = start_standin(processes), start_standin(processes)
    proxy = FaultProxy(proxied.url).start()
    engine = create(
        BroadcastSyncConfig(backend="gloo", bucket_mb=0.001, timeout_s=3),
        InferenceConfig(type="sglang", servers=[proxy.url, other.url], connect_timeout_s=1.0),
    )
    engine.init()
    try:
        proxy.fail("/end_weight_update", nth=1, skip_if="abort", status=503)
        weights = _weights(1)
        stats = engine.push(lambda: iter(weights.items()), 1)
        assert all(o.committed and not o.paused for o in stats.outcomes.values()), stats.outcomes
        for server in (proxied, other):
            _assert_pushed(server, weights, 1)
        proxy.clear()

        def stop() -> None:
            os.kill(other.proc.pid, signal.SIGSTOP)
            threading.Timer(4 * 3, os.kill, (other.proc.pid, signal.SIGCONT)).start()

        proxy.fail("/update_weights_from_distributed", nth=1, on_request=stop)
        weights = _weights(2)
        stats = engine.push(lambda: iter(weights.items()), 2)
        assert stats.outcomes[proxy.url].committed, stats.outcomes
        assert (
            not stats.outcomes[other.url].committed
            and "stopped answering" in stats.outcomes[other.url].reason
        )
        _assert_pushed(proxied, weights, 2)
        deadline = time.monotonic() + 60
        while True:  # continued: it answers again
            try:
                state = other.state()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.5)
        # recorded as unknown (it did not answer); it holds v1 (the version travels with the last bucket)
        # and stays paused, as it was when it stopped, until the next push re-syncs it
        assert (
            stats.outcomes[other.url].version is None and state["weight_version"] == "1" and state["paused"]
        )
        weights = _weights(3)
        stats = engine.push(lambda: iter(weights.items()), 3)
        assert all(o.committed and not o.paused for o in stats.outcomes.values()), stats.outcomes
        _assert_pushed(proxied, weights, 3)
        state = other.state()  # its session from the interrupted push was refused once, then closed
        assert state["refused"] == ["a weight-update session is already open; call end_weight_update() first"]
        assert state["weight_version"] == "3" and not state["paused"] and not state["session"], state
        assert state["weights"] == {name: digest(t) for name, t in weights.items()}
    finally:
        engine.close()
        proxy.stop()
