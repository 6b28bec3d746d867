"""Schemas of SGLang's and vLLM's HTTP APIs, written from their sources, for contract tests.

They describe what the real servers accept and return, so the contract tests can check
that the requests our clients send are ones those servers take, and that the responses our
clients parse (and our embedded server produces) have those servers' shapes. Written by
reading, not copied:

* SGLang, commit 001067fffe33427bee0ed2f007fb7551a1d76b44 (v0.5.x line):
  `python/sglang/srt/managers/io_struct.py` — `GenerateReqInput`, `InitWeightsUpdateGroupReqInput`,
  `UpdateWeightsFromDistributedReqInput`, `UpdateWeightFromDiskReqInput`, `AbortReq`,
  `DestroyWeightsUpdateGroupReqInput`; `python/sglang/srt/sampling/sampling_params.py`
  (commit 00c17caf) — `SamplingParams` (API fields only); response `meta_info` as filled by
  `tokenizer_manager` (finish_reason from `BaseFinishReason.to_json()`, logprob triples).
* vLLM, `vllm/entrypoints/openai/completion/protocol.py` (commit 002032ee2b18) —
  `CompletionRequest`, `CompletionResponse`, `CompletionResponseChoice`, `CompletionLogProbs`;
  `vllm/entrypoints/serve/dev/rlhf/api_router.py` (commit 0100a2129224) — weight transfer,
  pause/resume, abort routes.

Request models forbid extra fields: a field our client sends that the server does not know
fails the contract (SGLang's dataclasses would raise on it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


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
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None


class SGLangGenerateReq(Closed):
    """The API-facing part of `GenerateReqInput` (multimodal, LoRA and disaggregation fields omitted:
    our client never sends them)."""

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


class SGLangInitGroupReq(Closed):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class SGLangUpdateDistributedReq(Closed):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None  # a string in SGLang, not an int
    load_format: str | None = None
    torch_empty_cache: bool = False


class SGLangUpdateDiskReq(Closed):
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


class SGLangDestroyGroupReq(Closed):
    group_name: str = "weight_update_group"


class SGLangAbortReq(Closed):
    rid: str | None = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class SGLangPauseReq(Closed):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class SGLangFinishReason(Closed):
    type: Literal["stop", "length", "abort"]
    matched: int | str | list[int] | None = None
    length: int | None = None
    message: str | None = None
    status_code: int | None = None
    err_type: str | None = None


class SGLangMetaInfo(Open):
    id: str
    finish_reason: SGLangFinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    weight_version: str
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None


class SGLangGenerateResp(Open):
    text: str
    output_ids: list[int]
    meta_info: SGLangMetaInfo


class SGLangWeightResp(Open):
    success: bool
    message: str


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
