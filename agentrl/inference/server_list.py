"""The run's live addresses: `{"epoch": E, "urls": [...], "services": {kwarg: url}}`, in
`<run_dir>/servers.json`: the inference servers, and the env services the launcher started
(`Env.services`), each under the env kwarg that points an env at it (e.g. `retriever_url`).

The launcher is its source of truth: it bumps `epoch` on every change (a server up on a new
address, a server added, one removed, an env service back on another node) and writes the file
on the learner's node (atomically: a temporary file renamed over the old one, so a reader sees
the old list or the new, never a torn one). The learner's weight sync rereads it on every probe
round (`watch.ServerWatch`), and the queue carries it to the producers, whichever backend: the
learner's hosted zmq queue rereads the file itself and puts it in every reply (`sl`); a learner
using a standalone `agentrl queue` or Redis hands it on (`Publisher`: an `sl` message, a Redis
key the producers' heartbeat reads). A producer (`Follower`) has its router swap its server
set when the epoch moves (`router.Router.set_servers`), and the env services map
(`envs.base.live_services`) give new episodes, and retries of requests in flight, the services'
new URLs. No filesystem is shared across nodes: only the learner's processes read the file.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.log import get_logger

logger = get_logger(__name__)

FILE = "servers.json"
ENV = "AGENTRL_SERVERS_FILE"
"""Set by the launcher for the learner: the path of the list on the learner's node. Without it
the learner follows no list (a `servers.json` left in a reused run_dir is never read)."""


@dataclass(frozen=True)
class ServerList:
    epoch: int
    urls: tuple[str, ...]
    services: dict[str, str] = field(default_factory=dict)  # env kwarg -> the service's URL

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "urls": list(self.urls), "services": dict(self.services)}


def path_in(run_dir: str | Path) -> Path:
    return Path(run_dir) / FILE


def from_env() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def write(path: str | Path, epoch: int, urls: list[str], services: dict[str, str] | None = None) -> None:
    """Atomically replace `path` with the list (the temporary file sits in the same directory)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(ServerList(int(epoch), tuple(map(str, urls)), dict(services or {})).as_dict()))
    os.replace(tmp, path)


def parse(value: object) -> ServerList:
    """A `ServerList` from its dict form; ValueError on anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("epoch"), int):
        raise ValueError(f"server list: expected {{'epoch': int, 'urls': [str]}}, got {value!r}")
    urls = value.get("urls")
    if not isinstance(urls, list) or not all(isinstance(u, str) and u for u in urls):
        raise ValueError(f"server list: 'urls' must be a list of URLs, got {urls!r}")
    services = value.get("services", {})
    if not isinstance(services, dict) or not all(isinstance(u, str) and u for u in services.values()):
        raise ValueError(f"server list: 'services' must map env kwargs to URLs, got {services!r}")
    return ServerList(value["epoch"], tuple(urls), {str(k): v for k, v in services.items()})


def read(path: str | Path) -> ServerList | None:
    """The list in `path`; None when there is no file. ValueError when it cannot be read."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    try:
        return parse(json.loads(text))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a server list ({exc})") from None


class Reader:
    """Rereads `path` on every `poll()` (a few hundred bytes: cheaper than judging by mtime, whose
    granularity can hide a rewrite); returns the list when its epoch is newer, else None."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.current: ServerList | None = None
        self._bad: str | None = None  # the last error logged, so a broken file is logged once

    def poll(self) -> ServerList | None:
        try:
            found = read(self.path)
        except (ValueError, OSError) as exc:  # not the launcher's atomic write: keep the list we have
            if str(exc) != self._bad:
                self._bad = str(exc)
                logger.error("server list %s unreadable, keeping epoch %s: %s", self.path,
                             None if self.current is None else self.current.epoch, exc)  # fmt: skip
            return None
        self._bad = None
        if found is None or (self.current is not None and found.epoch <= self.current.epoch):
            return None
        self.current = found
        return found


class Follower:
    """A queue producer's side of the list: `told(sl)` takes what its queue carried (`[epoch,
    urls, services]`, `as_wire`) and, when the epoch is newer, calls `on_servers(epoch, urls)`
    (the roller's router) and, when the env services moved, `on_services(epoch, services)`
    (`envs.base.live_services`). Each epoch is applied once, in order; an older one never."""

    servers: tuple[int, list[str]] | None = None  # (epoch, urls) once the queue carried a list
    services: dict[str, str] = {}  # noqa: RUF012 (replaced, never mutated)
    on_servers: Callable[[int, list[str]], None] | None = None
    on_services: Callable[[int, dict[str, str]], None] | None = None

    def told(self, sl: list | None) -> None:
        if not sl or (self.servers is not None and sl[0] <= self.servers[0]):
            return
        epoch, services = int(sl[0]), dict(sl[2]) if len(sl) > 2 and sl[2] else {}
        self.servers = (epoch, [str(u) for u in sl[1]])
        moved, self.services = services != self.services, services
        for hook, args, what in ((self.on_servers, self.servers, "server list"),
                                 (self.on_services if moved else None, (epoch, services), "env services")):  # fmt: skip
            if hook is None:
                continue
            try:
                hook(*args)
            except Exception as exc:  # a bad list must not stop the producer's replies
                logger.error("applying the %s of epoch %d failed: %s", what, epoch, exc)


def as_wire(found: ServerList) -> list:
    """The list as a queue carries it (`sl` in the zmq replies, a Redis key's value)."""
    return [found.epoch, list(found.urls), dict(found.services)]


class Publisher:
    """For a learner whose queue it does not host (a standalone `agentrl queue`, Redis): reads the
    list in `path` every `every_s` in a daemon thread (the learner may block for data meanwhile)
    and hands it to `send` (`as_wire`): each newer epoch at once, and the current one again
    every `resend_s` (a restarted standalone queue has forgotten it)."""

    def __init__(self, path: str | Path, send: Callable[[list], None], every_s: float = 0.5,
                 resend_s: float = 10.0) -> None:  # fmt: skip
        self.reader, self.send, self.every_s, self.resend_s = Reader(path), send, every_s, resend_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentrl-server-list", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        resend_at, failing = 0.0, False
        while True:
            found = self.reader.poll()
            due = found is not None or (self.reader.current is not None and time.monotonic() >= resend_at)
            if due:
                try:
                    self.send(as_wire(self.reader.current))
                    resend_at, failing = time.monotonic() + self.resend_s, False
                except Exception as exc:  # the queue away for a while: sent again next round
                    if not failing:
                        logger.warning("could not hand the server list (epoch %d) to the queue: %s",
                                       self.reader.current.epoch, exc)  # fmt: skip
                    failing = True
            if self._stop.wait(self.every_s):
                return
