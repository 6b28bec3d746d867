"""The launcher's side of the live server list (`inference.server_list`): which server slot is at
which URL, where each env service is (by the env kwarg that points at it), and the epoch that
moves on every change; and `agentrl scale`'s server slots on this machine (`LocalScaler`), which
change it (under Ray, `RayRun._scale_servers` in `ray.py` does, on the driver's own actors).

Both launchers keep one `LiveServers`: the local launcher writes the list to `<run_dir>/
servers.json` itself; the Ray driver hands it to the learner's actor, which writes it on the
learner's node. The learner process (its weight sync and its TransferQueue) reads that file and
the queue carries the list on to the rollers, wherever they run, whichever the queue backend.
"""

from __future__ import annotations

from collections.abc import Callable

from agentrl.launch.control import exit_state, roller_slots
from agentrl.launch.plan import server_url
from agentrl.launch.procs import Child, ChildSpec, Supervisor
from agentrl.log import get_logger
from agentrl.net import answers, free_port

logger = get_logger(__name__)


class LiveServers:
    """`slots` {name: url} of the servers and `services` {env kwarg: url} of the env services,
    published through `publish(epoch, urls, services)` on every change."""

    def __init__(
        self,
        publish: Callable[[int, list[str], dict[str, str]], None],
        slots: dict[str, str],
        services: dict[str, str] | None = None,
    ) -> None:
        self.publish = publish
        self.slots = dict(slots)
        self.services = dict(services or {})
        self.epoch = 1
        self.publish(self.epoch, self.urls(), dict(self.services))

    def urls(self) -> list[str]:
        return [self.slots[n] for n in sorted(self.slots, key=_index)]

    def set(self, name: str, url: str) -> None:
        """Slot `name` serves at `url` (a new slot, or one back on another address)."""
        if self.slots.get(name) == url:
            return
        self.slots[name] = url
        self._changed(f"{name} at {url}")

    def set_service(self, kwarg: str, url: str) -> None:
        """The env service env kwarg `kwarg` points at is now at `url` (back on another node)."""
        if self.services.get(kwarg) == url:
            return
        self.services[kwarg] = url
        self._changed(f"env service {kwarg} at {url}")

    def remove(self, name: str) -> None:
        if self.slots.pop(name, None) is not None:
            self._changed(f"{name} removed")

    def _changed(self, what: str) -> None:
        self.epoch += 1
        logger.warning("server list epoch %d (%s): %s %s", self.epoch, what, self.urls(), self.services)
        self.publish(self.epoch, self.urls(), dict(self.services))


class PendingServers:
    """Servers started by a scale-up, and servers or env services back on a new address, that
    join the list once they answer their health path (a server still loading its model would
    only fail the requests routed to it)."""

    def __init__(self, live: LiveServers) -> None:
        self.live = live
        self.waiting: dict[str, tuple[str, str, Callable[[], None]]] = {}  # name -> (url, path, join)

    def add(self, name: str, url: str) -> None:
        self.waiting[name] = (url, "/health", lambda: self.live.set(name, url))

    def add_service(self, name: str, kwarg: str, base: str, health_path: str, url: str) -> None:
        """Env service `name` (at `base`, answering `health_path`) joins as env kwarg `kwarg` = `url`."""
        self.waiting[name] = (base, health_path, lambda: self.live.set_service(kwarg, url))

    def forget(self, name: str) -> None:
        self.waiting.pop(name, None)

    def poll(self) -> None:
        for name, (url, path, join) in list(self.waiting.items()):
            if answers(url, path=path, timeout_s=1):
                del self.waiting[name]
                join()


def _index(name: str) -> int:
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return int(digits) if digits.isdigit() else 0


class LocalScaler:
    """`agentrl scale` on this machine: rollers are started (with the next index) or stopped
    (highest index first, SIGTERM: in-flight groups are finished and put). Servers: a scale-down
    stops the highest slots and takes them off the live list, a scale-up restarts stopped slots on
    their port and then starts new slots on new ports, each put on the list once it answers
    /health; without a list (`live` None: the run started no servers) only the planned slots
    are stopped and started again."""

    def __init__(
        self, supervisor: Supervisor, roller_args: list[str], live: LiveServers | None = None
    ) -> None:
        self.supervisor = supervisor
        self.roller_args = roller_args  # every roller runs the same command line, told its index by env
        self.parked: dict[str, ChildSpec] = {}  # server slots stopped by a scale-down
        self.live = live
        self.pending = PendingServers(live) if live is not None else None

    def tick(self) -> None:
        """Each watch round: servers started by a scale-up that now answer join the list."""
        if self.pending is not None:
            self.pending.poll()

    def _of(self, prefix: str) -> list[Child]:
        found = [
            c
            for c in self.supervisor.children
            if c.name.startswith(prefix) and c.name[len(prefix) :].isdigit()
        ]
        return sorted(found, key=lambda c: int(c.name[len(prefix) :]))

    def apply(self, request: dict) -> str:
        done = []
        if "rollers" in request:
            rollers = {int(c.name[6:]): c for c in self._of("roller")}
            stop, start = roller_slots(list(rollers), request["rollers"])
            for i in stop:
                self._remove(rollers[i])
            for i in start:
                spec = ChildSpec(f"roller{i}", self.roller_args, {"AGENTRL_ROLLER_INDEX": str(i)}, True)
                self.supervisor.run(spec)
            done.append(f"rollers {len(self._of('roller'))}")
        if "servers" in request:
            done.append(self._scale_servers(int(request["servers"])))
        logger.warning("scaled: %s", ", ".join(done))
        return ", ".join(done)

    def _scale_servers(self, want: int) -> str:
        servers = self._of("server")
        if want < 1:
            return f"servers {len(servers)} (a run keeps at least one server)"
        for child in servers[want:][::-1]:
            self.parked[child.name] = child.spec
            if self.live is not None:  # off the list first: no new request or push goes to it
                self.live.remove(child.name)
                self.pending.forget(child.name)
            self._remove(child)
        for name in sorted(self.parked, key=lambda n: int(n[6:]))[: max(0, want - len(servers))]:
            spec = self.parked.pop(name)
            self.supervisor.run(spec)
            if self.pending is not None:
                self.pending.add(name, spec.health_url)
        n = len(self._of("server"))
        if n < want and self.live is None:
            return f"servers {n} (all {n} planned slots: this run has no live server list)"
        if n < want:
            template = self._of("server")[0].spec
            taken = [int(c.name[6:]) for c in self._of("server")] + [int(k[6:]) for k in self.parked]
            for i in range(max(taken) + 1, max(taken) + 1 + want - n):
                spec = new_server_spec(template, f"server{i}", free_port())
                self.supervisor.run(spec)
                self.pending.add(spec.name, spec.health_url)
        return f"servers {len(self._of('server'))}"

    def _remove(self, child: Child) -> None:
        self.supervisor.stop(child)
        self.supervisor.children.remove(child)

    def processes(self) -> list[dict]:
        rows = []
        for c in self.supervisor.children:
            code = c.proc.poll()
            state = "restarting" if code is not None and c.restart_at else exit_state(code)
            rows.append({"name": c.name, "kind": c.name.rstrip("0123456789"), "node": "localhost",
                         "pid": c.proc.pid, "state": state, "restarts": c.restarts})  # fmt: skip
        rows += [{"name": n, "kind": "server", "node": "-", "pid": None, "state": "scaled down", "restarts": 0}
                 for n in self.parked]  # fmt: skip
        return rows


def new_server_spec(template: ChildSpec, name: str, port: int) -> ChildSpec:
    """Another server slot like `template` (rendered by `plan.render`: `serve --host H --port P
    ...`), bound to `port` on the same host."""
    args = list(template.args)
    at = args.index("--port") + 1
    host = args[args.index("--host") + 1]
    args[at] = str(port)
    return ChildSpec(name, args, dict(template.env), True, server_url(host, port))
