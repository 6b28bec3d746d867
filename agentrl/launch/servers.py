"""The launcher's side of the live server list (`inference.server_list`): which server slot is at
which URL, where each env service is (by the env kwarg that points at it), and the epoch that
moves on every change.

Both launchers keep one `LiveServers`: the local launcher writes the list to `<run_dir>/
servers.json` itself; the Ray driver hands it to the learner's actor, which writes it on the
learner's node. The learner process (its weight sync and its TransferQueue) reads that file and
the queue carries the list on to the rollers, wherever they run.
"""

from __future__ import annotations

from collections.abc import Callable

from agentrl.log import get_logger
from agentrl.net import answers

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
