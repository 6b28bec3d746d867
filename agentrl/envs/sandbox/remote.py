"""The remote sandbox: the `Sandbox` interface, served by `agentrl sandbox-server` elsewhere.

For roller nodes that cannot isolate code themselves (no Docker, no bubblewrap): each
call is one HTTP request to the server, authenticated with the API key read from the
environment variable `api_key_env`. Isolation and limits are the server's; `start()`
records the isolation level the server reports.
"""

from __future__ import annotations

import errno
import os
import uuid
from typing import TYPE_CHECKING, Any

import aiohttp

from agentrl.envs.sandbox.base import ExecResult, Sandbox, SandboxError, local_directory, tar_directory

if TYPE_CHECKING:
    from agentrl.envs.sandbox.config import RemoteSandboxConfig


class RemoteSandbox(Sandbox):
    """A sandbox living on a sandbox server (see `agentrl.envs.sandbox.server`)."""

    def __init__(self, config: RemoteSandboxConfig) -> None:
        self.config = config
        self.url = config.url.rstrip("/")
        key = os.environ.get(config.api_key_env, "")
        if not key:
            raise SandboxError(
                f"sandbox.api_key_env: environment variable {config.api_key_env} (the sandbox server's "
                "API key) is not set"
            )
        self._headers = {"Authorization": f"Bearer {key}"}
        self._session: aiohttp.ClientSession | None = None
        self.id: str | None = None

    async def _request(self, method: str, path: str, timeout: float, **kwargs: Any) -> aiohttp.ClientResponse:
        if self._session is None:
            raise SandboxError("sandbox not started")
        client_timeout = aiohttp.ClientTimeout(total=timeout, connect=self.config.connect_timeout_s)
        try:
            response = await self._session.request(method, self.url + path, timeout=client_timeout, **kwargs)
            await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise SandboxError(f"sandbox server {self.url}: {type(exc).__name__}: {exc}") from exc
        return response

    @staticmethod
    async def _error(response: aiohttp.ClientResponse) -> str:
        try:
            return (await response.json()).get("error", response.reason)
        except (aiohttp.ContentTypeError, ValueError):
            return (await response.text()) or str(response.reason)

    async def _check(self, response: aiohttp.ClientResponse, what: str) -> None:
        if response.status >= 400:
            raise SandboxError(
                f"sandbox server {what}: HTTP {response.status}: {await self._error(response)}"
            )

    async def start(self, image_or_spec: str | None = None) -> None:
        if self.id is not None:
            raise SandboxError("sandbox already started")
        upload = local_directory(image_or_spec)
        self._session = aiohttp.ClientSession(headers=self._headers)
        try:
            image = None if upload else image_or_spec
            response = await self._request("POST", "/sandboxes", 300.0, json={"image": image})
            await self._check(response, "start")
        except BaseException:
            await self._session.close()
            self._session = None
            raise
        body = await response.json()
        self.id, self.isolation, self.workdir = body["id"], body["isolation"], body["workdir"]
        self.tmpdir = body.get("tmpdir", "/tmp")
        if upload:
            await self._upload(upload)

    async def _upload(self, directory: str) -> None:
        """Copy a local directory into the remote working directory (unpacked inside the sandbox)."""
        name = f"{self.tmpdir}/agentrl-upload-{uuid.uuid4().hex[:12]}.tar"
        await self.write_file(name, tar_directory(directory))
        result = await self.exec(["tar", "-xf", name, "-C", self.workdir, "--no-same-owner"], timeout=300)
        await self.exec(["rm", "-f", name])
        if result.exit_code != 0:
            await self.close()
            raise SandboxError(f"cannot unpack {directory} in the remote sandbox: {result.stderr.strip()}")

    async def exec(
        self, cmd: str | list[str], timeout: float | None = None, env: dict[str, str] | None = None
    ) -> ExecResult:
        timeout = timeout or self.config.timeout_s
        payload = {"cmd": cmd, "timeout": timeout, "env": env}
        response = await self._request("POST", f"/sandboxes/{self.id}/exec", timeout + 60.0, json=payload)
        await self._check(response, "exec")
        body = await response.json()
        return ExecResult(body["exit_code"], body["stdout"], body["stderr"], body["timed_out"])

    async def write_file(self, path: str, data: str | bytes) -> None:
        payload = data.encode() if isinstance(data, str) else data
        response = await self._request(
            "PUT", f"/sandboxes/{self.id}/files", 120.0, params={"path": path}, data=payload
        )
        if response.status == 403:
            raise PermissionError(await self._error(response))
        if response.status == 422:  # the server's OSError, e.g. ENOSPC when the disk quota is full
            body = await response.json()
            raise OSError(body.get("errno") or errno.EIO, body.get("error", "write_file failed"))
        await self._check(response, "write_file")

    async def read_file(self, path: str) -> bytes:
        response = await self._request("GET", f"/sandboxes/{self.id}/files", 120.0, params={"path": path})
        if response.status == 404:
            raise FileNotFoundError(await self._error(response))
        if response.status == 403:
            raise PermissionError(await self._error(response))
        await self._check(response, "read_file")
        return await response.read()

    async def close(self) -> None:
        if self._session is None:
            return
        try:
            if self.id is not None:
                await self._request("DELETE", f"/sandboxes/{self.id}", 60.0)
        except SandboxError:
            pass  # the server reaps sandboxes left idle
        finally:
            await self._session.close()
            self._session = None
            self.id = None
