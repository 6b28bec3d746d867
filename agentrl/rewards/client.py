"""The roller's side of a served reward model: score transcripts, batched, with bounded waits.

    client = RewardModelClient(config.reward)
    await client.check()                       # reachable, and the kind the config expects
    score = await client.score(transcript.messages)

Concurrent `score` calls (the episodes of every group in flight) are gathered by a
`MicroBatcher` into one `POST /score` of up to `reward.max_batch_size` conversations. Every
request is bounded by `reward.timeout_s`; an unreachable scorer, a timeout, an HTTP error or an
answer that is not one finite number per conversation raises `RewardModelError` naming the
address, which fails the episode's group (the roller counts it and goes on).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any

import aiohttp

from agentrl.rewards.batching import MicroBatcher
from agentrl.rewards.config import RewardConfig


class RewardModelError(RuntimeError):
    """The reward model could not score (unreachable, timed out, refused, or a malformed answer)."""


class RewardModelClient:
    def __init__(self, config: RewardConfig) -> None:
        if not config.url:
            raise ValueError("reward.url: the address of a running `agentrl serve-reward` is needed")
        self.config = config
        self.url = config.url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        self._batcher = MicroBatcher(self._post, config.max_batch_size, config.batch_wait_ms / 1000)
        self.calls = 0
        self.scored = 0
        self.errors = 0
        self.seconds = 0.0
        self.server_batches: deque[int] = deque(maxlen=1024)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.timeout_s)
            self._session = aiohttp.ClientSession(timeout=timeout)
        return self._session

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        where = f"reward model at {self.url}{path}"
        try:
            async with self._client().request(method, self.url + path, **kwargs) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RewardModelError(f"{where}: HTTP {resp.status}: {text[:300]}")
                try:
                    return await resp.json(content_type=None)
                except ValueError:
                    raise RewardModelError(f"{where}: answer is not JSON: {text[:200]!r}") from None
        except TimeoutError:  # before ClientError: aiohttp's ServerTimeoutError is both
            raise RewardModelError(
                f"{where}: no answer within reward.timeout_s={self.config.timeout_s}"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise RewardModelError(f"{where}: cannot reach it ({type(exc).__name__}: {exc})") from None

    async def check(self, wait_s: float | None = None) -> dict[str, Any]:
        """The scorer's `/model_info`; `RewardModelError` if it is of another kind, or still
        unreachable after `wait_s` (default `reward.timeout_s`: a scorer started beside the
        roller may still be loading its model)."""
        deadline = time.monotonic() + (self.config.timeout_s if wait_s is None else wait_s)
        while True:
            try:
                info = await self._request("GET", "/model_info")
                break
            except RewardModelError as exc:
                if "cannot reach it" not in str(exc) or time.monotonic() + 0.5 > deadline:
                    raise
                await asyncio.sleep(0.5)
        if not isinstance(info, dict) or info.get("kind") != self.config.kind:
            raise RewardModelError(
                f"reward model at {self.url} serves kind {info.get('kind') if isinstance(info, dict) else info!r}, "
                f"but reward.kind is {self.config.kind!r}"
            )
        return info

    async def _post(self, conversations: list[list[dict[str, Any]]]) -> list[float]:
        t0 = time.perf_counter()
        self.calls += 1
        try:
            body = await self._request("POST", "/score", json={"conversations": conversations})
            scores = body.get("scores") if isinstance(body, dict) else None
            if (
                not isinstance(scores, list)
                or len(scores) != len(conversations)
                or not all(
                    isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                    for s in scores
                )
            ):
                raise RewardModelError(
                    f"reward model at {self.url}/score: expected {len(conversations)} finite scores, "
                    f"got {str(body)[:200]}"
                )
        except RewardModelError:
            self.errors += 1
            raise
        finally:
            self.seconds += time.perf_counter() - t0
        if isinstance(body.get("batch_size"), int):
            self.server_batches.append(body["batch_size"])
        self.scored += len(scores)
        return [float(s) for s in scores]

    async def score(self, messages: list[dict[str, Any]]) -> float:
        """The reward model's score of one conversation (batched with concurrent calls)."""
        return await self._batcher.submit(messages)

    def metrics(self) -> dict[str, float]:
        """For the roller's metrics record."""
        server = list(self.server_batches)
        return {
            "roller/reward_model_calls": self.calls,
            "roller/reward_model_scored": self.scored,
            "roller/reward_model_errors": self.errors,
            "roller/reward_model_s": self.seconds / self.calls if self.calls else 0.0,
            "roller/reward_model_batch_mean": self._batcher.stats()["batch_size_mean"],
            "roller/reward_model_server_batch_mean": sum(server) / len(server) if server else 0.0,
        }

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
