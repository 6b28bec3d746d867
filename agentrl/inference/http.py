"""What the SGLang and vLLM clients share: `HTTPClient` (an aiohttp session with timeouts, bearer
auth and the error mapping of `base`) and `HTTPServerClient`, the part of both clients that does
not depend on the server: health, the weight version with or without a LoRA adapter, the adapters
served (`GET /v1/models`, which both servers answer the same way) and closing.

Errors map onto the three kinds in `base`: 4xx → `BadRequestError`, connection failures /
timeouts → `ServerUnavailableError`, 5xx → `ServerError` (the server answered with its own
failure).
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any

import aiohttp

from agentrl.inference.base import (
    BadRequestError,
    InferenceClient,
    InferenceError,
    ServerError,
    ServerUnavailableError,
    WeightUpdateClient,
)
from agentrl.inference.lora import AdapterClient, newest, served_from_models


class HTTPClient:
    """aiohttp session with timeouts, bearer auth and error mapping; shared by the SGLang and vLLM clients."""

    def __init__(
        self, url: str, api_key: str | None = None, timeout_s: float = 300.0, connect_timeout_s: float = 10.0
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
            # no cap on connections: a roller keeps thousands of generations in flight (aiohttp's
            # default of 100 would silently serialise them)
            connector = aiohttp.TCPConnector(limit=0)
            self._session = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout_s: float | None = None,
        params: dict[str, str] | None = None,
    ) -> Any:
        """Send one request; return the parsed JSON body (or text, or None when empty)."""
        kwargs: dict[str, Any] = {"params": params}
        if body is not None:
            kwargs["json"] = body
        if timeout_s is not None:
            kwargs["timeout"] = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.connect_timeout_s)
        try:
            async with self._client().request(method, f"{self.url}{path}", **kwargs) as resp:
                text = await resp.text()
                status = resp.status
                is_json = resp.content_type == "application/json"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise ServerUnavailableError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if 400 <= status < 500:
            raise BadRequestError(f"{self.url}{path}: HTTP {status}: {text[:2000]}", status)
        if status >= 500:
            raise ServerError(f"{self.url}{path}: HTTP {status}: {text[:2000]}")
        if not text:
            return None
        if is_json:
            import json

            return json.loads(text)
        return text

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class HTTPServerClient(InferenceClient, WeightUpdateClient, AdapterClient):
    """One inference server over HTTP, filling the generation, weight-update and adapter
    interfaces; a backend adds its routes and `_server_version` (and, where its server joins a
    weight group, `DistributedWeightUpdateClient`'s methods: SGLang's and vLLM's clients)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        lora: str | None = None,
    ) -> None:
        self.http = HTTPClient(url, api_key, timeout_s, connect_timeout_s)
        self.url = self.http.url
        self.lora = lora
        """Base name of the adapter requests name (its newest served version); None: the base model."""

    @abc.abstractmethod
    async def _server_version(self) -> int:
        """The base model's weight version as the server reports it."""

    async def health(self) -> bool:
        return await self._answers("/health")

    async def _answers(self, path: str) -> bool:
        """Whether `GET path` answers within the connect timeout (any error: no)."""
        try:
            await self.http.request("GET", path, timeout_s=self.http.connect_timeout_s)
            return True
        except InferenceError:
            return False

    async def get_weight_version(self) -> int:
        """The server's weight version; with `lora`, the newest served adapter version (if any)."""
        if self.lora is not None and (adapter := newest(await self.served_adapters(), self.lora)):
            return adapter[1]
        return await self._server_version()

    async def served_adapters(self) -> dict[str, str]:
        return served_from_models(self.url, await self.http.request("GET", "/v1/models"))

    async def close(self) -> None:
        await self.http.close()
