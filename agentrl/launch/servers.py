"""The launcher's side of the live server list (`inference.server_list`): which server slot is at
which URL, and the epoch that moves on every change.

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
    """`slots` {name: url}, published through `publish(epoch, urls)` on every change."""

    def __init__(self, publish: Callable[[int, list[str]], None], slots: dict[str, str]) -> None:
        self.publish = publish
        self.slots = dict(slots)
        self.epoch = 1
        self.publish(self.epoch, self.urls())

    def urls(self) -> list[str]:
        return [self.slots[n] for n in sorted(self.slots, key=_index)]

    def set(self, name: str, url: str) -> None:
        """Slot `name` serves at `url` (a new slot, or one back on another address)."""
        if self.slots.get(name) == url:
            return
        self.slots[name] = url
        self._changed(f"{name} at {url}")

    def remove(self, name: str) -> None:
        if self.slots.pop(name, None) is not None:
            self._changed(f"{name} removed")

    def _changed(self, what: str) -> None:
        self.epoch += 1
        logger.warning("server list epoch %d (%s): %s", self.epoch, what, self.urls())
        self.publish(self.epoch, self.urls())


class PendingServers:
    """Servers started by a scale-up that join the list once they answer /health (a server still
    loading its model would only fail the requests routed to it)."""

    def __init__(self, live: LiveServers) -> None:
        self.live = live
        self.waiting: dict[str, str] = {}  # name -> url

    def add(self, name: str, url: str) -> None:
        self.waiting[name] = url

    def forget(self, name: str) -> None:
        self.waiting.pop(name, None)

    def poll(self) -> None:
        for name, url in list(self.waiting.items()):
            if answers(url, timeout_s=1):
                del self.waiting[name]
                self.live.set(name, url)


def _index(name: str) -> int:
    digits = name.lstrip("abcdefghijklmnopqrstuvwxyz_")
    return int(digits) if digits.isdigit() else 0
