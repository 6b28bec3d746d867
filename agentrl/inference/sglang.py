"""Client of SGLang's native HTTP API; it also drives agentrl's embedded server.

Request and response shapes follow SGLang 0.5.23 (the PyPI wheel): `GenerateReqInput` and the
weight-update request structs in `sglang/srt/managers/io_struct.py`, the routes of
`sglang/srt/entrypoints/http_server.py` (see tests/unit/inference/test_contracts.py and the
strict stand-in, tests/sglang_standin.py). What 0.5.23 requires of a client:

- `/update_weights_from_distributed` only inside `/begin_weight_update` … `/end_weight_update`
  (`SchedulerWeightUpdaterManager.update_weights_from_distributed` in
  `srt/managers/scheduler_components/weight_updater.py` answers 400 otherwise). Releases without
  the session routes (404 on begin) are detected once per client, logged, and pushed to without
  a session; `flattened_bucket` is only used where the session routes exist.
- a session commits as SGLang applies it: each bucket is loaded as it arrives and the version
  recorded with it, so a push aborted midway may leave a mix (`stages_updates` False). The
  embedded server says at `/begin_weight_update` that it stages instead (`"staged_commit": true`,
  an agentrl extra: buckets applied and the version set only at `/end_weight_update`; an
  `/end_weight_update` with the extra field `"abort": true` discards them; SGLang ignores both
  fields, its admin structs ignore unknown keys).
- the version comes from `GET /model_info` (`model_info`); `/get_weight_version` is gone.
- liveness is `GET /ping` (`sagemaker_health`: a flag check that answers 200 while paused);
  `/health` runs a one-token generation unless `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`
  and is held while paused, so weight sync never uses it. Errors map onto the three kinds in `base`:
4xx → `BadRequestError`, connection failures / timeouts → `ServerUnavailableError`, 5xx →
`ServerError` (its subclass: the server answered with its own failure).
- a request the engine failed is an HTTP error (500 with `{"detail": message}`, 503 for a timeout
  abort), not a 200 with `finish_reason.type == "abort"`; that abort, with `status_code` null, is
  only a pause or an abort call, which the roller resumes (`_raise_if_failed`).
"""

from __future__ import annotations

from typing import Any

from agentrl.inference.base import (
    BadRequestError,
    DistributedWeightUpdateClient,
    GenerateResult,
    InferenceError,
    ServerError,
    parse_weight_version,
)
from agentrl.inference.http import HTTPServerClient
from agentrl.inference.lora import (
    AdapterError,
    AdapterLimits,
    generate_with_adapter,
)
from agentrl.log import get_logger

logger = get_logger(__name__)


def _check_success(path: str, reply: Any) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise InferenceError(f"{path}: {reply.get('message', 'failed')}")


def _raise_if_failed(url: str, finish: dict[str, Any]) -> None:
    """An abort that carries an error status is a failure, not a resumable abort: SGLang 0.5.23's
    `FINISH_ABORT(message, status_code)` (`srt/managers/schedule_batch.py`). A non-streamed
    /generate answers it as an HTTP error (`TokenizerManager._handle_abort_finish_reason`); a
    reply that carries it anyway (a batch, a proxy) raises the same errors here."""
    status = finish.get("status_code")
    if finish.get("type") != "abort" or not isinstance(status, int) or not 400 <= status < 600:
        return
    message = f"{url}/generate: HTTP {status}: {finish.get('message', '')}"
    if status >= 500:
        raise ServerError(message)
    raise BadRequestError(message, status)


def _routed_experts(meta: dict[str, Any], prompt_tokens: int, output_tokens: int, kind: str) -> Any:
    """SGLang 0.5.23's `meta_info["routed_experts"]` (base64 int32, one row per fed token: prompt +
    output − 1 rows) as an int32 [rows, layers·top_k] array; None for an abort with no rows (aborted
    before any forward: the embedded server then sends an empty array), which the resumed request
    covers, as vLLM's client does (`vllm.routed_rows`)."""
    import base64

    import numpy as np

    text = meta.get("routed_experts")
    if text is None:
        raise InferenceError(
            "/generate: asked for routed experts and got none: is the model a mixture of experts, and "
            "was SGLang started with --enable-return-routed-experts?"
        )
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    if not flat.size and kind == "abort":
        return None
    rows = prompt_tokens + output_tokens - 1
    if rows <= 0 or not flat.size or flat.size % rows:
        raise InferenceError(
            f"/generate: {flat.size} routed experts are not {rows} rows of prompt + output − 1"
        )
    return flat.reshape(rows, -1)


class SGLangClient(HTTPServerClient, DistributedWeightUpdateClient):
    """SGLang native API: generation (`/generate` with `input_ids`), weight-update control (disk
    loads and the weight group's sessions) and LoRA adapters, one HTTP API, so one class fills
    the generation, distributed weight-update and adapter interfaces."""

    # with `lora` (`HTTPServerClient`), requests name the adapter's newest served version in `lora_path`
    has_session: bool | None = None
    """Whether the server has `/begin_weight_update` (SGLang ≥ 0.5.2x); None until first asked."""
    stages_updates: bool = False
    """Whether the server stages buckets until `/end_weight_update` (the embedded server
    says so in its `/begin_weight_update` reply); learnt at each begin."""
    ordered_buckets: bool = False
    """Whether the server receives a session's buckets in `bucket` order (the embedded server
    says so in its `/begin_weight_update` reply); learnt at each begin."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        lora: str | None = None,
        routed_experts: bool = False,
    ) -> None:
        super().__init__(url, api_key, timeout_s, connect_timeout_s, lora)
        self.routed_experts = routed_experts
        """Ask for each token's routed experts (`return_routed_experts`, MoE models)."""

    @property
    def flattened_buckets(self) -> bool:
        """True when a bucket may travel as one `flattened_bucket` broadcast (servers with the
        session routes; `ModelRunner` weight updater `_receive_bucketed_weights_from_distributed`)."""
        return bool(self.has_session)

    def generate_payload(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None, session_id: str | None
    ) -> dict[str, Any]:
        """The `/generate` body: one prompt, output log-probs only."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if self.routed_experts:
            payload["return_routed_experts"] = True
        if rid is not None:
            payload["rid"] = rid
        if session_id is not None:
            payload["session_id"] = session_id
        return payload

    def parse_generate(self, reply: Any, prompt_tokens: int) -> GenerateResult:
        """Read SGLang's `/generate` response (one item) into a `GenerateResult`."""
        if isinstance(reply, list):
            if len(reply) != 1:
                raise InferenceError(f"/generate: expected one result, got {len(reply)}")
            reply = reply[0]
        try:
            meta = reply["meta_info"]
            triples = meta.get("output_token_logprobs") or []
            output_ids = reply.get("output_ids")
            if output_ids is None:  # older servers return ids only inside the logprob triples
                output_ids = [int(t[1]) for t in triples]
            finish = meta.get("finish_reason") or {"type": "abort"}
            kind = finish.get("type")
            if kind not in ("stop", "length", "abort"):
                raise InferenceError(f"/generate: unknown finish_reason {finish!r}")
            _raise_if_failed(self.url, finish)
            return GenerateResult(
                output_ids=[int(t) for t in output_ids],
                logprobs=[float(t[0]) for t in triples],
                finish_reason=kind,
                matched=finish.get("matched"),
                weight_version=parse_weight_version(meta.get("weight_version")),
                prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
                completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
                text=reply.get("text"),
                server=self.url,
                routed_experts=_routed_experts(
                    meta, int(meta.get("prompt_tokens", prompt_tokens)), len(output_ids), kind
                )
                if self.routed_experts
                else None,
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InferenceError(f"/generate: malformed response ({exc!r}): {str(reply)[:500]}") from exc

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        """With `lora`, the request names the newest served version of the adapter (`lora_path`, which
        SGLang resolves by adapter name) and the result carries that version."""
        payload = self.generate_payload(input_ids, sampling_params, rid, session_id)
        if self.lora is None:
            return self.parse_generate(await self.http.request("POST", "/generate", payload), len(input_ids))

        async def send(name: str | None) -> GenerateResult:
            body = payload if name is None else {**payload, "lora_path": name}
            return self.parse_generate(await self.http.request("POST", "/generate", body), len(input_ids))

        return await generate_with_adapter(self, self.lora, send)

    async def alive(self) -> bool:
        return await self._answers("/ping")  # SGLang's /ping answers while generation is paused

    async def _server_version(self) -> int:
        return parse_weight_version((await self.get_model_info()).get("weight_version"))

    async def get_model_info(self) -> dict[str, Any]:
        reply = await self.http.request("GET", "/model_info")
        if not isinstance(reply, dict):
            raise InferenceError(f"{self.url}/model_info: expected a JSON object, got {str(reply)[:200]}")
        return reply

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        _check_success(
            "/init_weights_update_group", await self.http.request("POST", "/init_weights_update_group", body)
        )

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
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        if flattened:
            body["load_format"] = "flattened_bucket"
        if bucket is not None:  # an agentrl extra, only for servers that said `ordered_buckets`
            body["bucket"] = bucket
        if more:  # another, only for servers that said `bucket_batches`
            body["more"] = more
        reply = await self.http.request("POST", "/update_weights_from_distributed", body)
        _check_success("/update_weights_from_distributed", reply)

    async def begin_weight_update(self, pause: bool = False) -> None:
        """`pause`: the embedded server pauses in the same request (`session_control`); a server
        whose reply does not say it paused is paused with `/pause_generation` after it."""
        try:
            reply = await self.http.request(
                "POST", "/begin_weight_update", {"pause_generation": True} if pause else {}
            )
        except BadRequestError as exc:
            if exc.status != 404:
                raise
            if self.has_session is not False:
                logger.warning(
                    "%s has no /begin_weight_update (SGLang older than the session API): "
                    "pushing without a session, one broadcast per tensor",
                    self.url,
                )
            self.has_session = False
            return
        if self.has_session is None:
            logger.info("%s has the weight-update session API (begin/end, flattened_bucket)", self.url)
        self.has_session = True
        _check_success("/begin_weight_update", reply)
        await self._opened(reply, pause)

    async def _opened(self, reply: Any, pause: bool) -> None:
        """After a `/begin_weight_update` that succeeded: learn from its reply how this server takes
        a push; if `pause` was asked and the reply does not say it paused, pause it now."""
        said = reply if isinstance(reply, dict) else {}
        self.stages_updates = said.get("staged_commit") is True
        self.ordered_buckets = said.get("ordered_buckets") is True
        self.session_control = said.get("session_control") is True
        self.bucket_batches = said.get("bucket_batches") is True
        if pause and said.get("paused") is not True:
            await self.pause_generation()

    async def end_weight_update(self, weight_version: int | None = None, resume: bool = False) -> int | None:
        """SGLang records the version with each bucket; `weight_version` is not sent here. `resume`:
        the embedded server continues in the same request; a server whose reply does not say it
        continued is continued with `/continue_generation` after it (when the commit fails, the
        caller, not knowing, continues it). Returns the version the reply says the server serves
        after the commit (the embedded server's), else None."""
        if self.has_session is False:
            if resume:
                await self.continue_generation()
            return None
        body = {"continue_generation": True} if resume else {}
        # a commit that fails raises here: the caller, not knowing whether it continued, continues it
        reply = await self.http.request("POST", "/end_weight_update", body)
        _check_success("/end_weight_update", reply)
        if resume and not (isinstance(reply, dict) and reply.get("continued") is True):
            await self.continue_generation()
        served = reply.get("weight_version") if isinstance(reply, dict) else None
        try:
            return int(served) if served is not None else None
        except (TypeError, ValueError):
            return None

    async def abort_weight_update(self) -> None:
        """`/end_weight_update` with `abort` (the embedded server discards what it staged; SGLang
        closes the session, keeping the buckets it loaded). No session open is not an error."""
        if self.has_session is False:
            return
        try:
            reply = await self.http.request("POST", "/end_weight_update", {"abort": True})
        except BadRequestError as exc:
            if "no weight-update session" in str(exc):
                return
            raise
        _check_success("/end_weight_update", reply)

    async def update_weights_from_disk(self, model_path: str, weight_version: int | None = None) -> None:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        _check_success(
            "/update_weights_from_disk", await self.http.request("POST", "/update_weights_from_disk", body)
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        body = {"group_name": group_name}
        reply = await self.http.request("POST", "/destroy_weights_update_group", body)
        _check_success("/destroy_weights_update_group", reply)

    async def pause_generation(self) -> None:
        await self.http.request("POST", "/pause_generation", {})

    async def continue_generation(self) -> None:
        await self.http.request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        body: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            body["rid"] = rid
        await self.http.request("POST", "/abort_request", body)

    async def flush_cache(self) -> None:
        await self.http.request("POST", "/flush_cache", {})

    # ------------------------------------------------------------------ LoRA adapters

    async def adapter_limits(self) -> AdapterLimits:
        """From `GET /server_info` (the resolved server args): `enable_lora`, `max_lora_rank`,
        `max_loras_per_batch`, `lora_target_modules` (`all`, or none given: any module)."""
        info = await self.http.request("GET", "/server_info")
        if not isinstance(info, dict) or "enable_lora" not in info:
            raise AdapterError(f"{self.url}/server_info: no enable_lora in {str(info)[:200]}")
        if not info["enable_lora"]:
            raise AdapterError(f"{self.url} was started without --enable-lora: it cannot serve adapters")
        targets = info.get("lora_target_modules") or ["all"]
        if info.get("max_lora_rank") is None:
            raise AdapterError(f"{self.url}/server_info: enable_lora without max_lora_rank")
        return AdapterLimits(
            max_rank=int(info["max_lora_rank"]),
            max_loras=int(info.get("max_loras_per_batch") or 8),
            target_modules=None if "all" in targets else frozenset(targets),
        )

    async def _load(self, name: str, path: str) -> None:
        await self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": path}, name)

    async def _unload(self, name: str) -> None:
        await self._lora_call("/unload_lora_adapter", {"lora_name": name}, name)

    async def _lora_call(self, route: str, body: dict[str, Any], name: str) -> None:
        """SGLang answers `LoRAUpdateOutput` (`success`, `error_message`, `loaded_adapters`), HTTP
        400 when `success` is false (`http_server.py` `load_lora_adapter`)."""
        try:
            reply = await self.http.request("POST", route, body)
        except InferenceError as exc:
            raise AdapterError(f"adapter {name}: {exc}") from exc
        if not isinstance(reply, dict) or reply.get("success") is not True:
            raise AdapterError(f"adapter {name}: {self.url}{route} answered {str(reply)[:500]}")
