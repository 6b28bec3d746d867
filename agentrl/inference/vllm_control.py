"""The weight-update and LoRA control half of the vLLM client: `VLLMControl`, which
`vllm.VLLMClient` extends with generation; what weight sync drives a vLLM server through
(`DistributedWeightUpdateClient`, and `AdapterClient` for LoRA adapters).

Weight-update control runs agentrl's own protocol through `POST /collective_rpc` (dev mode,
`VLLM_SERVER_DEV_MODE=1`) into `agentrl.inference.vllm_worker.AgentRLWorkerExtension`
(`--worker-extension-cls`): join agentrl's weight group (gloo on CPU, NCCL on GPU), stage
each broadcast bucket, commit the whole set at `end_weight_update`, then
`/update_weight_version`. The disk fallback loads through the same commit. vLLM's native
weight-transfer engines (nccl, ipc, ...) are not used: none runs on CPU, and a failed update
through them killed the engine. Pause / resume are `/pause?mode=abort`, `/resume`.
LoRA adapters (`inference/lora.py`, servers started with `inference.vllm.lora`): vLLM's own
runtime loading, `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (`lora_name`,
`lora_path`; `vllm/entrypoints/serve/lora/api_router.py`, on with
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), the served set read back from `GET /v1/models`
(`OpenAIServingModels.show_available_models`: an adapter card has `parent`), the limits from
`GET /server_info?config_format=json` (`lora_config`), and the adapter named per request as its
`model` (`_maybe_get_adapters` in `vllm/entrypoints/serve/engine/serving.py`; an unknown name is a
404 `ErrorResponse`). vLLM's unload only drops the name from the API server's table; the engine
evicts the weights from its cache (`--max-cpu-loras`) when it needs the room. Weight sync's
adapter pushes come in by `load_lora_adapter` (disk: a PEFT directory by path) or
`load_lora_tensors` (the broadcast engine, over HTTP through `load_adapter_tensors`).
See tests/unit/inference/test_vllm_client.py, tests/integration/test_vllm.py and
tests/integration/test_vllm_lora.py.
"""

from __future__ import annotations

import json
from typing import Any

from agentrl.inference.base import (
    BadRequestError,
    DistributedWeightUpdateClient,
    InferenceError,
    ServerUnavailableError,
    parse_weight_version,
)
from agentrl.inference.http import HTTPServerClient
from agentrl.inference.lora import AdapterError, AdapterLimits, AdapterSpec, adapter_name, split_name
from agentrl.log import get_logger

logger = get_logger(__name__)


class VLLMControl(HTTPServerClient, DistributedWeightUpdateClient):
    """A vLLM server's weight-update control and LoRA adapters; generation is `VLLMClient`'s."""

    flattened_buckets = True
    """The worker extension takes a bucket as one flat uint8 broadcast (`agentrl_receive`)."""
    stages_updates = True
    """The workers stage buckets and load them only at the commit (`agentrl_commit`)."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        group_timeout_s: float = 120.0,
        lora: str | None = None,
    ) -> None:
        super().__init__(url, api_key, timeout_s, connect_timeout_s, lora)
        self.group_timeout_s = group_timeout_s
        """Timeout of the workers' weight-group set-up and of each of their receives."""
        self._pending_version: int | None = None  # the version the staged buckets were announced with

    async def alive(self) -> bool:
        return await self.health()  # vLLM's /health answers while paused

    async def _server_version(self) -> int:
        reply = await self.http.request("GET", "/weight_info")
        return parse_weight_version(reply.get("weight_version") if isinstance(reply, dict) else None)

    # ------------------------------------------------------------------ weight-update control

    async def rpc(self, method: str, **kwargs: Any) -> list[Any]:
        """Call `AgentRLWorkerExtension.<method>` on every worker; their answers, one per worker."""
        body = {"method": method, "kwargs": {"payload": json.dumps(kwargs)}, "timeout": self.http.timeout_s}
        try:
            reply = await self.http.request("POST", "/collective_rpc", body)
        except ServerUnavailableError:
            # vLLM answers a failed RPC with a 500 from its error middleware and drops the connection;
            # a fresh session keeps the next call (the commit after a failed receive) off that socket.
            await self.http.close()
            raise
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results:
            raise InferenceError(f"/collective_rpc {method}: unexpected reply {str(reply)[:300]}")
        return results

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """Every worker joins at `rank_offset + its rank` (so a server takes tensor_parallel_size ranks)."""
        await self.rpc(
            "agentrl_join_group",
            master_address=master_address,
            master_port=master_port,
            rank_offset=rank_offset,
            world_size=world_size,
            group_name=group_name,
            backend=backend,
            timeout_s=self.group_timeout_s,
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        await self.rpc("agentrl_leave_group")

    async def pause_generation(self) -> None:
        await self.http.request("POST", "/pause", params={"mode": "abort"})

    async def continue_generation(self) -> None:
        await self.http.request("POST", "/resume")

    async def begin_weight_update(self, pause: bool = False) -> None:
        """Drop anything a previous, unfinished push left staged (`pause`: pause generation first;
        vLLM has no `session_control`, so this is two requests)."""
        if pause:
            await self.pause_generation()
        self._pending_version = None
        await self.rpc("agentrl_discard")

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: int | None = None,
        flattened: bool = False,
        bucket: int | None = None,
        more: list[dict[str, Any]] | None = None,
    ) -> None:
        """Receive one bucket into the workers' staging area; the model changes at `end_weight_update`,
        which tags it with this `weight_version` unless given one itself. (`bucket` is unused: vLLM
        is not `ordered_buckets`, so each bucket's reply comes before the next is announced; it
        takes no `more`: it is not `bucket_batches`.)"""
        if more:
            raise ValueError("vLLM's worker receives one bucket per request (no bucket_batches)")
        self._pending_version = weight_version
        await self.rpc(
            "agentrl_receive",
            names=names,
            dtypes=dtypes,
            shapes=shapes,
            group_name=group_name,
            flattened=flattened,
        )

    async def end_weight_update(self, weight_version: int | None = None, resume: bool = False) -> None:
        """Commit what was staged, all of it or nothing (the worker checks it is a whole checkpoint),
        then tag the server with `weight_version` (`resume`: then continue generation). After a
        failed bucket nothing is staged, so the commit fails and the server keeps its previous
        weights and version. Returns None: the caller reads the version back."""
        pending, self._pending_version = self._pending_version, None
        await self.rpc("agentrl_commit")
        await self._set_version(weight_version if weight_version is not None else pending)
        if resume:
            await self.continue_generation()

    async def abort_weight_update(self) -> None:
        """Drop what the workers staged: the model and its version stay as they were."""
        self._pending_version = None
        await self.rpc("agentrl_discard")

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        """Load `<model_path>/*.safetensors` through the worker's checked, re-tied commit; the caller
        pauses first (`/pause` clears vLLM's prefix cache, computed with the old weights)."""
        await self.rpc("agentrl_load_from_disk", path=str(model_path))
        await self._set_version(weight_version)

    async def _set_version(self, weight_version: int | None) -> None:
        if weight_version is not None:
            await self.http.request("POST", "/update_weight_version", {"new_version": str(weight_version)})

    # ------------------------------------------------------------------ LoRA adapters

    async def adapter_limits(self) -> AdapterLimits:
        """`lora_config` of the server's `/server_info` (dev mode): `--max-lora-rank`, `--max-loras`."""
        reply = await self.http.request("GET", "/server_info", params={"config_format": "json"})
        try:
            lora = reply["vllm_config"]["lora_config"]
        except (KeyError, TypeError) as exc:
            raise AdapterError(f"{self.url}/server_info: no vllm_config ({str(reply)[:200]})") from exc
        if not lora:
            raise AdapterError(f"{self.url} was started without --enable-lora: it cannot serve adapters")
        return AdapterLimits(max_rank=int(lora["max_lora_rank"]), max_loras=int(lora["max_loras"]))

    async def load_adapter_tensors(
        self, base: str, tensors: dict[str, Any], config: dict[str, Any], version: int
    ) -> str:
        """`load_adapter` for an adapter held as tensors (PEFT's names, as in `adapter_model.safetensors`)
        and its PEFT config: checked against the limits, sent over HTTP to the worker extension, which
        writes it where the server can read it (`agentrl_write_adapter`), then loaded from there. For
        servers that cannot read the learner's files; the bytes travel once per server."""
        import base64

        from safetensors.torch import save

        (await self.adapter_limits()).check(AdapterSpec.from_config(config), self.url)
        name = adapter_name(base, version)
        data = base64.b64encode(save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}))
        try:
            written = await self.rpc(
                "agentrl_write_adapter", name=name, config=config, safetensors=data.decode()
            )
        except InferenceError as exc:
            raise AdapterError(f"adapter {name}: writing it on {self.url} failed: {exc}") from exc
        return await self.load_adapter(base, written[0]["path"], version)

    async def load_lora_tensors(
        self, name: str, tensors: dict[str, Any], config: dict[str, Any], weight_version: int
    ) -> None:
        """Weight sync's adapter push over HTTP (the broadcast engine's path to vLLM): serve `tensors`
        as `name` (`<base>-v<weight_version>`) through `load_adapter_tensors`, read back; then
        `keep_two` (the previous version stays for requests in flight, older ones go)."""
        base, version = split_name(name, weight_version)
        await self.load_adapter_tensors(base, tensors, config, version)
        await self.keep_two(base, version)

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; then delete its directory if `load_adapter_tensors` wrote it."""
        await super().unload_adapter(name)
        try:
            await self.rpc("agentrl_remove_adapter", name=name)
        except InferenceError as exc:  # a vLLM without agentrl's worker extension wrote none
            logger.warning("%s: adapter %s unloaded, its directory not removed: %s", self.url, name, exc)

    async def _load(self, name: str, path: str) -> None:
        await self._lora_call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, name)

    async def _unload(self, name: str) -> None:
        await self._lora_call("/v1/unload_lora_adapter", {"lora_name": name}, name)

    async def _lora_call(self, route: str, body: dict[str, Any], name: str) -> None:
        """vLLM answers these routes with a plain-text success or an `ErrorResponse` (4xx/5xx); the
        routes exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` (`serve/lora/api_router.py`)."""
        try:
            await self.http.request("POST", route, body)
        except BadRequestError as exc:
            if no_route(exc):
                raise AdapterError(
                    f"{self.url}{route}: no such route (start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; "
                    f"agentrl serve does with inference.vllm.lora set): {exc}"
                ) from exc
            raise AdapterError(f"adapter {name}: {exc}") from exc
        except InferenceError as exc:
            raise AdapterError(f"adapter {name}: {exc}") from exc


def no_route(exc: BadRequestError) -> bool:
    """The server has no such route: 403 (a scale-out route without the flag) or FastAPI's bare 404,
    not a 404 `ErrorResponse` about the request (an unknown model or adapter)."""
    message = str(exc)
    return exc.status == 403 or (exc.status == 404 and '"detail"' in message and "Not Found" in message)
