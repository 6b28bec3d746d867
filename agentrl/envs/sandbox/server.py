"""`agentrl sandbox-server`: the sandbox interface over HTTP, so many rollers share one host.

Roller nodes without Docker (or without bubblewrap) point a `remote` sandbox at a
machine that has them. Every request but `/health` carries `Authorization: Bearer KEY`.

    AGENTRL_SANDBOX_KEY=secret agentrl sandbox-server --port 8765 --backend local

Routes (JSON unless noted):
    GET    /health                          {"ok", "backend", "sandboxes"}
    POST   /sandboxes        {"image"}      {"id", "isolation", "workdir", "tmpdir"}
    POST   /sandboxes/{id}/exec {"cmd", "timeout", "env"}   ExecResult fields
    PUT    /sandboxes/{id}/files?path=P     raw bytes in (403: refused path, 422: OSError, e.g. ENOSPC)
    GET    /sandboxes/{id}/files?path=P     raw bytes out
    DELETE /sandboxes/{id}

The server owns the limits: a client's timeout is capped at the backend's `timeout_s`;
at most `max_sandboxes` live at once (429 beyond); sandboxes idle for `idle_timeout_s`
are closed, so a crashed roller does not leak them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web

from agentrl.envs.sandbox import Sandbox, SandboxError, create
from agentrl.log import get_logger

if TYPE_CHECKING:
    from agentrl.envs.sandbox.config import DockerSandboxConfig, LocalSandboxConfig

logger = get_logger("envs.sandbox.server")

MAX_BODY_BYTES = 64 << 20


class SandboxServer:
    """Holds the live sandboxes of one server process and serves them over aiohttp."""

    def __init__(
        self,
        config: LocalSandboxConfig | DockerSandboxConfig,
        api_key: str,
        max_sandboxes: int = 64,
        idle_timeout_s: float = 1800.0,
    ) -> None:
        if not api_key:
            raise ValueError("the sandbox server needs a non-empty API key")
        self.config = config
        self.api_key = api_key
        self.max_sandboxes = max_sandboxes
        self.idle_timeout_s = idle_timeout_s
        self.sandboxes: dict[str, Sandbox] = {}
        self.last_used: dict[str, float] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_post("/sandboxes", self.create_sandbox)
        app.router.add_post("/sandboxes/{id}/exec", self.exec)
        app.router.add_put("/sandboxes/{id}/files", self.write_file)
        app.router.add_get("/sandboxes/{id}/files", self.read_file)
        app.router.add_delete("/sandboxes/{id}", self.delete)
        app.cleanup_ctx.append(self._reaper_ctx)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path != "/health":
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                return web.json_response({"error": "missing or wrong API key"}, status=401)
        try:
            return await handler(request)
        except SandboxError as exc:
            return web.json_response({"error": str(exc)}, status=400)

    def _get(self, request: web.Request) -> tuple[str, Sandbox]:
        sid = request.match_info["id"]
        if sid not in self.sandboxes:
            raise web.HTTPNotFound(text=f"no sandbox {sid}")
        self.last_used[sid] = time.monotonic()
        return sid, self.sandboxes[sid]

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "backend": self.config.type, "sandboxes": len(self.sandboxes)})

    async def create_sandbox(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        if len(self.sandboxes) >= self.max_sandboxes:
            return web.json_response({"error": f"server full ({self.max_sandboxes} sandboxes)"}, status=429)
        sandbox = create(self.config)
        await sandbox.start(body.get("image"))
        sid = uuid.uuid4().hex
        self.sandboxes[sid] = sandbox
        self.last_used[sid] = time.monotonic()
        return web.json_response(
            {"id": sid, "isolation": sandbox.isolation, "workdir": sandbox.workdir, "tmpdir": sandbox.tmpdir}
        )

    async def exec(self, request: web.Request) -> web.Response:
        sid, sandbox = self._get(request)
        body = await request.json()
        cmd = body.get("cmd")
        if not isinstance(cmd, str | list) or not cmd:
            return web.json_response({"error": "cmd must be a string or a list of strings"}, status=400)
        timeout = min(float(body.get("timeout") or self.config.timeout_s), self.config.timeout_s)
        result = await sandbox.exec(cmd, timeout=timeout, env=body.get("env"))
        self.last_used[sid] = time.monotonic()
        return web.json_response(result.to_dict())

    async def write_file(self, request: web.Request) -> web.Response:
        _, sandbox = self._get(request)
        try:
            await sandbox.write_file(request.query["path"], await request.read())
        except PermissionError as exc:
            return web.json_response({"error": str(exc)}, status=403)
        except OSError as exc:  # e.g. ENOSPC: the sandbox's disk quota is full
            return web.json_response({"error": str(exc), "errno": exc.errno}, status=422)
        return web.json_response({"ok": True})

    async def read_file(self, request: web.Request) -> web.Response:
        _, sandbox = self._get(request)
        try:
            data = await sandbox.read_file(request.query["path"])
        except FileNotFoundError as exc:
            return web.json_response({"error": str(exc)}, status=404)
        except (PermissionError, IsADirectoryError) as exc:
            return web.json_response({"error": str(exc)}, status=403)
        return web.Response(body=data, content_type="application/octet-stream")

    async def delete(self, request: web.Request) -> web.Response:
        sid, _ = self._get(request)
        await self._close(sid)
        return web.json_response({"ok": True})

    async def _close(self, sid: str) -> None:
        sandbox = self.sandboxes.pop(sid, None)
        self.last_used.pop(sid, None)
        if sandbox is not None:
            await sandbox.close()

    async def _reaper_ctx(self, app: web.Application) -> Any:
        """Background `_reap_loop` for the server's lifetime; on shutdown every sandbox is closed."""
        task = asyncio.create_task(self._reap_loop(), name="_reap_loop")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.gather(*(self._close(sid) for sid in list(self.sandboxes)))

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.idle_timeout_s / 2))
            now = time.monotonic()
            for sid, last in list(self.last_used.items()):
                if now - last > self.idle_timeout_s:
                    logger.info("closing sandbox %s: idle for %.0fs", sid, now - last)
                    await self._close(sid)


def serve(
    config: LocalSandboxConfig | DockerSandboxConfig,
    api_key: str,
    host: str,
    port: int,
    max_sandboxes: int = 64,
    idle_timeout_s: float = 1800.0,
) -> None:
    """Run the server until interrupted (SIGINT/SIGTERM close every sandbox first)."""
    server = SandboxServer(config, api_key, max_sandboxes, idle_timeout_s)
    logger.info("sandbox server on http://%s:%d (backend %s)", host, port, config.type)
    web.run_app(server.app(), host=host, port=port, print=None)
