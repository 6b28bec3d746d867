"""`agentrl serve-reward`: a reward model behind a batched HTTP `/score` endpoint.

    agentrl serve-reward --model runs/models/tiny-rm --port 30100 [--kind judge] [--config C]

Routes (JSON):
- `POST /score` `{"conversations": [[{"role", "content"}, ...], ...]}` or `{"texts": [...]}`
  (texts are scored as given, already rendered) → `{"scores": [float, ...], "batch_size": n}`,
  one score per input in order; `batch_size` is how many inputs shared the forward.
- `GET /health` → `{"ok": true}`; `GET /model_info` → the kind, architecture and path.

Requests that arrive together share forwards: the `MicroBatcher` gathers them for up to
`reward.batch_wait_ms` (or `reward.max_batch_size` inputs) and the forward runs in a worker
thread, so the event loop keeps taking requests. Bad input is HTTP 400 with a message and
touches no other request. It binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentrl.log import get_logger
from agentrl.rewards.batching import MicroBatcher
from agentrl.rewards.scorer import Scorer

logger = get_logger(__name__)

MAX_INPUTS = 4096
SCORER = web.AppKey("scorer", Scorer)
BATCHER = web.AppKey("batcher", MicroBatcher)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Any = None


class ScoreIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    conversations: list[list[Message]] | None = Field(None, max_length=MAX_INPUTS)
    texts: list[str] | None = Field(None, max_length=MAX_INPUTS)

    @model_validator(mode="after")
    def _one(self) -> ScoreIn:
        if (self.conversations is None) == (self.texts is None):
            raise ValueError("give exactly one of conversations or texts")
        return self


def _bad(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


async def score(request: web.Request) -> web.Response:
    try:
        body = ScoreIn.model_validate(await request.json())
    except ValueError as exc:  # JSONDecodeError and ValidationError are both ValueErrors
        return _bad(f"/score: {_describe(exc)}")
    scorer = request.app[SCORER]
    if body.texts is not None:
        texts = body.texts
    else:
        try:
            texts = scorer.render([[m.model_dump() for m in conv] for conv in body.conversations or []])
        except (ValueError, TypeError) as exc:  # unknown role, or a chat template that refuses them
            return _bad(f"/score: conversations: {exc}")
    if not texts:
        return web.json_response({"scores": [], "batch_size": 0})
    try:
        scores, batch_size = await request.app[BATCHER].submit(texts)
    except Exception as exc:  # the forward failed (e.g. non-finite scores): the whole batch is told
        logger.warning("scoring failed: %s", exc)
        return web.json_response({"error": {"message": f"scoring failed: {exc}"}}, status=500)
    return web.json_response({"scores": scores, "batch_size": batch_size})


def _describe(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        return f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}"
    return f"body is not JSON: {exc}"


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def model_info(request: web.Request) -> web.Response:
    s = request.app[SCORER]
    return web.json_response(
        {"kind": s.kind, "architecture": s.architecture, "model_path": s.path, "verdict": s.config.verdict}
    )


def make_app(scorer: Scorer) -> web.Application:
    """The app over a loaded scorer; requests' texts are batched into shared forwards."""

    async def run_batch(requests: list[list[str]]) -> list[tuple[list[float], int]]:
        flat = [text for texts in requests for text in texts]
        scores = await asyncio.to_thread(scorer.score, flat)
        out, start = [], 0
        for texts in requests:
            out.append((scores[start : start + len(texts)], len(flat)))
            start += len(texts)
        return out

    app = web.Application(client_max_size=64 << 20)
    app[SCORER] = scorer
    app[BATCHER] = MicroBatcher(
        run_batch, scorer.config.max_batch_size, scorer.config.batch_wait_ms / 1000, weight=len
    )
    app.add_routes(
        [web.post("/score", score), web.get("/health", health), web.get("/model_info", model_info)]
    )
    return app


def run_server(scorer: Scorer, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM."""
    logger.info(
        "scoring with %s (%s, %s) on http://%s:%d", scorer.path, scorer.kind, scorer.architecture, host, port
    )
    web.run_app(
        make_app(scorer), host=host, port=port, access_log=None, shutdown_timeout=5,
        print=lambda msg: print(msg, flush=True),
    )  # fmt: skip
