"""`agentrl run` with `launcher.type: ray`: the plan of `launch/plan.py` placed by Ray on a cluster.

    ray start --head --resources '{"learner": 1}'          # node A
    ray start --address A:6379 --resources '{"gpu": 1}'    # node B, C, ...
    agentrl run --config recipes/quickstart.yaml --launcher.type ray

Every process of the plan runs as a child of one `ProcessActor` (the same `agentrl serve |
learner | roller` command line a user would type on that node), in its own process group and
killed with the actor (PR_SET_PDEATHSIG). Addresses are discovered, never assumed: each actor
reports its node's IP and binds a free port there, and the driver renders the others' command
lines with what was reported. Start-up order: env services, servers (until each answers /health),
the learner's ranks in one placement group (PACK; rank 0's node address and a port it bound are
the torch.distributed rendezvous, the TransferQueue and the weight-sync master), the rollers.
`mode: colocated` plans one role only (`launch/plan.py`): its `colocated.num_processes` ranks
(`agentrl colocated`) placed like the learner's ranks, with the learner's failure story.
Each learner rank's device comes from the GPUs Ray gave its actor (`launch/devices.py`: `cuda:0`,
its own first GPU, or `cpu` when `learner.resources` asks for none), passed as `AGENTRL_DEVICE`;
a rank or server that asked for GPUs and got none, or that cannot see the one it was given,
refuses to start rather than fall back to the CPU.

Secrets (the queue's `secret_env` and `launcher.forward_env`) go to each actor as an argument
of its `start` call and into its child's environment only: not in argv, not in a runtime_env
(the dashboard shows those), not logged.

Failures: server, roller and service actors have `max_restarts = launcher.max_restarts`; when one
dies (ray.kill, its node removed) Ray restarts it on a node that fits, the driver sees a fresh
actor and starts its process again with the current addresses (a server on its old port when
that is free on its node; a server or env service on a new address goes on the live list
once healthy, `launch/servers.py`, which the learner's actor writes on its node and the queue
carries to the rollers; the learner's ServerWatch brings a server to the current version, a
roller opens a new queue lease). A child
that exits while its actor lives is restarted in the same actor after `launcher.restart_backoff_s`
(doubled each time), and so is the process of an actor Ray restarted; one budget of
`max_restarts` covers both. A server whose process lives but has not answered /health with 200
for `launcher.unhealthy_after_s` is stopped through its actor and restarted the same way (the
health watchdog, `launch/watchdog.py`; the reason `unhealthy: ...`). A learner rank is never
restarted: its loss ends the run with its last checkpoint; `agentrl run --launcher.type ray
--resume` continues it. `agentrl scale` / `agentrl status` work as for the local launcher
(`launch/control.py`). Shutdown stops every child by PID (SIGTERM, then SIGKILL; the rollers
together, then the others together), then kills the actors and removes the placement group.

The module is one class, `RayRun`, the driver, and runs past 500 lines: starting, supervising,
scaling and stopping all read and change the same members, addresses and live list, so they stay
one object, in sections by phase, each step its own method.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.inference import server_list
from agentrl.launch.control import mark_ended, roller_slots, write_state
from agentrl.launch.devices import DEVICE_ENV, check_gpu_index, ray_device
from agentrl.launch.plan import (
    Addresses,
    Role,
    ServiceRole,
    plan,
    render,
    roller_role,
    server_url,
    service_roles,
)
from agentrl.launch.ray_actor import ProcessActor, actor_options, child_threads
from agentrl.launch.servers import LiveServers, PendingServers
from agentrl.launch.watchdog import KILL_AFTER_S, HealthWatch
from agentrl.log import get_logger
from agentrl.net import answers

logger = get_logger(__name__)

DEAD_AFTER_S = 20.0
"""A restartable actor whose calls fail as dead for this long is dead for good (restarts used up)."""
NAME_FREE_S = 30.0
"""How long a new actor waits for its name to be released by a killed one (a `--resume` right after
the run it continues)."""
RESOURCES_KEY = {"service": "env.service_resources", "server": "inference.resources",
                 "learner": "learner.resources", "roller": "roller.resources"}  # fmt: skip


def ray_namespace(run_dir: str | Path) -> str:
    """The Ray namespace of a run's actors (named after their roles): one per run directory."""
    return "agentrl-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:10]


@dataclass
class Member:
    """One actor of the run, as the driver tracks it."""

    role: Role
    name: str
    actor: Any
    env: dict[str, str]
    rank: int = 0
    node: str = "-"
    node_id: str = ""
    pid: int | None = None
    state: str = "starting"
    restarts: int = 0
    port: int = 0  # a server's bound port
    restart_at: float | None = None
    pending: Any = None  # the poll in flight
    pending_since: float = 0.0
    died_since: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    stopped_why: str | None = None  # why the driver stopped its process (unhealthy), until restarted
    env_extra: dict[str, str] = field(default_factory=dict)  # added to `env` at start only


class RayRun:
    """The driver: places the plan, supervises it, applies `agentrl scale`, stops it."""

    def __init__(self, config: AgentRLConfig, config_path: Path, resume: bool) -> None:
        import ray

        self.ray, self.config, self.config_path, self.resume = ray, config, config_path, resume
        self.run_dir = Path(config.run_dir).resolve()
        self.lc = config.launcher
        self.members: list[Member] = []
        self.parked: dict[str, Member] = {}
        self.pg = None
        self.learner_lost = False
        self.addrs = Addresses([])
        self.secrets = _secrets(config)
        self.actor_cls = ray.remote(ProcessActor)
        self.live: LiveServers | None = None  # the live server list, once the learner's actor exists
        self.pending: PendingServers | None = None
        self.health = HealthWatch(self.lc.unhealthy_after_s, self._startup_timeout())

    # -------------------------------------------------------------- starting
    def new_member(self, role: Role, name: str, port: int = 0) -> Member:
        """A member for `role` on a fresh actor (restarted at most `launcher.max_restarts` times)."""
        return Member(role, name, self._actor(role, name, self.lc.max_restarts), {}, port=port)

    def _actor(self, role: Role, name: str, restarts: int, **options: Any) -> Any:
        log = self.run_dir / "logs" / f"{name}.log"
        opts = {**actor_options(role.resources), **options}
        deadline = time.monotonic() + NAME_FREE_S
        while True:
            try:
                return self.actor_cls.options(
                    name=name,
                    namespace=ray_namespace(self.run_dir),
                    max_restarts=restarts,
                    max_task_retries=0,
                    **opts,
                ).remote(name, str(log), os.getcwd())
            except ValueError as exc:  # "already taken": a killed actor of the run's last life
                if "already" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _get(self, ref: Any, what: str, timeout_s: float = 120, kind: str = "") -> Any:
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            key = RESOURCES_KEY.get(kind, "the resources its section")
            raise RuntimeError(
                f"{what}: no answer from its Ray actor in {timeout_s:.0f}s; does a node have the resources "
                f"{key} asks for? (ray status shows what each node offers)"
            ) from None

    def _start(self, m: Member, args: list[str], env: dict[str, str] | None = None) -> None:
        m.info = self._get(m.actor.where.remote(), m.name, kind=m.role.kind)
        m.node, m.node_id = m.info["ip"], m.info["node_id"]
        threads = {} if "OMP_NUM_THREADS" in os.environ else child_threads(m.role.resources)
        m.pid = self._get(
            m.actor.start.remote(args, {**threads, **self.secrets, **m.role.env, **(env or {})}), m.name
        )
        m.state = "running"
        logger.info("started %s on %s (node %s, pid %d)", m.name, m.node, m.node_id[:8], m.pid)

    def _device(self, m: Member, what: str) -> str:
        """The device of `m`'s process from the GPUs Ray gave its actor (`launch/devices.py`); raises
        when its role asked for GPUs and got none, or when it is an embedded server whose
        `inference.device` names a GPU it was not given."""
        info = self._get(m.actor.where.remote(), m.name, kind=m.role.kind)
        gpu_ids = info.get("gpu_ids", [])
        device = ray_device(
            what, RESOURCES_KEY.get(m.role.kind, "resources"), float(m.role.resources.get("GPU", 0)), gpu_ids
        )
        if device != "cpu":
            logger.info("%s: Ray gave GPU id(s) %s (CUDA_VISIBLE_DEVICES=%s): %s", what, gpu_ids,
                        info.get("cuda_visible_devices"), device)  # fmt: skip
        if m.role.kind == "server" and self.config.inference.type == "embedded":
            check_gpu_index(what, "inference.device", self.config.inference.device, gpu_ids)
        return device

    def _start_server(self, m: Member) -> str:
        """A server or env service on its actor's node, on its old port when that is free there."""
        if m.role.kind == "server":
            self._device(m, m.name)
        ip = self._get(m.actor.where.remote(), m.name, kind=m.role.kind)["ip"]
        m.port = self._get(m.actor.bind_port.remote(m.port), m.name)
        self._start(m, render(m.role, self.addrs, (ip, m.port)))
        return m.role.url(ip, m.port) if isinstance(m.role, ServiceRole) else server_url(ip, m.port)

    def run_warmstart(self) -> None:
        role = Role("warmstart", "learner", [], dict(self.config.learner.resources))
        m = Member(role, "warmstart", self._actor(role, "warmstart", 0), {})
        self._start(
            m, ["warmstart", "--config", str(self.config_path)], {DEVICE_ENV: self._device(m, "warmstart")}
        )
        while (code := self._get(m.actor.poll.remote(), "warmstart")["code"]) is None:
            time.sleep(1)
        self.ray.kill(m.actor)
        if code != 0:
            raise RuntimeError(
                f"warmstart exited with code {code}; see {self.run_dir / 'logs' / 'warmstart.log'}"
            )

    def start_services(self) -> list[str]:
        """The env's helper services (`Env.services`) as actors on nodes with
        `env.service_resources`; the flags that point every other process at them."""
        overrides = []
        for role in service_roles(self.config):
            m = Member(role, role.name, self._actor(role, role.name, self.lc.max_restarts), {})
            self._start_server(m)
            _wait_healthy([server_url(m.node, m.port)], role.health_path)
            self.members.append(m)
            overrides.append(role.override(m.node, m.port))
        return overrides

    def start_plan(self, model: str, overrides: list[str]) -> None:
        """The servers (until each answers /health), the learner's ranks, then the rollers."""
        roles = plan(self.config, self.config_path, model, overrides, self.resume)
        self.common = roles[-1].args[1:] if roles[-1].kind == "roller" else []
        servers = [
            Member(r, r.name, self._actor(r, r.name, self.lc.max_restarts), {})
            for r in roles
            if r.kind == "server"
        ]
        self.addrs.servers = [self._start_server(m) for m in servers]
        self.members += servers
        _wait_healthy(self.addrs.servers, "/health", self._startup_timeout())

        learner = next(r for r in roles if r.kind == "learner")
        ranks = self._place_learner(learner)
        self._keep_server_list(servers, ranks[0])
        for m in ranks:
            self._start(m, render(learner, self.addrs), {**m.env, **m.env_extra})
        self.members += ranks
        for r in roles:
            if r.kind == "roller":
                self.add_roller(r)

    def _place_learner(self, learner: Role) -> list[Member]:
        """The learner's ranks on actors of one placement group (PACK); rank 0's node is the
        queue's (hosted) and the weight-sync master's address and the rendezvous. Each rank's
        `env`: its torch.distributed variables and its device."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = dict(learner.resources) or {"CPU": 1}
        self.pg = placement_group(
            [bundle] * learner.ranks, strategy="PACK", name=f"{ray_namespace(self.run_dir)}-learner"
        )
        self._get(self.pg.ready(), "the learner's placement group", 300)
        ranks = []
        for rank in range(learner.ranks):
            name = "learner" if rank == 0 else f"learner-rank{rank}"
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank)
            ranks.append(
                Member(learner, name, self._actor(learner, name, 0, scheduling_strategy=strategy), {}, rank)
            )
        head = self._get(ranks[0].actor.where.remote(), "learner rank 0")
        if not getattr(self.config.queue, "standalone", True):  # hosted: the learner binds it on its node
            self.addrs.queue = f"tcp://{head['ip']}:{self._get(ranks[0].actor.bind_port.remote(), 'learner')}"
        if self.config.weight_sync.type == "broadcast":
            self.addrs.master_address = head["ip"]
        dist_env = {}
        if learner.ranks > 1:
            port = self._get(ranks[0].actor.bind_port.remote(), "learner rank 0")
            nodes = [self._get(m.actor.where.remote(), m.name)["node_id"] for m in ranks]
            dist_env = {"MASTER_ADDR": head["ip"], "MASTER_PORT": str(port), "WORLD_SIZE": str(learner.ranks)}
        for m in ranks:
            m.env = dist_env and {**dist_env, "RANK": str(m.rank), "LOCAL_RANK": str(nodes[: m.rank].count(nodes[m.rank])),
                                  "LOCAL_WORLD_SIZE": str(nodes.count(nodes[m.rank]))}  # fmt: skip
            m.env = {**m.env, DEVICE_ENV: self._device(m, f"learner rank {m.rank}")}
        return ranks

    def _keep_server_list(self, servers: list[Member], learner: Member) -> None:
        """With servers or env services to follow: the live list, written by the learner's actor on
        its node (the learner reads it, its queue of any backend carries it on to the rollers)."""
        services = {
            m.role.kwarg: m.role.url(m.node, m.port) for m in self.members if m.role.kind == "service"
        }
        if not (servers or services):
            return
        path = str(self.run_dir / server_list.FILE)
        self.live = LiveServers(
            lambda epoch, urls, services: self._get(
                learner.actor.write_servers.remote(path, epoch, urls, services), "learner"
            ),
            {m.name: url for m, url in zip(servers, self.addrs.servers, strict=True)},
            services,
        )
        self.pending = PendingServers(self.live)
        learner.env_extra = {server_list.ENV: path}

    def add_roller(self, role: Role) -> None:
        m = Member(role, role.name, self._actor(role, role.name, self.lc.max_restarts), {})
        self._start(m, render(role, self.addrs))
        self.members.append(m)

    def _startup_timeout(self) -> float:
        from agentrl.inference.registry import backend

        return backend(self.config.inference.type).startup_timeout_s(self.config.inference)

    # -------------------------------------------------------------- supervision
    def supervise(self) -> str | None:
        """One round: stop unhealthy servers, poll every actor, restart what died. "done" /
        "failed" / None as local's."""
        now = time.monotonic()
        self._stop_unhealthy()
        for m in list(self.members):
            if m.pending is None:
                m.pending, m.pending_since = m.actor.poll.remote(), now
            ready, _ = self.ray.wait([m.pending], timeout=0.2)
            if not ready:
                if now - m.pending_since > 5:
                    m.state = "unreachable (restarting?)"
                continue
            ref, m.pending = m.pending, None
            if (outcome := self._answered(m, ref, now)) is not None:
                return outcome
        return None

    def _stop_unhealthy(self) -> None:
        """The running servers the health watchdog names (`watchdog.py`) are stopped through their
        actor (SIGTERM, SIGKILL `KILL_AFTER_S` later); their poll then sees the exit and the
        restart path takes over."""
        running = {
            m.name: m
            for m in self.members
            if m.role.kind == "server" and m.state == "running" and m.stopped_why is None
        }
        urls = {n: (server_url(m.node, m.port), m.pid) for n, m in running.items()}
        for name, why in self.health.check(urls).items():
            m = running[name]
            logger.error("%s (pid %s on %s) is %s; stopping it to restart it (its log: %s)", name, m.pid,
                         m.node, why, self.run_dir / "logs" / f"{name}.log")  # fmt: skip
            m.stopped_why = why
            m.actor.stop.remote(KILL_AFTER_S)  # not waited for: its poll sees the exit

    def _answered(self, m: Member, ref: Any, now: float) -> str | None:
        """What `m`'s poll `ref` says: its state updated, a restart due or done, or the run's end."""
        exc = self.ray.exceptions
        try:
            answer = self.ray.get(ref)
        except exc.ActorDiedError:
            return self._actor_died(m, now)
        except (exc.ActorUnavailableError, exc.RayActorError):
            m.state = "restarting"
            return None
        m.died_since = None
        if not answer["started"]:  # a fresh actor: Ray restarted it after it or its node died
            if m.restart_at is None:  # its process starts after the backoff, as a child's restart
                m.state = "restarting"
                m.restart_at = now + self.lc.restart_backoff_s * 2**m.restarts
            elif now >= m.restart_at:
                self._rejoin(m, "actor restarted by Ray")
        elif answer["code"] is None:
            m.state, m.pid = "running", answer["pid"]
        elif m.role.kind == "learner":
            if answer["code"] == 0 and m.rank == 0:
                return "done"
            if answer["code"] != 0:
                self._learner_lost(m, f"exited with code {answer['code']}; see {self.run_dir / 'logs'}")
                return "failed"
        elif m.restarts >= self.lc.max_restarts:
            ended = f"was stopped ({m.stopped_why}), exit code" if m.stopped_why else "exited with code"
            logger.error("%s %s %d after %d restart(s) (launcher.max_restarts); stopping the run; its log: %s",
                         m.name, ended, answer["code"], m.restarts, self.run_dir / "logs" / f"{m.name}.log")  # fmt: skip
            return "failed"
        elif m.restart_at is None:
            m.state = f"exited {answer['code']}"
            m.restart_at = now + self.lc.restart_backoff_s * 2**m.restarts
        elif now >= m.restart_at:
            self._rejoin(m, m.stopped_why or f"exit code {answer['code']}")
        return None

    def _actor_died(self, m: Member, now: float) -> str | None:
        """A call in flight when the actor died fails so even if Ray restarts it; calls to an actor
        that is dead for good keep failing so: Ray gets `DEAD_AFTER_S` to restart it. A learner's
        actor is never restarted: its death ends the run."""
        m.died_since = m.died_since or now
        m.state = "dead" if m.role.kind == "learner" or now - m.died_since > DEAD_AFTER_S else "restarting"
        if m.state != "dead":
            return None
        if m.role.kind == "learner":
            self._learner_lost(m, "its Ray actor died: killed, or its node lost")
        else:
            logger.error("%s died and Ray used up its %d restarts (launcher.max_restarts)", m.name,
                         self.lc.max_restarts)  # fmt: skip
        return "failed"

    def _learner_lost(self, m: Member, why: str) -> None:
        self.learner_lost = True
        marker = self.run_dir / "checkpoints" / "latest"
        latest = self.run_dir / "checkpoints" / marker.read_text().strip() if marker.exists() else None
        where = (
            f"its last checkpoint {latest}" if latest else "no checkpoint (learner.checkpoint.every is 0?)"
        )
        logger.error("learner lost: %s (%s); the run ends with %s; continue it with agentrl run "
                     "--launcher.type ray --resume", m.name, why, where)  # fmt: skip

    def _rejoin(self, m: Member, why: str) -> None:
        m.restarts += 1
        m.restart_at = m.stopped_why = None
        if m.role.kind in ("server", "service"):
            old = server_url(m.node, m.port)
            self._start_server(m)
            new = server_url(m.node, m.port)
            if new != old:
                # on another node (or port): the live list tells the learner and the rollers,
                # once it answers its health path
                logger.warning("%s came back at %s, not %s: it goes on the live list once healthy",
                               m.name, new, old)  # fmt: skip
                self._moved(m)
        else:
            self._start(m, render(m.role, self.addrs))
        logger.warning(
            "restarted %s (%s) on %s, restart %d/%d", m.name, why, m.node, m.restarts, self.lc.max_restarts
        )
        record = {
            "time": time.time(),
            "child": m.name,
            "why": why,
            "node_id": m.node_id,
            "restart": m.restarts,
        }
        with (self.run_dir / "launcher.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def _moved(self, m: Member) -> None:
        """`m`, a server or env service, now serves on a new address: the list names it there once
        it answers (its old address, dead, stays until then: the list is never empty); rollers
        started from now on are given the new address."""
        assert self.pending is not None
        if isinstance(m.role, ServiceRole):
            url = m.role.url(m.node, m.port)
            self.pending.add_service(
                m.name, m.role.kwarg, server_url(m.node, m.port), m.role.health_path, url
            )
            self.addrs.services[m.role.kwarg] = url
            return
        self.pending.add(m.name, server_url(m.node, m.port))
        self._set_addr(m.name, server_url(m.node, m.port))

    def _set_addr(self, name: str, url: str | None) -> None:
        slots = {m.name: server_url(m.node, m.port) for m in self.members if m.role.kind == "server"}
        if url is None:
            slots.pop(name, None)
        else:
            slots[name] = url
        self.addrs.servers = [slots[n] for n in sorted(slots, key=lambda n: int(n[6:]))]

    def tick(self) -> None:
        """Each watch round: servers started or moved that now answer /health join the list."""
        if self.pending is not None:
            self.pending.poll()

    # -------------------------------------------------------------- scale, state, stop
    def scale(self, request: dict) -> str:
        done = []
        if "rollers" in request:
            rollers = {int(m.name[6:]): m for m in self.members if m.role.kind == "roller"}
            stop, start = roller_slots(sorted(rollers), request["rollers"])
            for i in stop:
                self._stop(rollers[i])
            for i in start:
                self.add_roller(roller_role(self.config, self.common, i))
            done.append(f"rollers {sum(m.role.kind == 'roller' for m in self.members)}")
        if "servers" in request:
            done.append(self._scale_servers(int(request["servers"])))
        logger.warning("scaled: %s", ", ".join(done))
        return ", ".join(done)

    def _scale_servers(self, want: int) -> str:
        """`agentrl scale --servers`. Down: the highest slots leave the
        list, then stop. Up: stopped slots start again, then new slots on actors with
        `inference.resources`; each joins the list once it answers /health. Without a list only the
        planned slots."""
        servers = sorted((m for m in self.members if m.role.kind == "server"), key=lambda m: int(m.name[6:]))
        if want < 1:
            return f"servers {len(servers)} (a run keeps at least one server)"
        for m in servers[want:][::-1]:
            if self.live is not None:
                self.live.remove(m.name)
                self.pending.forget(m.name)
            self._stop(m)
            self.parked[m.name] = m
            self._set_addr(m.name, None)
        names = sorted(self.parked, key=lambda n: int(n[6:]))[: max(0, want - len(servers))]
        if self.live is not None:
            taken = [int(m.name[6:]) for m in servers] + [int(n[6:]) for n in self.parked]
            top = max(taken) + 1
            names += [f"server{i}" for i in range(top, top + want - len(servers) - len(names))]
        template = servers[0].role
        for name in names:
            old = self.parked.pop(name, None)
            role = old.role if old is not None else replace(template, name=name)
            m = self.new_member(role, name, port=old.port if old is not None else 0)
            url = self._start_server(m)
            self.members.append(m)
            if self.pending is not None:
                self.pending.add(name, url)
            self._set_addr(name, url)
        n = sum(m.role.kind == "server" for m in self.members)
        if n < want:
            return f"servers {n} (all {n} planned slots: this run has no live server list)"
        return f"servers {n}"

    def processes(self) -> list[dict[str, Any]]:
        rows = [{"name": m.name, "kind": m.role.kind, "node": f"{m.node} ({m.node_id[:8]})", "node_id": m.node_id,
                 "pid": m.pid, "state": m.state, "restarts": m.restarts} for m in self.members]  # fmt: skip
        rows += [{"name": n, "kind": "server", "node": "-", "pid": None, "state": "scaled down", "restarts": 0}
                 for n in self.parked]  # fmt: skip
        return rows

    def _stop(self, m: Member) -> None:
        self._stop_together([m])

    def _stop_together(self, members: list[Member], timeout_s: float = 30) -> None:
        """Stop `members`' processes at once (SIGTERM, SIGKILL after `timeout_s`; a learner's
        surviving ranks at once after it was lost: they cannot checkpoint without rank 0), then
        kill their actors."""
        refs = [
            m.actor.stop.remote(0 if self.learner_lost and m.role.kind == "learner" else timeout_s)
            for m in members
        ]
        deadline = time.monotonic() + timeout_s + 30
        for m, ref in zip(members, refs, strict=True):
            try:
                self.ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as e:  # an actor already gone has nothing to stop
                logger.info("stopping %s: %s", m.name, type(e).__name__)
            self.ray.kill(m.actor, no_restart=True)
            if m in self.members:
                self.members.remove(m)

    def stop_all(self) -> None:
        """The rollers first (together: each finishes and puts its groups while the learner may
        still take them), then everything else together."""
        self.health.close()
        self._stop_together([m for m in self.members if m.role.kind == "roller"])
        self._stop_together(list(reversed(self.members)))
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)


def _secrets(config: AgentRLConfig) -> dict[str, str]:
    """The environment every process gets by call: the queue's secret (a fresh one if unset) and
    the API keys of `launcher.forward_env` that this shell has."""
    out = {k: os.environ[k] for k in config.launcher.forward_env if os.environ.get(k)}
    secret_env = getattr(config.queue, "secret_env", None)
    if secret_env:
        out[secret_env] = os.environ.get(secret_env) or secrets.token_hex(32)
    return out


def _wait_healthy(urls: list[str], path: str, timeout_s: float = 300) -> None:
    deadline, pending = time.monotonic() + timeout_s, list(urls)
    while pending:
        pending = [url for url in pending if not answers(url, path, timeout_s=2)]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"{pending} not healthy after {timeout_s:.0f}s (their logs are in logs/)")
        time.sleep(0.3)


def launch_ray(config: AgentRLConfig, config_path: Path, resume: bool = False) -> int:
    """Run the job on the Ray cluster at `launcher.address`; like `launch.local.launch`."""
    import ray

    from agentrl.launch.progress import exit_code

    run_dir = Path(config.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    config_path = config_path.resolve()
    ray.init(address=config.launcher.address, namespace=ray_namespace(run_dir), log_to_driver=False,
             logging_level="WARNING", configure_logging=True)  # fmt: skip
    job = RayRun(config, config_path, resume)
    try:
        return exit_code(lambda: _run(job, resume))
    finally:
        write_state(run_dir, "ray", job.processes(), namespace=ray_namespace(run_dir))
        job.stop_all()
        mark_ended(run_dir, {})  # what was still running was stopped by stop_all
        ray.shutdown()


def _run(job: RayRun, resume: bool) -> int:
    """Warm start, env services, servers (healthy), the learner's ranks and rollers, then the main loop."""
    from agentrl.launch.procs import warm_model
    from agentrl.launch.progress import watch

    config, run_dir = job.config, Path(job.config.run_dir)
    model = (
        str(Path(config.learner.model_path).resolve())
        if Path(config.learner.model_path).exists()
        else config.learner.model_path
    )
    if config.learner.warmstart.steps > 0:
        if (warm_model(run_dir) if resume else None) is None:
            job.run_warmstart()
        model = str((run_dir / "warmstart").resolve())
    job.start_plan(model, job.start_services())
    return watch(
        config,
        "ray",
        lambda: job.tick() or job.supervise(),
        job.scale,
        job.processes,
        lambda: sum(m.restarts for m in job.members),
        namespace=ray_namespace(run_dir),
    )
