"""The roller's OpenAI-compatible endpoint: one HTTP server on loopback for all its agent episodes.

    endpoint = AgentEndpoint(model="agentrl-policy")
    await endpoint.start()            # http://127.0.0.1:<port>
    endpoint.register(session)        # http://127.0.0.1:<port>/<episode id>/v1 now answers its key
    ...
    await endpoint.stop()

Each episode has its own base URL, `http://127.0.0.1:<port>/<episode id>/v1`, and its own key.
Routes under it (requests checked and answers shaped by `agent_protocol.py`):
- `POST /v1/chat/completions`: `messages`, `tools`, `tool_choice`, `max_tokens` /
  `max_completion_tokens`, `stop`, `temperature`, `top_p`, `stream` (+ `stream_options.include_usage`).
  The answer is a `chat.completion` (or, streamed, `chat.completion.chunk` server-sent events
  ending with `data: [DONE]`; the turn is generated whole, then sent as chunks: the role, the
  content, one delta per tool call, the finish reason, the usage). `tool_calls` are parsed from
  the model's text by the env's parser (`env.tool_parser`), `finish_reason` is `stop`, `length` or
  `tool_calls`, `usage` counts the whole sequence so far as the prompt.
- `GET /v1/models`: the one model the run serves (its name is `env.kwargs.model`).
- `POST /v1/agentrl/reward` `{"reward": x}`: the agent's own reward for its episode.

Every request must carry its episode's key (`Authorization: Bearer <key>`): no key, another
episode's, or an episode that has ended gets a 401, so an agent can write only into its own episode. What it refuses, with OpenAI's error body `{"error": {"message", "type",
"param", "code"}}` and the episode going on: a body that is not JSON or not an object, missing or
malformed `messages` (unknown role, content that is neither text nor text parts, tool calls not
in the function shape), a last message from the assistant, `n` other than 1, `tools` that are not
functions, a bad `max_tokens` or `stop`, and, with `env.kwargs.sampling: refuse`, a temperature or
top_p other than the run's. `tool_choice` other than `none` cannot be enforced (the model is not
constrained): it is answered as `auto` and counted (`tool_choice_unenforced`).
"""

from __future__ import annotations

import json
import secrets
import socket
import time
import uuid
from typing import Any

from aiohttp import web

from agentrl.log import get_logger
from agentrl.rollers.agent_episode import AgentSession
from agentrl.rollers.agent_protocol import EndpointError, completion_body, completion_chunks, parse_request

logger = get_logger(__name__)


async def _json_body(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError:
        raise EndpointError(400, "the request body is not JSON") from None


def _error(exc: EndpointError) -> web.Response:
    return web.json_response(exc.body(), status=exc.status)


class AgentEndpoint:
    """One aiohttp server on 127.0.0.1 serving the chat API to every episode of a roller."""

    def __init__(self, model: str = "agentrl-policy", host: str = "127.0.0.1") -> None:
        self.model, self.host = model, host
        self.sessions: dict[str, AgentSession] = {}
        self.stats = {"requests": 0, "errors_4xx": 0, "unauthorized": 0}
        self._runner: web.AppRunner | None = None
        self.base_url = ""

    def register(self, session: AgentSession) -> None:
        self.sessions[session.session_id] = session

    def unregister(self, session: AgentSession) -> None:
        self.sessions.pop(session.session_id, None)

    def url(self, session: AgentSession) -> str:
        """The base URL the episode's agent is given (`OPENAI_BASE_URL`)."""
        return f"{self.base_url}/{session.session_id}/v1"

    async def start(self) -> str:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/{episode}/v1/models", self._models)
        app.router.add_post("/{episode}/v1/agentrl/reward", self._reward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind((self.host, 0))
        port = sock.getsockname()[1]
        # hundreds of agents connect at once: the default backlog (128) would drop connections,
        # each then retried by the client's TCP a second later
        await web.SockSite(self._runner, sock, backlog=4096).start()
        self.base_url = f"http://{self.host}:{port}"
        logger.info("agent endpoint at %s", self.base_url)
        return self.base_url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _session(self, request: web.Request) -> AgentSession:
        header = request.headers.get("Authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else ""
        session = self.sessions.get(request.match_info["episode"])
        if session is None or not secrets.compare_digest(key.encode(), session.key.encode()):
            self.stats["unauthorized"] += 1
            raise EndpointError(401, "no episode has this API key (each episode has its own)",
                                kind="authentication_error", code="invalid_api_key")  # fmt: skip
        return session

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except EndpointError as exc:
            return _error(exc)
        model = {"id": self.model, "object": "model", "created": 0, "owned_by": "agentrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _reward(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            body = await _json_body(request)
            value = body.get("reward") if isinstance(body, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EndpointError(400, 'post {"reward": <number>}', param="reward")
        except EndpointError as exc:
            return _error(exc)
        session.posted_reward = float(value)
        return web.json_response({"reward": session.posted_reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.stats["requests"] += 1
        session = None
        try:
            session = self._session(request)
            chat = parse_request(await _json_body(request))
            if chat.tool_choice not in (None, "auto", "none"):
                session.counts["tool_choice_unenforced"] += 1
            turn = await session.complete(chat)
        except EndpointError as exc:
            if exc.status < 500:
                self.stats["errors_4xx"] += 1
                if session is not None:
                    session.counts["requests_refused"] += 1
            return _error(exc)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not chat.stream:
            return web.json_response(completion_body(turn, self.model, cid, created))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for chunk in completion_chunks(turn, self.model, cid, created, chat.include_usage):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
