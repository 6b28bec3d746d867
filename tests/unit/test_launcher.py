"""The launcher's Supervisor stops exactly its children, and a second stop signal during the
cleanup kills what is left instead of abandoning it (no orphans either way)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from agentrl.launch.procs import Supervisor
from tests.conftest import pid_alive

# a child that ignores SIGTERM, as a process stuck in a collective might
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"


def _started(supervisor: Supervisor, names: list[str]) -> list[int]:
    children = [supervisor.start(name, [sys.executable, "-c", STUBBORN]) for name in names]
    for child in children:  # wait until each has installed its handler
        while "up" not in child.log_path.read_text():
            assert child.proc.poll() is None
            threading.Event().wait(0.05)
    return [c.proc.pid for c in children]


@pytest.mark.timeout(60)  # without the second signal's kill, stop_all would wait 300 s per child
def test_a_second_stop_signal_kills_the_remaining_children(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_timeout_s=300)
    pids = _started(supervisor, ["a", "b", "c"])
    previous = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGTERM))
    timer.start()
    supervisor.stop_all()
    timer.join()
    assert not any(pid_alive(pid) for pid in pids)
    assert signal.getsignal(signal.SIGTERM) is previous  # the cleanup's handler is gone again


@pytest.mark.timeout(60)
def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    supervisor = Supervisor(tmp_path, stop_timeout_s=0.5)
    pids = _started(supervisor, ["a", "b"])
    supervisor.stop_all()
    assert not any(pid_alive(pid) for pid in pids)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_plan_starts_real_engines_behind_agentrl_serve(tmp_path: Path, kind: str) -> None:
    from agentrl.cli_common import USES
    from agentrl.config import AgentRLConfig
    from agentrl.launch.local import plan_children

    data = {"run_dir": str(tmp_path), "inference": {"type": kind}}
    config = AgentRLConfig.model_validate(
        data, context={"uses": set(USES["run"])}
    )  # as `agentrl run` loads it
    specs = {s.name: s for s in plan_children(config, tmp_path / "c.yaml", "m", [])}
    server = specs["server0"].args
    assert "serve" in server and server[server.index("--backend") + 1] == kind
    assert "--backend" not in specs["learner"].args and "--inference.servers" in specs["learner"].args


def test_a_colocated_plan_is_one_role_of_its_ranks_for_ray(tmp_path: Path) -> None:
    """`mode: colocated` under Ray: no servers, rollers or queue, one role (`agentrl colocated`) of
    `colocated.num_processes` ranks, placed in one placement group like the learner's."""
    from agentrl.config import AgentRLConfig
    from agentrl.launch.plan import plan

    config = AgentRLConfig.model_validate(
        {"run_dir": str(tmp_path), "mode": "colocated", "launcher": {"type": "ray"},
         "colocated": {"num_processes": 4}, "learner": {"resources": {"learner": 1}}}
    )  # fmt: skip
    (role,) = plan(config, tmp_path / "c.yaml", "m", ["--env.kwargs.x=1"], resume=True)
    assert (role.kind, role.ranks, role.resources, role.restart) == ("learner", 4, {"learner": 1}, False)
    assert role.args[0] == "colocated" and role.args[-1] == "--resume"
    assert "--learner.model_path=m" in role.args and "--env.kwargs.x=1" in role.args


def test_the_plan_restarts_servers_and_rollers_but_not_the_learner(tmp_path: Path) -> None:
    from agentrl.config import AgentRLConfig
    from agentrl.launch.local import plan_children

    config = AgentRLConfig.model_validate(
        {"run_dir": str(tmp_path), "inference": {"num_servers": 2}, "roller": {"num_processes": 2}}
    )
    specs = {s.name: s for s in plan_children(config, tmp_path / "c.yaml", "m", [], resume=True)}
    assert list(specs) == ["server0", "server1", "learner", "roller0", "roller1"]
    assert all(specs[n].restart for n in ("server0", "server1", "roller0", "roller1"))
    assert not specs["learner"].restart and "--resume" in specs["learner"].args
    port = specs["server1"].args[specs["server1"].args.index("--port") + 1]
    assert specs["server1"].health_url == f"http://127.0.0.1:{port}"
    assert specs["roller1"].env == {"AGENTRL_ROLLER_INDEX": "1"}
    servers = specs["roller0"].args[specs["roller0"].args.index("--inference.servers") + 1]
    assert servers == f"[{specs['server0'].health_url}, {specs['server1'].health_url}]"


@pytest.mark.timeout(60)
def test_a_dead_roller_is_restarted_with_backoff_until_its_restarts_run_out(tmp_path: Path) -> None:
    import json
    import time

    from agentrl.launch.local import supervise
    from agentrl.launch.procs import ChildSpec

    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    try:
        learner = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "import time; time.sleep(60)"]))
        server = supervisor.run(
            ChildSpec("server0", [sys.executable, "-c", "import time; time.sleep(60)"], restart=True)
        )
        roller = supervisor.run(ChildSpec("roller0", [sys.executable, "-c", "exit(3)"], restart=True))
        os.kill(server.proc.pid, signal.SIGKILL)  # kill -9 of a server: restarted, then it stays up
        deadline, outcome = time.monotonic() + 50, None
        while outcome is None and time.monotonic() < deadline:
            outcome = supervise(supervisor, learner, max_restarts=2, backoff_s=0.05)
            time.sleep(0.05)
        assert outcome == "failed"  # the roller kept dying: the run stops after its 2 restarts
        assert roller.restarts == 2 and server.restarts == 1 and server.proc.poll() is None
        records = [json.loads(line) for line in (tmp_path / "launcher.jsonl").read_text().splitlines()]
        assert sorted((r["child"], r["restart"]) for r in records) == [
            ("roller0", 1), ("roller0", 2), ("server0", 1)
        ]  # fmt: skip
        assert {r["exit_code"] for r in records if r["child"] == "server0"} == {-signal.SIGKILL}
    finally:
        supervisor.stop_all()
    assert learner.proc.poll() is not None and server.proc.poll() is not None


@pytest.mark.timeout(30)
def test_the_learner_finishing_or_dying_ends_supervision(tmp_path: Path) -> None:
    from agentrl.launch.local import supervise
    from agentrl.launch.procs import ChildSpec

    supervisor = Supervisor(tmp_path)
    done = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "exit(0)"]))
    done.proc.wait()
    assert supervise(supervisor, done, 3, 0.0) == "done"
    dead = supervisor.run(ChildSpec("learner", [sys.executable, "-c", "exit(1)"]))
    dead.proc.wait()
    assert supervise(supervisor, dead, 3, 0.0) == "failed"


def _config(tmp_path: Path, resources: dict | None = None, env: dict | None = None, **launcher):
    """Two servers, two learner ranks, two rollers; `resources` by role (each in its section)."""
    from agentrl.config import AgentRLConfig

    res = resources or {}
    return AgentRLConfig.model_validate(
        {"run_dir": str(tmp_path), "inference": {"num_servers": 2, "resources": res.get("server", {})},
         "roller": {"num_processes": 2, "resources": res.get("roller", {})},
         "learner": {"num_processes": 2, "resources": res.get("learner", {})},
         "env": env or {}, "launcher": launcher}
    )  # fmt: skip


def test_one_plan_rendered_with_discovered_addresses_for_ray_and_loopback_ones_locally(
    tmp_path: Path,
) -> None:
    from agentrl.launch.local import plan_children
    from agentrl.launch.plan import Addresses, plan, render

    resources = {"learner": {"GPU": 1}, "server": {"GPU": 1, "CPU": 2}, "roller": {"sandbox": 1}}
    config = _config(tmp_path, type="ray", resources=resources)
    roles = plan(config, tmp_path / "c.yaml", "m", ["--env.kwargs.url=http://h:1"])
    assert [(r.name, r.kind, r.restart) for r in roles] == [
        ("server0", "server", True), ("server1", "server", True), ("learner", "learner", False),
        ("roller0", "roller", True), ("roller1", "roller", True),
    ]  # fmt: skip
    assert roles[0].resources == {"GPU": 1, "CPU": 2} and roles[2].resources == {"GPU": 1}
    assert roles[2].ranks == 2 and roles[4].resources == {"sandbox": 1}
    # what the actors reported: the hosts and ports they bound on their nodes
    addrs = Addresses(["http://10.0.0.2:4001", "http://10.0.0.3:4002"], "tcp://10.0.0.1:5001", "10.0.0.1")
    server = render(roles[1], addrs, ("10.0.0.3", 4002))
    assert server[:5] == ["serve", "--host", "10.0.0.3", "--port", "4002"]
    assert "--inference.servers" not in server  # a server needs nobody's address
    learner = render(roles[2], addrs)
    assert learner[learner.index("--inference.servers") + 1] == "[http://10.0.0.2:4001, http://10.0.0.3:4002]"
    assert "--queue.address=tcp://10.0.0.1:5001" in learner
    assert "--weight_sync.master_address=10.0.0.1" in learner
    roller = render(roles[3], addrs)
    assert "--queue.address=tcp://10.0.0.1:5001" in roller and "--env.kwargs.url=http://h:1" in roller
    assert not any("master_address" in a for a in roller)
    assert roles[4].env == {"AGENTRL_ROLLER_INDEX": "1"}
    # the local launcher renders the same plan: loopback ports, the config's queue address, torchrun
    local = {
        s.name: s for s in plan_children(config, tmp_path / "c.yaml", "m", ["--env.kwargs.url=http://h:1"])
    }
    assert local["learner"].args[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    assert local["learner"].args[7:] == render(
        roles[2], Addresses([s.health_url for s in local.values() if s.health_url])
    )
    assert local["roller1"].args[3:] == render(
        roles[4], Addresses([local["server0"].health_url, local["server1"].health_url])
    )


def test_ray_actor_options_carry_cpu_gpu_and_custom_resources() -> None:
    from agentrl.launch.ray_actor import actor_options

    assert actor_options({"GPU": 1, "CPU": 2, "sandbox": 1}) == {
        "num_cpus": 2,
        "num_gpus": 1,
        "resources": {"sandbox": 1},
    }
    assert actor_options({}) == {"num_cpus": 0, "num_gpus": 0, "resources": {}}


def test_the_old_launcher_resources_key_and_unknown_types_are_config_errors(tmp_path: Path) -> None:
    import pydantic

    from agentrl.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, ["--launcher.resources={roller: {CPU: 2}}"])
    for new_key in ("learner.resources", "inference.resources", "roller.resources", "env.service_resources"):
        assert new_key in str(err.value), err.value
    assert "launcher" in str(err.value)
    with pytest.raises(pydantic.ValidationError, match="type"):
        _config(tmp_path, type="slurm")
    config = load_config(None, ["--roller.resources={CPU: 2, sandbox: 1}", "--inference.resources={GPU: 1}"])
    assert config.roller.resources == {"CPU": 2, "sandbox": 1} and config.inference.resources == {"GPU": 1}


def test_an_env_service_is_planned_with_its_resources_and_rendered_on_the_node_it_bound(
    tmp_path: Path,
) -> None:
    """Search-R1 with `retriever_url: auto`: the retriever is a service role asking for
    `env.service_resources`, bound on its actor's node, and every other process gets its URL."""
    from agentrl.launch.plan import Addresses, plan, render, service_roles

    env = {
        "name": "search_r1",
        "kwargs": {"retriever_url": "auto"},
        "service_resources": {"CPU": 2, "retrieval": 1},
    }
    config = _config(tmp_path, env=env, type="ray")
    (service,) = service_roles(config)
    assert (service.name, service.kind, service.restart) == ("retriever", "service", True)
    assert service.resources == {"CPU": 2, "retrieval": 1}
    args = render(service, Addresses([]), ("10.0.0.7", 4100))
    assert args[0] == "retriever" and args[args.index("--port") + 1] == "4100"
    assert args[args.index("--host") + 1] == "10.0.0.7"  # reachable from the other nodes
    assert "{port}" not in " ".join(args) and str(tmp_path) in " ".join(args)  # data under the run dir
    flag = service.override("10.0.0.7", 4100)
    assert flag == "--env.kwargs.retriever_url=http://10.0.0.7:4100/retrieve"
    roles = plan(config, tmp_path / "c.yaml", "m", [flag])
    for role in roles:
        rendered = render(role, Addresses(["http://10.0.0.2:4001"]), ("10.0.0.2", 4001))
        assert flag in rendered, (role.name, rendered)
    assert service_roles(_config(tmp_path)) == []  # the toy env starts none


def test_a_scale_request_is_seen_once_and_refused_without_a_live_launcher(tmp_path: Path) -> None:
    from agentrl.launch.control import ScaleWatch, request_scale, write_state

    with pytest.raises(FileNotFoundError, match="no launcher state"):
        request_scale(tmp_path, 2, None)
    write_state(tmp_path, "local", [])
    watch = ScaleWatch(tmp_path)
    assert watch.poll() is None
    with pytest.raises(ValueError, match="--rollers"):
        request_scale(tmp_path, -1, None)
    with pytest.raises(ValueError, match="at least one server"):
        request_scale(tmp_path, None, 0)
    request = request_scale(tmp_path, 3, 1)
    assert watch.poll() == request and request["rollers"] == 3 and request["servers"] == 1
    assert watch.poll() is None  # applied once
    state = json.loads((tmp_path / "launcher_state.json").read_text())
    write_state(tmp_path, "local", [])
    (tmp_path / "launcher_state.json").write_text(
        json.dumps({**state, "time": state["time"] - 60})
    )  # a stale state
    with pytest.raises(RuntimeError, match="not running"):
        request_scale(tmp_path, 1, None)


@pytest.mark.timeout(60)
def test_local_scaling_starts_and_stops_rollers_and_server_slots_and_status_lists_them(
    tmp_path: Path,
) -> None:
    from rich.console import Console

    from agentrl.launch.control import status_table, write_state
    from agentrl.launch.procs import ChildSpec
    from agentrl.launch.servers import LocalScaler

    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    try:
        supervisor.run(ChildSpec("server0", sleep, restart=True))
        server1 = supervisor.run(ChildSpec("server1", sleep, restart=True))
        supervisor.run(ChildSpec("learner", sleep))
        roller0 = supervisor.run(ChildSpec("roller0", sleep, {"AGENTRL_ROLLER_INDEX": "0"}, restart=True))
        scaler = LocalScaler(supervisor, sleep)
        assert scaler.apply({"rollers": 3, "servers": 1}) == "rollers 3, servers 1"
        names = [c.name for c in supervisor.children]
        assert names == ["server0", "learner", "roller0", "roller1", "roller2"]
        assert supervisor.children[-1].spec.env == {"AGENTRL_ROLLER_INDEX": "2"}
        assert server1.proc.poll() is not None  # stopped by PID
        assert scaler.apply({"rollers": 1, "servers": 5}) == (
            "rollers 1, servers 2 (all 2 planned slots: this run has no live server list)"
        )
        assert [c.name for c in supervisor.children] == ["server0", "learner", "roller0", "server1"]
        assert roller0.proc.poll() is None
        write_state(tmp_path, "local", scaler.processes())
        (tmp_path / "learner.jsonl").write_text(
            json.dumps({"step": 7, "queue/depth": 3, "queue/groups_in": 20}) + "\n"
        )
        console = Console(width=200, record=True)
        console.print(status_table(tmp_path))
        text = console.export_text()
        assert "learner version 7" in text and "depth 3" in text and "groups_in 20" in text
        assert all(n in text for n in ("server0", "server1", "roller0", "learner", "localhost", "running"))
    finally:
        supervisor.stop_all()


@pytest.mark.timeout(60)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_are_stopped_when_the_launcher_itself_is_killed(tmp_path: Path) -> None:
    """kill -9 of the launcher process: its children (in their own process groups, out of reach of
    a signal to its group) get SIGTERM from the kernel, so none keeps a port or device."""
    import subprocess
    import time

    script = (
        "import sys, time; from pathlib import Path; from agentrl.launch.procs import Supervisor\n"
        "s = Supervisor(Path(sys.argv[1]))\n"
        "for n in 'ab': print(s.start(n, [sys.executable, '-c', 'import time; time.sleep(120)']).proc.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    pids = [int(launcher.stdout.readline()) for _ in range(2)]
    assert all(pid_alive(pid) for pid in pids)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 20
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(pid) for pid in pids)


class _Actor:
    """A roller's `ProcessActor` as Ray restarts it: fresh (no process) until `start` is called.
    Its methods' `.remote` return the answer itself, which `_Ray.get` hands back."""

    def __init__(self) -> None:
        self.started = 0
        self.fresh = True
        for name in ("where", "start", "poll"):
            setattr(self, name, type("M", (), {"remote": getattr(self, "_" + name)})())

    def _where(self) -> dict:
        return {"ip": "10.0.0.5", "node_id": "n" * 16, "actor_pid": 1}

    def _start(self, args: list, env: dict) -> int:
        self.args = args
        self.started += 1
        self.fresh = False
        return 100 + self.started

    def _poll(self) -> dict:
        return {"started": not self.fresh, "code": None, "pid": 100 + self.started}


class _Ray:
    """The calls `RayRun` makes of the `ray` module: wait, get, exceptions, and kill (a stand-in
    actor lives in this process: its child is stopped by its `stop`, there is no actor to kill)."""

    class exceptions:  # as ray.exceptions
        class ActorDiedError(Exception): ...

        class ActorUnavailableError(Exception): ...

        class RayActorError(Exception): ...

        class GetTimeoutError(Exception): ...

    @staticmethod
    def wait(refs: list, timeout: float) -> tuple[list, list]:
        return refs, []

    @staticmethod
    def get(ref: object, timeout: float | None = None) -> object:
        if isinstance(ref, BaseException):  # the call failed, as ray.get raises it
            raise ref
        return ref

    @staticmethod
    def kill(actor: object, no_restart: bool = True) -> None:
        pass


def test_a_process_ray_restarted_starts_after_the_doubling_backoff(tmp_path: Path, monkeypatch) -> None:
    """launcher.restart_backoff_s before the process of an actor Ray restarted, doubled per restart
    of that role, as the local launcher waits before restarting a child."""
    from agentrl.launch import ray as ray_launch
    from agentrl.launch.plan import Addresses, roller_role

    config = _config(tmp_path, type="ray", restart_backoff_s=1.0)
    run = ray_launch.RayRun.__new__(ray_launch.RayRun)
    run.health = ray_launch.HealthWatch(0, 0)  # the health watchdog off
    run.ray, run.config, run.lc, run.run_dir = _Ray, config, config.launcher, tmp_path
    run.addrs, run.secrets = Addresses(["http://10.0.0.2:4001"], "tcp://10.0.0.1:5001"), {}
    actor = _Actor()
    run.members = [ray_launch.Member(roller_role(config, ["--config", "c.yaml"], 0), "roller0", actor, {})]
    clock = [0.0]
    monkeypatch.setattr(ray_launch.time, "monotonic", lambda: clock[0])

    def at(t: float) -> int:
        clock[0] = t
        assert run.supervise() is None
        return actor.started

    assert [at(0.0), at(0.5), at(0.99)] == [0, 0, 0]  # a fresh actor waits 1 s for its process
    assert run.members[0].state == "restarting"
    assert at(1.0) == 1 and run.members[0].restarts == 1
    assert "--queue.address=tcp://10.0.0.1:5001" in actor.args  # with the run's current addresses
    actor.fresh = True  # Ray restarts it again (killed, or its node lost)
    assert [at(2.0), at(3.9)] == [1, 1]  # the second restart waits 2 s
    assert at(4.0) == 2 and run.members[0].restarts == 2
    records = (tmp_path / "launcher.jsonl").read_text().splitlines()
    assert [json.loads(r)["why"] for r in records] == ["actor restarted by Ray"] * 2


class _Handle:
    """A Ray actor handle's `.method.remote(...)`, called at once in this process (`_Ray.get`
    returns the value)."""

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> object:
        return type("M", (), {"remote": staticmethod(getattr(self.obj, name))})()


def _loopback_actor_cls():
    """`launch/ray_actor.py`'s `ProcessActor` (its real start/poll/stop: the child, its process group,
    its log) on a node whose address is 127.0.0.1, created as `RayRun._actor` creates one."""
    import socket

    from agentrl.launch.ray_actor import ProcessActor

    class LoopbackActor(ProcessActor):
        def where(self) -> dict:
            return {"ip": "127.0.0.1", "node_id": "loopback" * 2, "actor_pid": os.getpid()}

        def bind_port(self, prefer: int = 0) -> int:
            for port in (prefer, 0) if prefer else (0,):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                    return s.getsockname()[1]
            raise OSError("no free port")

    class Options:
        def options(self, **kwargs: object) -> object:
            return type("R", (), {"remote": staticmethod(lambda *a: _Handle(LoopbackActor(*a)))})()

    return Options()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_an_env_service_under_the_ray_driver_is_started_pointed_at_and_restarted_on_its_port(
    tmp_path: Path,
) -> None:
    """`RayRun.start_services` with Search-R1's retriever (`retriever_url: auto`): the real
    `agentrl retriever` bound on the node address its actor reported, answering; the flag that
    points the other processes at it; when its process dies, it is started again after the
    backoff on the same port, so the URL the rollers were given still answers."""
    from agentrl.launch import ray as ray_launch
    from agentrl.launch.plan import Addresses

    env = {"name": "search_r1", "kwargs": {"retriever_url": "auto"}}
    config = _config(tmp_path, env=env, type="ray", restart_backoff_s=0.2)
    run = ray_launch.RayRun.__new__(ray_launch.RayRun)
    run.health = ray_launch.HealthWatch(0, 0)  # the health watchdog off
    run.ray, run.config, run.lc, run.run_dir = _Ray, config, config.launcher, tmp_path
    run.addrs, run.secrets, run.members, run.pg, run.learner_lost = Addresses([]), {}, [], None, False
    run.actor_cls = _loopback_actor_cls()
    try:
        (flag,) = run.start_services()
        url = flag.split("=", 1)[1]
        _retrieves(url, tmp_path)
        (m,) = run.members
        old_pid = m.pid
        os.killpg(m.pid, signal.SIGKILL)
        for _ in range(600):  # supervise rounds until the restart (bounded: 600 x >= 0.05 s)
            assert run.supervise() is None
            if m.restarts:
                break
            threading.Event().wait(0.05)
        assert m.restarts == 1 and m.pid != old_pid and url == m.role.url(m.node, m.port)
        ray_launch._wait_healthy([url.removesuffix("/retrieve")], "/health", 60)
    finally:
        pids = [m.pid for m in run.members]
        run.stop_all()
    assert not any(pid_alive(pid) for pid in pids)


def _retrieves(url: str, run_dir: Path) -> None:
    """`url` is a loopback Search-R1 retriever serving the synthetic corpus it wrote under the run
    directory: a query of a document's own words finds one."""
    import urllib.request

    assert url.startswith("http://127.0.0.1:") and url.endswith("/retrieve"), url
    with (run_dir / "retriever_data" / "corpus.jsonl").open() as f:
        words = json.loads(f.readline())["contents"]
    query = json.dumps({"queries": [words], "topk": 1}).encode()
    request = urllib.request.Request(url, query, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200 and len(json.loads(resp.read())["result"][0]) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_local_launcher_starts_the_same_service_roles_on_loopback(tmp_path: Path) -> None:
    """The local launcher starts the plan's service roles too: the retriever on a loopback port,
    its URL as the env kwarg every other process is given."""
    from agentrl.launch.local import start_services

    config = _config(tmp_path, env={"name": "search_r1", "kwargs": {"retriever_url": "auto"}})
    supervisor = Supervisor(tmp_path)
    try:
        kwargs = start_services(config, supervisor)
        assert list(kwargs) == ["retriever_url"]
        _retrieves(kwargs["retriever_url"], tmp_path)
    finally:
        pids = [c.proc.pid for c in supervisor.children]
        supervisor.stop_all()
    assert pids and not any(pid_alive(pid) for pid in pids)


def test_a_lost_learner_rank_ends_the_run_naming_the_last_checkpoint(tmp_path: Path) -> None:
    """Any learner rank's actor dying (ray.kill, its node lost) ends the run at once ("failed"),
    with a message naming the rank, the run's last complete checkpoint and `--resume`."""
    import logging

    from agentrl.launch import ray as ray_launch
    from agentrl.launch.plan import Addresses, plan

    config = _config(tmp_path, type="ray")
    run = ray_launch.RayRun.__new__(ray_launch.RayRun)
    run.health = ray_launch.HealthWatch(0, 0)  # the health watchdog off
    run.ray, run.config, run.lc, run.run_dir = _Ray, config, config.launcher, tmp_path
    run.addrs, run.secrets, run.learner_lost = Addresses([]), {}, False
    learner = next(r for r in plan(config, tmp_path / "c.yaml", "m", []) if r.kind == "learner")
    dead = type("Dead", (), {"poll": type("M", (), {"remote": staticmethod(
        lambda: _Ray.exceptions.ActorDiedError("the actor died"))})()})()  # fmt: skip
    run.members = [ray_launch.Member(learner, "learner-rank1", dead, {}, rank=1)]
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    ray_launch.logger.addHandler(handler)
    try:
        assert run.supervise() == "failed"  # no checkpoint yet: it says so
        (tmp_path / "checkpoints" / "step_00000003").mkdir(parents=True)
        (tmp_path / "checkpoints" / "latest").write_text("step_00000003\n")
        assert run.supervise() == "failed"
    finally:
        ray_launch.logger.removeHandler(handler)
    assert run.learner_lost  # the other ranks are then killed at once (stop_all)
    assert "no checkpoint" in records[0] and "learner-rank1" in records[0]
    assert str(tmp_path / "checkpoints" / "step_00000003") in records[1] and "--resume" in records[1]


def test_an_ended_run_lists_no_process_as_running(tmp_path: Path) -> None:
    """What the launchers do when a run ends: their children stopped by PID, then `mark_ended`
    (each child's final state from its exit code; a row with no final state, as under Ray, becomes
    `stopped`)."""
    from agentrl.launch.control import exit_state, launcher_alive, mark_ended, read_state, write_state

    supervisor = Supervisor(tmp_path, stop_timeout_s=5)
    done = supervisor.start("learner", [sys.executable, "-c", "pass"])
    server = supervisor.start("server0", [sys.executable, "-c", "import time; time.sleep(60)"])
    done.proc.wait(timeout=30)
    rows = [{"name": c.name, "state": exit_state(c.proc.poll())} for c in supervisor.children]
    rows.append({"name": "roller0", "state": "running"})  # a process this launcher no longer tracks
    write_state(tmp_path, "local", rows, scale="rollers 1")
    assert [r["state"] for r in read_state(tmp_path)["processes"]] == ["exited 0", "running", "running"]
    supervisor.stop_all()
    mark_ended(tmp_path, {c.name: exit_state(c.proc.returncode) for c in supervisor.children})
    state = read_state(tmp_path)
    assert {p["name"]: p["state"] for p in state["processes"]} == {
        "learner": "exited 0", "server0": "stopped by SIGTERM", "roller0": "stopped"
    }  # fmt: skip
    assert server.proc.returncode == -15 and exit_state(3) == "exited 3" and exit_state(None) == "running"
    assert state["ended"] and state["scale"] == "rollers 1" and not launcher_alive(state)


def test_the_live_view_ends_its_last_line_and_warns_of_flat_rewards(tmp_path: Path, capsys) -> None:
    from rich.console import Console

    from agentrl.launch.progress import progress_table, watch

    config = _config(tmp_path)
    (tmp_path / "learner.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
    rounds = iter([None, "done"])
    assert watch(config, "local", lambda: next(rounds), lambda r: None, lambda: [], lambda: 0) == 0
    out = capsys.readouterr().out
    assert "┘\nmetrics: " in out, out[-300:]  # off a terminal too, the table's last line ends
    (tmp_path / "learner.jsonl").write_text(json.dumps({"step": 12, "reward/flat_steps": 10.0}) + "\n")
    console = Console(width=250, record=True)
    console.print(progress_table(tmp_path, config))
    text = console.export_text()
    assert "rewards equal for 10 steps" in text and f"agentrl show transcripts {tmp_path}" in text
    (tmp_path / "learner.jsonl").write_text(json.dumps({"step": 12, "reward/flat_steps": 9.0}) + "\n")
    console = Console(width=250, record=True)
    console.print(progress_table(tmp_path, config))
    assert "warning" not in console.export_text()
