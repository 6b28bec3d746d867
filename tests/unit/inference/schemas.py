"""Schemas of SGLang's and vLLM's HTTP APIs, written from their sources, for contract tests.

They describe what the real servers accept and return, so the contract tests can check
that the requests our clients send are ones those servers take, and that the responses our
clients parse (and our embedded server produces) have those servers' shapes. Written by
reading, not copied:

* SGLang 0.5.23, the PyPI wheel (`pip download --no-deps sglang==0.5.23`):
  - `sglang/srt/managers/io_struct.py` — `GenerateReqInput` (API-facing fields), and the msgspec
    request structs (each inherits `BaseReq`'s `rid` and `http_worker_ipc`):
    `InitWeightsUpdateGroupReqInput`, `BeginWeightUpdateReqInput`, `EndWeightUpdateReqInput`,
    `UpdateWeightsFromDistributedReqInput`, `UpdateWeightFromDiskReqInput`,
    `DestroyWeightsUpdateGroupReqInput`, `AbortReq`, `PauseGenerationReqInput`,
    `ContinueGenerationReqInput`, `LoadLoRAAdapterReqInput`, `UnloadLoRAAdapterReqInput`; the
    `*ReqOutput` structs (`success`, `message`) and `LoRAUpdateOutput`;
  - `sglang/srt/sampling/sampling_params.py` — `SamplingParams` (API fields) and `verify`
    (`top_k` must be ≥ 1 or −1, `top_p` in (0, 1], ...);
  - `sglang/srt/entrypoints/http_server.py` — the routes: `POST /begin_weight_update`,
    `/end_weight_update` and the other weight-update routes answer `{"success", "message"}`
    with 200, or 400 when `success` is false; `GET /model_info` (`model_info`: the served
    `weight_version` among the model's fields; there is no `/get_weight_version`);
    `GET /ping` (`sagemaker_health`: 200 with an empty body while healthy, paused or not,
    else 503); response `meta_info` as `tokenizer_manager.py` fills it (`finish_reason` from
    `BaseFinishReason.to_json()`, the logprob triples, `weight_version` and the optional
    `weight_versions` spans of `srt/utils/weight_versions.py`).
* vLLM, `vllm/entrypoints/openai/completion/protocol.py` (commit 002032ee2b18) —
  `CompletionRequest`, `CompletionResponse`, `CompletionResponseChoice`, `CompletionLogProbs`;
  `vllm/entrypoints/serve/dev/rlhf/api_router.py` (commit 0100a2129224) — weight transfer,
  pause/resume, abort routes.

Request models forbid extra fields. SGLang 0.5.23 itself ignores a field it does not know
(`srt/utils/msgspec_utils.py` `msgspec_struct_pydantic_core_schema`: `extra_behavior="ignore"`),
so a misspelled or stale field our client sends would be dropped there without a word; here it
fails the contract instead.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ------------------------------------------------------------------------------------ SGLang


class SGLangSamplingParams(Closed):
    max_new_tokens: int | None = Field(128, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0, le=1)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    min_new_tokens: int = Field(0, ge=0)
    n: int = 1
    beam_width: int | None = Field(None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: dict[str, Any] | None = None
    watermark: dict[str, Any] | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:  # `SamplingParams.verify`
        if v < 1 and v != -1:
            raise ValueError(f"top_k must be -1 (whole vocabulary) or at least 1, got {v}")
        return v


class SGLangGenerateReq(Closed):
    """The API-facing part of `GenerateReqInput` (multimodal, disaggregation and routing fields
    omitted: our client never sends them). `lora_path` names a loaded adapter by its name
    (`TokenizerManager._resolve_lora_path` looks it up in the adapter registry)."""

    rid: str | list[str] | None = None
    session_id: str | None = None
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    return_hidden_states: bool = False
    session_params: dict[str, Any] | None = None
    custom_logit_processor: str | list[str | None] | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    lora_path: str | list[str | None] | None = None


class SGLangBaseReq(Closed):
    """`BaseReq`: the fields every msgspec request struct inherits."""

    rid: str | None = None
    http_worker_ipc: str | None = None


Selector = Literal["target", "draft", "all"]


class SGLangLoadLoRAReq(SGLangBaseReq):
    """`LoadLoRAAdapterReqInput` (`io_struct.py`), `POST /load_lora_adapter`."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None


class SGLangUnloadLoRAReq(SGLangBaseReq):
    """`UnloadLoRAAdapterReqInput`, `POST /unload_lora_adapter`."""

    lora_name: str
    lora_id: str | None = None


class SGLangLoRAUpdateResp(Closed):
    """`LoRAUpdateOutput`: both LoRA routes' reply (HTTP 400 when `success` is false)."""

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


class SGLangInitGroupReq(SGLangBaseReq):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class SGLangBeginUpdateReq(SGLangBaseReq):
    """`BeginWeightUpdateReqInput`: opens the session `/update_weights_from_distributed` needs."""

    selector: Selector = "all"


class SGLangEndUpdateReq(SGLangBaseReq):
    """`EndWeightUpdateReqInput`: no fields of its own (the version travels with each bucket)."""


class SGLangUpdateDistributedReq(SGLangBaseReq):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None  # a string in SGLang, not an int
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class SGLangUpdateDiskReq(SGLangBaseReq):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class SGLangDestroyGroupReq(SGLangBaseReq):
    group_name: str = "weight_update_group"


class SGLangAbortReq(SGLangBaseReq):
    rid: str | None = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: list[dict[str, Any]] | None = None


class SGLangPauseReq(SGLangBaseReq):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class SGLangContinueReq(SGLangBaseReq):
    torch_empty_cache: bool = True


class SGLangFinishReason(Closed):
    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class SGLangWeightVersionSpan(Closed):
    version: str
    start: int
    end: int


class SGLangMetaInfo(Open):
    id: str
    finish_reason: SGLangFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    weight_versions: list[SGLangWeightVersionSpan] | None = None
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class SGLangGenerateResp(Open):
    text: str
    output_ids: list[int]
    meta_info: SGLangMetaInfo


class SGLangWeightResp(Open):
    """`{"success", "message"}` of the weight-update routes (begin/end included);
    `/update_weights_from_disk` adds `num_paused_requests`."""

    success: bool
    message: str
    num_paused_requests: int | None = None


class SGLangModelInfo(Open):
    """`GET /model_info` (`model_info` in http_server.py): the fields a client relies on."""

    model_path: str
    is_generation: bool
    weight_version: str  # "default" until an update sets one (`srt/arg_groups/fields/serving.py`)


# ------------------------------------------------------------------------------------ vLLM


class VLLMCompletionRequest(Closed):
    """`CompletionRequest`: the OpenAI fields plus vLLM's sampling and extra params we may send."""

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=-1)
    max_tokens: int | None = 16
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = []
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    request_id: str | None = None
    session_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


class VLLMLogProbs(Closed):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class VLLMChoice(Open):
    index: int
    text: str
    logprobs: VLLMLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class VLLMUsage(Open):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0


class VLLMCompletionResponse(Open):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[VLLMChoice]
    usage: VLLMUsage


class VLLMInitTransfer(Closed):
    init_info: dict[str, Any]


class VLLMUpdateWeights(Closed):
    update_info: dict[str, Any]


class VLLMNCCLUpdateInfo(Closed):
    """`NCCLWeightTransferUpdateInfo` (`vllm/distributed/weight_transfer/nccl_engine.py`): the fields
    every release accepts. Older releases also take `packed` (+ buffer sizes); newer ones moved those
    to the init info and would reject them here, so a client must not send them."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class VLLMFinishUpdate(Closed):
    weight_version: str | None = None


class VLLMAbortRequests(Closed):
    request_ids: list[str] | None = None
