"""The probe after a failed bucket is bounded by the push timeout: a stopped server (SIGSTOP) whose
client would wait its whole connect timeout is judged not alive in time, and the probe never raises
into the learner's push (it once raised TimeoutError out of `BroadcastEngine.push`)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from agentrl.inference.base import ServerUnavailableError
from agentrl.weight_sync.broadcast import BroadcastEngine


class _Client:
    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour

    async def alive(self) -> bool:
        if self.behaviour == "hangs":
            await asyncio.Event().wait()  # a stopped process: the connection is accepted, nothing answers
        if self.behaviour == "refuses":
            raise ServerUnavailableError("connection refused")
        return self.behaviour == "up"


def test_a_hung_server_is_not_alive_within_the_probe_timeout():
    engine = SimpleNamespace(clients={"a": _Client("up"), "b": _Client("hangs"), "c": _Client("refuses")})

    async def probe() -> list[str]:  # an unbounded probe never returns: the outer limit fails the test
        return await asyncio.wait_for(BroadcastEngine._healthy(engine, ["a", "b", "c"], 0.3), 30)

    assert asyncio.run(probe()) == ["a"]
