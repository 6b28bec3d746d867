"""A loopback HTTP proxy in front of one inference server that fails scripted requests.

Stands in for what sits between a learner and a server in a real deployment (a load balancer,
an ingress) answering 5xx, or a server refusing a request: everything is forwarded to the
server unchanged except the requests a `Fault` names, which get `status` either instead of
being forwarded (the server never sees them) or after being forwarded (the server acted, the
reply is lost). Runs on its own event loop in a daemon thread:

    proxy = FaultProxy("http://127.0.0.1:30000").start()
    proxy.fail("/update_weights_from_distributed", nth=2, count=1, status=500)
    ... proxy.url ...
    proxy.stop()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from tests.conftest import find_free_port


@dataclass
class Fault:
    path: str
    nth: int
    """The first request to `path` (counted from when the fault was set, 1-based) that fails."""
    count: int = 1
    """How many requests in a row fail from there."""
    status: int = 500
    forward: bool = False
    """True: forward the request first, then answer `status` (the reply is lost)."""
    skip_if: str | None = None
    """A request whose body contains this text is forwarded and not counted."""
    only_if: str | None = None
    """Only requests whose body contains this text are counted (e.g. one `/collective_rpc` method)."""
    seen: int = 0
    on_request: Callable[[], None] | None = None
    """Called (in the proxy's thread) when the `nth` request arrives, instead of failing it (with
    `forward`: and then its reply is lost as well)."""


class FaultProxy:
    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.faults: list[Fault] = []
        self.failed: list[str] = []  # "path status" of every request failed on purpose
        self.requests: list[tuple[str, bytes]] = []  # (path, body) of every request, in order
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fault-proxy-{self.port}", daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("fault proxy did not start")
        return self

    def fail(self, path: str, nth: int = 1, **kwargs) -> Fault:
        fault = Fault(path, nth, **kwargs)
        self.faults.append(fault)
        return fault

    def clear(self) -> None:
        self.faults.clear()
        self.failed.clear()

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(10)
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._session = self._loop.run_until_complete(_session())
        self._ready.set()
        self._loop.run_forever()

    def _match(self, path: str, body: bytes) -> Fault | None:
        """Count the request against every fault on its path; the first one it falls in, if any."""
        hit = None
        for fault in self.faults:
            if fault.path != path or (fault.skip_if is not None and fault.skip_if.encode() in body):
                continue
            if fault.only_if is not None and fault.only_if.encode() not in body:
                continue
            fault.seen += 1
            if hit is None and fault.nth <= fault.seen < fault.nth + fault.count:
                hit = fault
        return hit

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append((request.path, body))
        fault = self._match(request.path, body)
        if fault is not None and fault.on_request is not None:
            fault.on_request()
            fault = fault if fault.forward else None
        if fault is not None and not fault.forward:
            self.failed.append(f"{request.path} {fault.status}")
            return web.Response(status=fault.status, text=f"fault proxy: {request.path} refused")
        async with self._session.request(
            request.method, f"{self.target}{request.path_qs}", data=body, headers=_headers(request)
        ) as reply:
            content = await reply.read()
            status, ctype = reply.status, reply.content_type
        if fault is not None:
            self.failed.append(f"{request.path} {fault.status} (after forwarding)")
            return web.Response(status=fault.status, text=f"fault proxy: {request.path} reply lost")
        return web.Response(status=status, body=content, content_type=ctype)


async def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))


def _headers(request: web.Request) -> dict[str, str]:
    keep = ("Content-Type", "Authorization")
    return {k: v for k, v in request.headers.items() if k in keep}
