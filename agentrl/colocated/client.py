"""The rollers' `InferenceClient` over an engine in this process: the colocated agent loop's server.

In colocated mode each engine replica's leader runs the same agent loop as the decoupled roller
(`agentrl.rollers.agent_loop.run_episode`), but its requests go straight to the rank-local
`Engine` instead of over HTTP. Requests are validated by the embedded server's own code
(`agentrl.inference.server`), so both see the same sampling parameters and the same errors.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from typing import Any

from agentrl.inference.base import BadRequestError, GenerateResult, InferenceClient, parse_weight_version
from agentrl.inference.engine import Engine, Request
from agentrl.inference.protocol import BadInput


class EngineClient(InferenceClient):
    """Generate on a started `Engine` of this process (the engine thread does the work)."""

    url = "engine://local"

    def __init__(self, engine: Engine, seed: int | None = None) -> None:
        """`seed`: every request without its own `sampling_seed` gets one drawn from `seed`, the
        prompt and how many times this client has seen that prompt, so that the same step
        samples the same tokens however the engine batches its requests (a resumed run repeats
        the uninterrupted one)."""
        self.engine = engine
        self.seed = seed
        self._seen: dict[bytes, int] = {}
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        """New requests wait (in `generate`) until `resume`: between two colocated steps, while the
        engine's buffers are released and the ranks train."""
        self._open.clear()

    def resume(self, seed: int | None) -> None:
        """Let held and new requests through, seeded from `seed` as if this were a new client."""
        self.seed, self._seen = seed, {}
        self._open.set()

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        from agentrl.inference.server import _prompt_ids, _sampling

        await self._open.wait()
        if self.seed is not None and sampling_params.get("sampling_seed") is None:
            sampling_params = {**sampling_params, "sampling_seed": self._seed_for(input_ids)}
        try:
            params, _ = _sampling(sampling_params, self.engine)
            ids = _prompt_ids(input_ids, self.engine, "input_ids")
        except BadInput as exc:
            raise BadRequestError(str(exc)) from None
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def done(req: Request) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(req))

        rid = rid or uuid.uuid4().hex
        self.engine.submit(Request(rid, ids, params, done))
        try:
            req = await future
        except asyncio.CancelledError:
            self.engine.call(lambda: self.engine.abort(rid))
            raise
        finish = req.finish_reason or {}
        return GenerateResult(
            output_ids=list(req.output_ids),
            logprobs=list(req.logprobs),
            finish_reason=finish.get("type", "abort"),
            matched=finish.get("matched"),
            weight_version=parse_weight_version(req.weight_version),
            prompt_tokens=len(ids),
            completion_tokens=len(req.output_ids),
            server=self.url,
        )

    def _seed_for(self, input_ids: list[int]) -> int:
        key = hashlib.sha256(repr(list(input_ids)).encode()).digest()
        nth = self._seen[key] = self._seen.get(key, -1) + 1
        material = f"{self.seed}:{key.hex()}:{nth}".encode()
        return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") >> 1

    async def health(self) -> bool:
        return self.engine.alive

    async def get_weight_version(self) -> int:
        return parse_weight_version(self.engine.weight_version)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        await asyncio.wrap_future(self.engine.call(lambda: self.engine.abort(rid, abort_all=abort_all)))

    async def close(self) -> None:
        return None
