"""Async client of a Search-R1-style retriever (`agentrl retriever` or Search-R1's own server).

    client = RetrieverClient("http://127.0.0.1:8000/retrieve", topk=3)
    results = await client.search(["who founded Quorvel?"])   # one list of hits per query
    text = format_passages(results[0])                       # 'Doc 1(Title: ...) ...' lines

The URL may name the `/retrieve` route (as Search-R1's `retriever.url` does) or just the
server. Requests always ask for scores; answers with or without them are both understood.
Connection errors and 5xx are retried a few times with backoff, then raised as
`RetrieverError`: a dead retriever stops the run loudly instead of feeding empty results.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp


class RetrieverError(RuntimeError):
    """The retriever could not answer (unreachable, 5xx after retries, or a 4xx)."""


def retrieve_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/retrieve") else f"{url}/retrieve"


def _document(hit: Any) -> dict[str, Any]:
    """The document of one hit, whether the server returned scores or not."""
    if isinstance(hit, dict) and isinstance(hit.get("document"), dict):
        return hit["document"]
    return hit if isinstance(hit, dict) else {"contents": str(hit)}


def _score(hit: Any) -> float | None:
    return hit.get("score") if isinstance(hit, dict) and "document" in hit else None


def format_passages(hits: list[Any]) -> str:
    """Search-R1's passage block: one `Doc i(Title: <first line>) <rest>` line per document.

    Protocol as in Search-R1's `search_r1/llm_agent/generation.py` (`_passages2string`)."""
    lines = []
    for i, hit in enumerate(hits, 1):
        title, _, text = str(_document(hit).get("contents", "")).partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


class RetrieverClient:
    """One aiohttp session to a retriever; `close()` it when done. `url` may be a function giving
    the current URL, asked again on every attempt (a retriever that moved, `base.live_services`)."""

    def __init__(
        self,
        url: str | Callable[[], str],
        topk: int = 3,
        timeout_s: float = 60.0,
        retries: int = 2,
        backoff_s: float = 0.5,
    ) -> None:
        self._url = url
        self.topk = topk
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return retrieve_url(self._url() if callable(self._url) else self._url)

    async def search(self, queries: list[str], topk: int | None = None) -> list[list[dict[str, Any]]]:
        """Hits (`{"document": {...}, "score": s}`) of each query, best first."""
        if not queries:
            return []
        payload = {"queries": list(queries), "topk": topk or self.topk, "return_scores": True}
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            url = self.url
            try:
                async with self._session.post(url, json=payload) as response:
                    if 400 <= response.status < 500:
                        raise RetrieverError(f"{url} refused the request: {await response.text()}")
                    if response.status >= 500:
                        last = RetrieverError(f"{url} answered {response.status}")
                        continue
                    body = await response.json()
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = RetrieverError(f"{url} unreachable: {type(exc).__name__}: {exc}")
                continue
            result = body.get("result") if isinstance(body, dict) else None
            if not isinstance(result, list) or len(result) != len(queries):
                raise RetrieverError(f"{url} answered without one result list per query: {str(body)[:200]}")
            return [[{"document": _document(h), "score": _score(h)} for h in row] for row in result]
        assert last is not None
        raise last

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
