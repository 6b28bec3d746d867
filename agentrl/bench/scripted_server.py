"""A real HTTP server speaking SGLang's `/generate` that answers with scripted tokens.

It is the outside edge that roller tests and `agentrl bench roller` fake: no model, just
an aiohttp server on loopback that returns whatever `script(input_ids, sampling_params)`
says, instantly, in SGLang's response shape. It records every request so tests can check
exactly what the roller sent (e.g. prompt + tokens so far after an abort).

    server = ScriptedServer(lambda ids, params: Reply([5, 6, 2], finish="stop"))
    url = await server.start()
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Reply:
    """One scripted `/generate` answer."""

    output_ids: list[int]
    finish: str = "stop"  # stop | length | abort
    logprobs: list[float] | None = None  # default: -0.5 per token
    weight_version: int | None = None  # default: the server's current version
    delay_s: float = 0.0


Script = Callable[[list[int], dict[str, Any]], Reply | Awaitable[Reply]]


@dataclass
class ScriptedServer:
    script: Script
    host: str = "127.0.0.1"
    weight_version: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    record: bool = True

    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=256 << 20)  # as the embedded server: long episodes
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/get_weight_version", self._version)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind((self.host, port))
        self.port = sock.getsockname()[1]
        site = web.SockSite(self._runner, sock)
        await site.start()
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": str(self.weight_version)})

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.record:
            self.requests.append(body)
        reply = self.script(body["input_ids"], body.get("sampling_params", {}))
        if asyncio.iscoroutine(reply):
            reply = await reply
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        logprobs = reply.logprobs if reply.logprobs is not None else [-0.5] * len(reply.output_ids)
        version = self.weight_version if reply.weight_version is None else reply.weight_version
        finish: dict[str, Any] = {"type": reply.finish}
        if reply.finish == "stop" and reply.output_ids:
            finish["matched"] = reply.output_ids[-1]
        elif reply.finish == "length":
            finish["length"] = len(reply.output_ids)
        else:
            finish["message"] = "scripted abort"
        return web.json_response(
            {
                "text": "",
                "output_ids": reply.output_ids,
                "meta_info": {
                    "id": body.get("rid", ""),
                    "finish_reason": finish,
                    "prompt_tokens": len(body["input_ids"]),
                    "completion_tokens": len(reply.output_ids),
                    "weight_version": str(version),
                    "output_token_logprobs": [
                        [lp, t, None] for lp, t in zip(logprobs, reply.output_ids, strict=True)
                    ],
                },
            }
        )
