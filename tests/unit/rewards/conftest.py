"""Fixtures of the reward-model tests: the tiny reward model (built once) and a scorer app served
in-process on a free loopback port."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import find_free_port


@pytest.fixture(scope="session")
def tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agentrl.tiny_model import init_model

    return init_model("tiny-rm", tmp_path_factory.mktemp("models") / "tiny-rm", seed=1)


@pytest.fixture
async def serve_app() -> AsyncIterator[Callable[[web.Application], str]]:
    """`url = await serve_app(app)`: serve a real aiohttp app on 127.0.0.1 until the test ends."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await runner.setup()
        port = find_free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
