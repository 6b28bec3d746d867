"""A failing engine is an error, not an abort: an embedded server whose weights are NaN.

Every generation step of that server fails. Its requests must come back as HTTP 500 carrying the
engine's error (SGLang 0.5.23's answer to `FINISH_ABORT(message, 500)`), never as a resumable
abort; the router holds the server back while its health check still answers; a roller's episode
fails with the server's message, counted as a failed group; and the server's log names the error
once instead of once per step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from agentrl.inference.base import RequestLostError, ServerError
from agentrl.inference.engine import StepErrors
from agentrl.inference.router import Router
from agentrl.inference.sglang import SGLangClient
from tests.unit.inference.conftest import ServerThread

PROMPT = [5, 17, 42, 99, 3]
PARAMS = {"max_new_tokens": 6, "ignore_eos": True}


class Records(logging.Handler):
    """The records of one logger (agentrl's loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Records:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)


@pytest.fixture(scope="module")
def nan_server(tiny_model: Path) -> Iterator[ServerThread]:
    srv = ServerThread(tiny_model)
    with torch.no_grad():
        for p in srv.engine.model.parameters():
            p.fill_(float("nan"))
    srv.start()
    yield srv
    srv.stop()


async def test_a_failed_step_answers_http_500_with_the_engines_error_and_logs_it_once(nan_server):
    with Records("agentrl.inference.engine") as log:
        async with aiohttp.ClientSession() as s:
            for _ in range(12):
                body = {"input_ids": PROMPT, "sampling_params": PARAMS, "return_logprob": True}
                async with s.post(nan_server.url + "/generate", json=body) as r:
                    assert r.status == 500
                    assert "logits are NaN" in (await r.json())["detail"]
    errors = [r for r in log.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is not None, [r.getMessage() for r in errors]
    assert nan_server.engine._errors.total >= 12
    client = SGLangClient(nan_server.url)
    try:
        with pytest.raises(ServerError, match="logits are NaN"):
            await client.generate(PROMPT, PARAMS)
    finally:
        await client.close()


def test_step_errors_log_the_first_failure_then_count_the_repeats(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("agentrl.inference.engine.time.monotonic", lambda: clock[0])
    errors = StepErrors(every_s=60)
    with Records("agentrl.inference.engine") as log:
        for t in range(100):  # one failure a second for 100 s
            clock[0] = float(t)
            errors.failed(RuntimeError("boom"))
        errors.failed(ValueError("other"))  # a different error is reported at once, with the count
        errors.succeeded()
    said = [r.getMessage() for r in log.records]
    assert said[0].endswith("RuntimeError: boom")
    assert "60 more time(s)" in said[1] and "39 more time(s)" in said[2]  # at 60 s, then at the change
    assert said[3].endswith("ValueError: other")
    assert said[4] == "generation steps succeed again after 101 failed in a row"
    assert len(said) == 5


async def test_the_router_holds_a_failing_server_back_and_serves_from_the_others(nan_server, server):
    router = Router([SGLangClient(nan_server.url), SGLangClient(server.url)], max_retries=2)
    try:
        results = await asyncio.gather(*(router.generate(PROMPT, PARAMS) for _ in range(8)))
        assert {r.server for r in results} == {server.url}
        assert router.stats["server_errors"] >= 1 and router.stats["lost"] == 0
        await router.check_health()  # its health check answers (the process is up) ...
        assert router.healthy[0] and not router._usable(0)  # ... but it gets no work while held
        assert "logits are NaN" in router._unusable_reason()
    finally:
        await router.close()


async def test_a_request_on_only_failing_servers_is_lost_with_the_servers_error(nan_server):
    router = Router([SGLangClient(nan_server.url)], max_retries=1, server_wait_s=5, request_timeout_s=60)
    try:
        with pytest.raises(RequestLostError, match=r"HTTP 500.*logits are NaN"):
            await router.generate(PROMPT, PARAMS)
        assert router.stats["lost"] == 1 and router.stats["server_errors"] >= 1
    finally:
        await router.close()
