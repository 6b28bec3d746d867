"""Request bodies the embedded server accepts: SGLang's native field names, validated strictly.

Field names and defaults follow SGLang's `GenerateReqInput`, `sampling_params`
(`SamplingParams`) and the weight-update request dataclasses in
`sglang/srt/managers/io_struct.py` (SGLang 0.5.23). Unknown `/generate` and sampling fields are
rejected (HTTP 400 naming the field) rather than ignored, and SGLang features the embedded
server does not implement (streaming, prompt log-probs, top log-probs, …) are rejected with a
message saying so. Admin bodies (weight updates, pause, abort) ignore unknown fields, as
SGLang's msgspec request structs do.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

ENGINE = web.AppKey("engine", object)
"""The app's `agentrl.inference.engine.Engine` (typed loosely: this module stays torch-free)."""
STATE = web.AppKey("state", dict)
"""Server state shared by handlers: rids in flight, weight groups, group timeout."""


class BadInput(Exception):
    """Turned into HTTP 400 with SGLang's validation-error body (`error_body`)."""


def error_body(message: str, status: int = 400) -> dict[str, Any]:
    """SGLang 0.5.23's body for a request it cannot validate (`ErrorResponse`, sent by
    `validation_exception_handler` in `srt/entrypoints/http_server.py`)."""
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": status}


async def parse(request: web.Request, model: type[BaseModel]) -> Any:
    """The request's JSON body validated as `model`; BadInput (→ 400) names what is wrong."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise BadInput(f"malformed JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadInput("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise BadInput(describe(exc)) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParamsIn(Strict):
    max_new_tokens: int = Field(128, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=64)
    sampling_seed: int | None = None
    min_new_tokens: int = Field(0, ge=0, le=0, description="only 0 is supported by the embedded server")
    no_stop_trim: bool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or at least 1, as in SGLang")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class GenerateIn(Strict):
    """SGLang `GenerateReqInput`, the subset the embedded server serves."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False  # MoE: meta_info["routed_experts"], as SGLang (agentrl/moe.py)
    stream: bool = False
    rid: str | list[str] | None = None
    session_id: str | None = None
    lora_path: str | list[str | None] | None = None
    """The adapter a request names (SGLang's field). The embedded server serves one adapter, the
    newest pushed: it takes any agentrl adapter name (`agentrl-lora-v<v>`; the reply's
    `weight_version` says which version answered, as for full weights) and refuses other names."""

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by the embedded server; send stream=false")
        return v

    @field_validator("logprob_start_len")
    @classmethod
    def _output_logprobs_only(cls, v: int | list[int]) -> int | list[int]:
        if any(x != -1 for x in (v if isinstance(v, list) else [v])):
            raise ValueError("only output log-probs are supported (logprob_start_len = -1)")
        return v

    @field_validator("top_logprobs_num")
    @classmethod
    def _no_top(cls, v: int | list[int]) -> int | list[int]:
        if any(x != 0 for x in (v if isinstance(v, list) else [v])):
            raise ValueError("top log-probs are not supported by the embedded server (use 0)")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> GenerateIn:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        if isinstance(self.input_ids, list) and len(self.input_ids) == 0:
            raise ValueError("input_ids: empty")
        return self

    def prompts(self) -> tuple[list[Any], bool]:
        """(list of prompts as text or ids, whether the request was a single prompt)."""
        if self.input_ids is not None:
            single = not isinstance(self.input_ids[0], list)
            return ([self.input_ids] if single else list(self.input_ids)), single
        single = isinstance(self.text, str)
        return ([self.text] if single else list(self.text)), single

    def per_item(self, value: Any, i: int, size: int, name: str) -> Any:
        if isinstance(value, list) and name != "input_ids":
            if len(value) != size:
                raise ValueError(f"{name}: batch of {size} prompts but {len(value)} values")
            return value[i]
        return value


class Admin(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InitGroupIn(Admin):
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class BucketIn(Admin):
    """One bucket's description: its tensors' names, dtypes and shapes, in broadcast order."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    load_format: str | None = None

    @model_validator(mode="after")
    def _aligned(self) -> BucketIn:
        if not (len(self.names) == len(self.dtypes) == len(self.shapes)):
            raise ValueError(
                f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, "
                f"{len(self.shapes)})"
            )
        return self


class UpdateDistributedIn(BucketIn):
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    bucket: int | None = Field(default=None, ge=0)
    """agentrl extra: the bucket's index in the session; the server receives buckets in this order
    whatever order their requests arrive in (it says `ordered_buckets` when a session opens)."""
    more: list[BucketIn] = Field(default_factory=list)
    """agentrl extra: the buckets broadcast right after this one (indices `bucket` + 1, …),
    announced in the same request; one reply covers them all (the server says `bucket_batches`
    when a session opens). Needs `bucket`."""

    @model_validator(mode="after")
    def _indexed(self) -> UpdateDistributedIn:
        if self.more and self.bucket is None:
            raise ValueError("`more` buckets need the first one's index (`bucket`)")
        return self


class UpdateDiskIn(Admin):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | int | None = None
    flush_cache: bool = True


class DestroyGroupIn(Admin):
    group_name: str = "weight_update_group"


class AbortIn(Admin):
    rid: str | None = ""
    abort_all: bool = False
    abort_message: str | None = None


class PauseIn(Admin):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class BeginUpdateIn(Admin):
    selector: Literal["target", "draft", "all"] = "all"
    lora: dict[str, Any] | None = None
    """agentrl extra: the session's buckets form this LoRA adapter (PEFT's `r`, `lora_alpha`,
    `target_modules`, and the `name` it is served under), applied on the base at the commit."""
    pause_generation: bool = False
    """agentrl extra: pause generation first, as `/pause_generation` does (mode "abort"), in the
    same round trip (the reply then says `paused`)."""


class LoadLoraIn(Admin):
    """SGLang 0.5.23's `/load_lora_adapter` body (`LoadLoRAAdapterReqInput`), plus the version."""

    lora_name: str
    lora_path: str
    weight_version: str | int | None = None
    """agentrl extra: the weight version the server reports once the adapter is served."""


class EndUpdateIn(Admin):
    abort: bool = False
    """agentrl extra: discard the session's staged buckets instead of committing them."""
    continue_generation: bool = False
    """agentrl extra: continue generation after the commit (or the abort), as
    `/continue_generation` does, in the same round trip (the reply then says `continued`)."""


class UpdateVersionIn(Admin):
    new_version: str | int
    abort_all_requests: bool = True


def describe(exc: ValidationError) -> str:
    """pydantic errors as `field: message` lines."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"{where}: {msg}")
    return "; ".join(lines)
