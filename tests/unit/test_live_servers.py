"""The launchers' live server list (`launch/servers.py`) under the Ray driver, with stand-in
actors (tests/unit/test_launcher.py's `_Ray`, mirroring the `ray` calls `RayRun` makes): a server
actor Ray restarts on another node goes on the list at its new address once it answers, and
`agentrl scale --servers M` adds actors for new slots and takes removed ones off the list; the
list reaches the learner through its actor's `write_servers` (nodes share no filesystem)."""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.launch import ray as ray_launch
from agentrl.launch import servers as live_servers
from tests.unit.test_launcher import _config, _Ray


class _ServerActor:
    """A server's `ProcessActor` as Ray restarts it: fresh (no process) until `start`, on the node
    `ip` (a restart may move it). `.remote` returns the answer, which `_Ray.get` hands back."""

    def __init__(self, ip: str) -> None:
        self.ip, self.fresh, self.started, self.stopped = ip, True, 0, False
        for name in ("where", "bind_port", "start", "poll", "stop"):
            setattr(self, name, type("M", (), {"remote": getattr(self, "_" + name)})())

    def _where(self) -> dict:
        return {"ip": self.ip, "node_id": self.ip.replace(".", "") * 4, "actor_pid": 1}

    def _bind_port(self, prefer: int = 0) -> int:
        return prefer or 4100 + self.started

    def _start(self, args: list, env: dict) -> int:
        self.args, self.fresh = args, False
        self.started += 1
        return 200 + self.started

    def _poll(self) -> dict:
        return {"started": not self.fresh, "code": None, "pid": 200 + self.started}

    def _stop(self, timeout_s: float = 30) -> int:
        self.stopped = True
        return 0


class _LearnerActor:
    def __init__(self) -> None:
        self.lists: list[tuple[str, int, list[str]]] = []
        self.write_servers = type("M", (), {"remote": lambda p, e, u, s=None: self.lists.append((p, e, u))})()


def _run(tmp_path: Path, monkeypatch, healthy: set[str]):
    from agentrl.launch import ray as ray_launch
    from agentrl.launch.plan import Addresses, plan

    config = _config(tmp_path, type="ray", restart_backoff_s=0.0)
    run = ray_launch.RayRun.__new__(ray_launch.RayRun)
    run.health = ray_launch.HealthWatch(0, 0)  # the health watchdog off
    run.ray, run.config, run.lc, run.run_dir = _Ray, config, config.launcher, tmp_path
    run.secrets, run.parked, run.learner_lost = {}, {}, False
    run.addrs = Addresses(["http://10.0.0.2:4001"], "tcp://10.0.0.1:5001")
    role = next(r for r in plan(config, tmp_path / "c.yaml", "m", []) if r.kind == "server")
    actor = _ServerActor("10.0.0.2")
    actor.fresh, actor.started = False, 1
    run.members = [ray_launch.Member(role, "server0", actor, {}, node="10.0.0.2", port=4001)]
    learner = _LearnerActor()
    run.live = live_servers.LiveServers(
        lambda e, u, s: learner.lists.append(("", e, u)), {"server0": run.addrs.servers[0]}
    )
    run.pending = live_servers.PendingServers(run.live)
    # no traffic off loopback: a server "answers" once the test says so
    monkeypatch.setattr(live_servers, "answers", lambda url, path="/health", **_: url in healthy)
    created: list[_ServerActor] = []

    def new_actor(role, name, restarts, **options):
        created.append(_ServerActor(f"10.0.0.{10 + len(created)}"))
        return created[-1]

    run._actor = new_actor
    return run, actor, learner, created


def test_a_server_ray_restarts_on_another_node_goes_on_the_list_at_its_new_address(tmp_path, monkeypatch):
    healthy: set[str] = set()
    run, actor, learner, _ = _run(tmp_path, monkeypatch, healthy)
    assert learner.lists == [("", 1, ["http://10.0.0.2:4001"])]
    actor.fresh, actor.ip = True, "10.0.0.7"  # its node was removed: Ray placed it on another
    assert run.supervise() is None  # the backoff (0 s) starts
    assert run.supervise() is None and actor.started == 2  # started again, on its old port there
    new = "http://10.0.0.7:4001"
    assert run.addrs.servers == [new]  # rollers started from now on get the new address
    run.tick()
    assert learner.lists[-1][1] == 1  # not on the list before it answers /health
    healthy.add(new)
    run.tick()
    assert learner.lists[-1] == ("", 2, [new])


def test_scale_servers_adds_actors_for_new_slots_and_takes_removed_ones_off_the_list(tmp_path, monkeypatch):
    healthy: set[str] = set()
    run, _, learner, created = _run(tmp_path, monkeypatch, healthy)
    assert run.scale({"servers": 3}) == "servers 3"
    urls = [f"http://10.0.0.{10 + i}:{4100}" for i in range(2)]
    assert [m.name for m in run.members] == ["server0", "server1", "server2"] and len(created) == 2
    assert run.addrs.servers == ["http://10.0.0.2:4001", *urls]
    healthy.update(urls)
    run.tick()
    assert learner.lists[-1][2] == ["http://10.0.0.2:4001", *urls] and learner.lists[-1][1] == 3
    assert run.scale({"servers": 1}) == "servers 1"
    assert learner.lists[-1] == ("", 5, ["http://10.0.0.2:4001"]) and all(a.stopped for a in created)
    assert run.scale({"servers": 2}) == "servers 2"  # a stopped slot comes back on a new actor, its old port
    assert created[-1].args[created[-1].args.index("--port") + 1] == "4100"
    assert run.scale({"servers": 0}).startswith("servers 2 (a run keeps at least one")


def test_an_env_service_ray_restarts_on_another_node_reaches_the_rollers_at_its_new_address(
    tmp_path, monkeypatch
):
    """Search-R1's retriever (a service role) back on another node: once it answers its health
    path the live map names it there (published to the learner's node, carried on to the
    rollers by the queue), and a roller started after that is given the new URL (its flag after
    the plan's, so it wins)."""
    from agentrl.config import parse_overrides
    from agentrl.launch.plan import roller_role, service_roles

    run, _, _, _ = _run(tmp_path, monkeypatch, set())
    env = {"name": "search_r1", "kwargs": {"retriever_url": "auto"}}
    run.config = _config(tmp_path, env=env, type="ray", restart_backoff_s=0.0)
    (role,) = service_roles(run.config)
    service = _ServerActor("10.0.0.3")
    service.fresh, service.started = False, 1
    old_flag = role.override("10.0.0.3", 4200)
    roller = _ServerActor("10.0.0.4")
    roller.fresh, roller.started = False, 1
    run.members = [
        ray_launch.Member(role, "retriever", service, {}, node="10.0.0.3", port=4200),
        ray_launch.Member(
            roller_role(run.config, ["--config", "c.yaml", old_flag], 0), "roller0", roller, {}
        ),
    ]
    published: list[tuple] = []
    run.live = live_servers.LiveServers(lambda e, u, s: published.append((e, u, s)),
                                        {"server0": "http://10.0.0.2:4001"}, {"retriever_url": role.url("10.0.0.3", 4200)})  # fmt: skip
    run.pending = live_servers.PendingServers(run.live)
    healthy: set[str] = set()
    monkeypatch.setattr(live_servers, "answers", lambda url, path="/health", **_: url + path in healthy)
    service.fresh, service.ip = True, "10.0.0.8"  # its node was removed: Ray placed it on another
    assert run.supervise() is None and run.supervise() is None and service.started == 2
    assert service.args[service.args.index("--host") + 1] == "10.0.0.8"
    run.tick()
    assert len(published) == 1  # not on the map before it answers
    healthy.add("http://10.0.0.8:4200/health")
    run.tick()
    new = "http://10.0.0.8:4200/retrieve"
    assert published[-1] == (2, ["http://10.0.0.2:4001"], {"retriever_url": new})
    roller.fresh = True  # a roller Ray restarts from now on
    assert run.supervise() is None and run.supervise() is None and roller.started == 2
    assert dict(parse_overrides(roller.args[1:]))["env.kwargs.retriever_url"] == new


def test_the_learners_actor_writes_the_list_on_its_node(tmp_path: Path) -> None:
    from agentrl.inference import server_list
    from agentrl.launch.ray_actor import ProcessActor

    actor = ProcessActor("learner", str(tmp_path / "learner.log"), str(tmp_path))
    actor.write_servers(
        str(tmp_path / "run" / "servers.json"), 4, ["http://10.0.0.7:4001"], {"u": "http://h:1"}
    )
    assert server_list.read(tmp_path / "run" / "servers.json") == server_list.ServerList(
        4, ("http://10.0.0.7:4001",), {"u": "http://h:1"}
    )


class _ExitsWhenStopped(_ServerActor):
    """A server actor whose process exits when the driver stops it (and runs again once started)."""

    def _poll(self) -> dict:
        return {"started": not self.fresh, "code": -15 if self.stopped else None, "pid": 200 + self.started}

    def _start(self, args: list, env: dict) -> int:
        self.stopped = False
        return super()._start(args, env)


def test_the_ray_driver_stops_and_restarts_a_server_its_health_watchdog_names(tmp_path, monkeypatch):
    """A running server whose /health answers 503 (a stand-in probe: no traffic off loopback) for
    longer than `launcher.unhealthy_after_s` is stopped through its actor, then restarted with
    "unhealthy" as the reason; when its restarts are used up, the run fails."""
    from tests.unit.launch.test_watchdog import Clock, Inline

    run, _, _, _ = _run(tmp_path, monkeypatch, set())
    actor = _ExitsWhenStopped("10.0.0.2")
    actor.fresh, actor.started = False, 1
    run.members[0].actor = actor
    clock, seen = Clock(), [None]
    run.health = ray_launch.HealthWatch(
        60, 300, interval_s=2, probe=lambda *a: seen[0], clock=clock, pool=Inline()
    )
    for _ in range(200):  # healthy: left alone
        assert run.supervise() is None
        clock.now += 1
    assert not actor.stopped
    seen[0] = "HTTP 503"  # its engine died; the process lives on
    for _ in range(70):
        assert run.supervise() is None
        clock.now += 1
    assert actor.started == 2 and run.members[0].restarts == 1  # stopped, then started again
    [record] = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
    assert (
        record["child"] == "server0"
        and record["why"].startswith("unhealthy: ")
        and "HTTP 503" in record["why"]
    )
    run.lc = run.lc.model_copy(update={"max_restarts": 1})
    seen[0] = None  # the restarted server answers, then breaks again with its one restart used
    for _ in range(5):
        assert run.supervise() is None
        clock.now += 1
    seen[0], outcome = "HTTP 503", None
    for _ in range(70):
        outcome = outcome or run.supervise()
        clock.now += 1
    assert outcome == "failed" and actor.started == 2
