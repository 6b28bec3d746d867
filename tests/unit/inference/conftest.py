"""Fixtures of the inference tests: an embedded server running in a background thread.

The server is the real aiohttp app and engine on a free loopback port; only the process is
shared with the test (so a test can play the trainer's side of a gloo group in-process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import find_free_port


class ServerThread:
    """`make_app(Engine(model))` served by its own event loop in a daemon thread."""

    def __init__(
        self,
        model: Path,
        api_key: str | None = None,
        max_batch_size: int = 32,
        admin_api_key: str | None = None,
        **engine_kw,
    ) -> None:
        from agentrl.inference.engine import Engine

        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine = Engine(str(model), max_batch_size=max_batch_size, **engine_kw)
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=f"server-{self.port}", daemon=True)

    def _run(self) -> None:
        from aiohttp import web

        from agentrl.inference.server import make_app

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self.engine.start()
        runner = web.AppRunner(
            make_app(self.engine, self.api_key, group_timeout_s=30, admin_api_key=self.admin_api_key),
            access_log=None,
            shutdown_timeout=2,
            handler_cancellation=True,
        )
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    def start(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(60), "server did not start"
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(tiny_model).start()
    yield srv
    srv.stop()
