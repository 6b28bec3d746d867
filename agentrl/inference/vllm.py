"""Client of a vLLM server: OpenAI `/v1/completions` with token ids, plus vLLM's RL endpoints.

Generation sends the prompt as token ids and asks for `return_token_ids` (per-choice
`token_ids`) and `logprobs: 0` (the sampled token's log-prob only), following
`CompletionRequest` / `CompletionResponseChoice` in
`vllm/entrypoints/openai/completion/protocol.py`. Weight updates, pause/resume and aborts
use the routes of `vllm/entrypoints/serve/dev/rlhf/api_router.py` (`/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights`, `/finish_weight_update`, `/weight_info`, `/pause`,
`/resume`, `/abort_requests`; the server must be started with `VLLM_SERVER_DEV_MODE=1` and
`--weight-transfer-config`). Both checked at vLLM commit 002032e / 0100a21; `update_info` follows
`NCCLWeightTransferUpdateInfo` in `vllm/distributed/weight_transfer/nccl_engine.py`. See
tests/unit/inference/test_vllm_client.py. The trainer's side of vLLM's NCCL group is vLLM's own
(`NCCLTrainerWeightTransferEngine`, a stateless PyNccl group), not `weight_group.join_group`.

vLLM does not put a weight version in completion responses, so `generate` reads
`/weight_info` before sending and reports that version: if weights change mid-request the
reported version is the older one, which over- rather than under-states staleness.
vLLM reports log-probs of the raw (untempered) distribution unless started with
`--logprobs-mode processed_logprobs`; start it so for temperature ≠ 1.
"""

from __future__ import annotations

from typing import Any

from agentrl.inference.base import (
    GenerateResult,
    InferenceClient,
    InferenceError,
    WeightUpdateClient,
    parse_weight_version,
)
from agentrl.inference.sglang import HTTPClient

# SGLang sampling names → vLLM CompletionRequest names.
_RENAME = {"max_new_tokens": "max_tokens", "sampling_seed": "seed", "min_new_tokens": "min_tokens"}
_PASS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
}


class VLLMClient(InferenceClient, WeightUpdateClient):
    """vLLM's OpenAI-compatible server driven token-in / token-out."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.http = HTTPClient(url, api_key, timeout_s, connect_timeout_s)
        self.url = self.http.url
        self.model = model

    def completion_payload(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None, session_id: str | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(input_ids),
            "max_tokens": 128,
            "n": 1,
            "logprobs": 0,
            "return_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if self.model is not None:
            body["model"] = self.model
        for key, value in sampling_params.items():
            if key in _RENAME:
                body[_RENAME[key]] = value
            elif key in _PASS:
                body[key] = value
            elif key != "n" or value != 1:
                raise InferenceError(f"sampling_params.{key} has no vLLM equivalent in this client")
        if body.get("top_k") == -1:
            body["top_k"] = 0  # vLLM's "disabled"
        if rid is not None:
            body["request_id"] = rid
        if session_id is not None:
            body["session_id"] = session_id
        return body

    def parse_completion(self, reply: Any, weight_version: int) -> GenerateResult:
        try:
            choice = reply["choices"][0]
            token_ids = choice["token_ids"]
            if token_ids is None:
                raise InferenceError(
                    "vLLM returned no token_ids (is return_token_ids supported by this version?)"
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            reason = choice.get("finish_reason") or "abort"
            if reason not in ("stop", "length", "abort"):
                raise InferenceError(f"unknown finish_reason {reason!r}")
            usage = reply.get("usage") or {}
            return GenerateResult(
                output_ids=[int(t) for t in token_ids],
                logprobs=[float(x) for x in logprobs],
                finish_reason=reason,
                matched=choice.get("stop_reason"),
                weight_version=weight_version,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", len(token_ids))),
                text=choice.get("text"),
                server=self.url,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InferenceError(
                f"/v1/completions: malformed response ({exc!r}): {str(reply)[:500]}"
            ) from exc

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        version = await self.get_weight_version()
        payload = self.completion_payload(input_ids, sampling_params, rid, session_id)
        reply = await self.http.request("POST", "/v1/completions", payload)
        return self.parse_completion(reply, version)

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", timeout_s=self.http.connect_timeout_s)
            return True
        except InferenceError:
            return False

    async def alive(self) -> bool:
        return await self.health()

    async def get_weight_version(self) -> int:
        reply = await self.http.request("GET", "/weight_info")
        return parse_weight_version(reply.get("weight_version") if isinstance(reply, dict) else None)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """vLLM's transfer backend is fixed at launch (`--weight-transfer-config`); `backend` and
        `group_name` are not sent."""
        init_info = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
        }
        await self.http.request("POST", "/init_weight_transfer_engine", {"init_info": init_info})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
    ) -> None:
        await self.http.request("POST", "/start_weight_update", {})
        # `packed` is left out: older releases default it to False, newer ones moved it to the init info.
        update_info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
        await self.http.request("POST", "/update_weights", {"update_info": update_info})
        body = {} if weight_version is None else {"weight_version": str(weight_version)}
        await self.http.request("POST", "/finish_weight_update", body)

    async def begin_weight_update(self) -> None:
        """Nothing to send: `update_weights_from_distributed` opens and closes vLLM's update itself
        (`/start_weight_update` … `/finish_weight_update` per bucket)."""

    async def end_weight_update(self, weight_version: int | None = None) -> None:
        """Nothing to send (see `begin_weight_update`)."""

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        raise InferenceError(
            "vLLM: loading weights from disk is not exposed over its HTTP API; use the broadcast weight sync"
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        """vLLM has no route to leave the transfer group; it lives as long as the server."""

    async def pause_generation(self) -> None:
        await self.http.request("POST", "/pause", params={"mode": "abort"})

    async def continue_generation(self) -> None:
        await self.http.request("POST", "/resume")

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if not abort_all and rid is None:
            raise InferenceError("abort_request: give rid or abort_all=True")
        body = {} if abort_all else {"request_ids": [rid]}
        await self.http.request("POST", "/abort_requests", body)

    async def close(self) -> None:
        await self.http.close()
