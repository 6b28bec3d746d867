"""Client of a vLLM server: token-in / token-out generation, plus the RL dev routes.

Generation goes to `POST /inference/v1/generate` (vLLM's token-in / token-out route, on with
`--enable-scale-out`, which servers agentrl starts have: `vllm_launch`): the prompt as token
ids, vLLM's own `SamplingParams` with `logprobs: 0` (the sampled token's log-prob), and the
reply's `weight_versions` — contiguous `(version, start, end)` spans over the output tokens,
labelled by the engine core at the step that produced them (`GenerateRequest` /
`GenerateTokensChoice` in `vllm/entrypoints/scale_out/token_in_token_out/protocol.py`,
`WeightVersionSpan` in `vllm/outputs.py`, vLLM 0.32). A server without that route (403:
started without the flag; 404: an older vLLM) is driven through `/v1/completions` instead
(`CompletionRequest` in `vllm/entrypoints/openai/completion/protocol.py`, `return_token_ids`),
whose replies carry no version: then it is read from `/weight_info` just before sending.

Every sampling parameter that shapes the distribution is sent explicitly (temperature, top_p,
top_k, min_p and the three penalties at their neutral values unless asked), and servers
agentrl starts run with `--generation-config vllm` (`vllm_launch`), so the model's
`generation_config.json` cannot change the behaviour policy behind the roller's back.

Engine request ids: `/inference/v1/generate` names request `rid` `generate-tokens-{rid}`
(`token_in_token_out/serving.py`), `/v1/completions` `cmpl-{rid}-{index}`
(`completion/serving.py`); `/abort_requests` takes engine ids, so `abort_request(rid)` sends
the one of the route in use. Finish reasons (`FINISH_REASON_STRINGS` in
`vllm/v1/engine/__init__.py`): stop, length and abort pass through; `repetition` (vLLM's
repetition detector cut the output: a server-side limit like max_tokens, not the policy
ending its turn) is reported as "length" with `matched="repetition"`; anything else raises,
naming it. A failed request is never an abort: vLLM 0.32 answers a request that finished with
`error` (a request-level internal error) as HTTP 500 (`_raise_if_error` in
`vllm/entrypoints/generate/base/serving.py` raises `GenerationError`), and a dead engine core
fails every request with 500, both `ServerError` here, which the router retries elsewhere
(a reply that carries `error` anyway raises the same); "abort" comes only from `/pause` and
`/abort_requests`, which the roller resumes.

Weight version of a result: the oldest span's, i.e. the weights behind its first token.
Pushes pause with `mode=abort` and tag the new version (`/update_weight_version`) before
resuming, so every token of one request comes from one version and its label is exact; a
request that spans a push anyway (a pause in vLLM's `keep` mode, by someone else) has several
spans and is reported at the oldest, never understating staleness. On the `/v1/completions`
fallback the version is never newer than the weights behind any token, but may be older (a
push can land between the read and the request).

Routed experts (mixture-of-experts models, `routed_experts=True`, `inference.routed_experts`):
vLLM has no per-request switch; a server started with `--enable-return-routed-experts`
(`vllm_launch` adds it, with prefix caching and Model Runner V2, which it requires) puts
`routed_experts` in every finished choice of both routes: base64 of the `.npy` bytes of a
[prompt + output − 1, layers, top_k] array (`numpy2base64` in `vllm/utils/serial_utils.py`;
`GenerateChoiceBase` in `token_in_token_out/protocol.py`), uint8 for models of at most 256
experts, else uint16 (`RoutedExpertsCapturer.output_dtype_name` in
`model_executor/layers/fused_moe/routed_experts_capturer.py`). The rows start at the first
prompt token (`routed_experts_prompt_start` is left at 0: the layout of SGLang's
`return_routed_experts`, which the rollers and the learner read); rows of prompt blocks served
from the prefix cache come from vLLM's block store, so a cached prefix is covered too. The
output processor joins the rows only when the request finishes (`RequestState` in
`vllm/v1/engine/output_processor.py`), an abort included; an abort before any forward has none
(None), which this client passes on as no routing (the rollers resume the request, and the
resumed one covers those tokens); any other reply without them is an error, and so is an array
whose shape is not [prompt + output − 1, layers, top_k] (`routed_rows`). vLLM's `layers` is
every hidden layer (`_get_routed_experts_shape`), agentrl's the MoE ones: the same for models whose
every layer is MoE (the presets; Qwen2/3-MoE with `decoder_sparse_step: 1`), and router replay
refuses rows of another width. Untested against a real vLLM (it needs a GPU:
`scripts/gpu_check.py`'s `moe_vllm` step); the decoding is tested on CPU against replies built
as vLLM builds them (tests/unit/inference/test_vllm_client.py).

The weight-update and LoRA control half of the client (agentrl's worker extension through
`/collective_rpc`, pause / resume, vLLM's runtime LoRA routes) is `VLLMControl` in
`vllm_control.py`, which `VLLMClient` extends with generation.
See tests/unit/inference/test_vllm_client.py, tests/integration/test_vllm.py and
tests/integration/test_vllm_lora.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentrl.inference.base import (
    BadRequestError,
    GenerateResult,
    InferenceError,
    ServerError,
    parse_weight_version,
)
from agentrl.inference.lora import generate_with_adapter
from agentrl.inference.vllm_control import VLLMControl, no_route
from agentrl.log import get_logger

if TYPE_CHECKING:
    import numpy as np

logger = get_logger(__name__)

GENERATE = "/inference/v1/generate"
"""vLLM's token-in / token-out route (`--enable-scale-out`): per-token weight versions."""

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
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
}
# Sent unless the roller asks otherwise: vLLM's own neutral values, stated so that no server-side
# default (a generation_config.json, a --override-generation-config) can change the policy.
_NEUTRAL = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


class VLLMClient(VLLMControl):
    """vLLM's OpenAI-compatible server driven token-in / token-out (generation), on top of
    `VLLMControl` (weight-update control and LoRA adapters)."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        group_timeout_s: float = 120.0,
        lora: str | None = None,
        routed_experts: bool = False,
    ) -> None:
        super().__init__(url, api_key, timeout_s, connect_timeout_s, group_timeout_s, lora)
        self.model = model
        self.routed_experts = routed_experts
        """Read each token's routed experts from the replies (`routed_rows`; the server must run
        with `--enable-return-routed-experts`)."""
        self._scale_out: bool | None = None  # whether /inference/v1/generate answers (None: not yet tried)

    @property
    def exact_versions(self) -> bool | None:
        """Whether this server's replies label their tokens with weight versions (the generate route
        answered); False: the `/v1/completions` fallback; None: nothing generated yet."""
        return self._scale_out

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
            **_NEUTRAL,
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

    def parse_completion(self, reply: Any, weight_version: int, prompt_tokens: int) -> GenerateResult:
        """A `/v1/completions` reply of `prompt_tokens` prompt tokens, labelled `weight_version`."""
        try:
            choice = reply["choices"][0]
            token_ids = choice["token_ids"]
            if token_ids is None:
                raise InferenceError(
                    "vLLM returned no token_ids (is return_token_ids supported by this version?)"
                )
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            reason, matched = _finish(choice.get("finish_reason") or "abort", choice.get("stop_reason"))
            usage = reply.get("usage") or {}
            return GenerateResult(
                output_ids=[int(t) for t in token_ids],
                logprobs=[float(x) for x in logprobs],
                finish_reason=reason,
                matched=matched,
                weight_version=weight_version,
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", len(token_ids))),
                text=choice.get("text"),
                server=self.url,
                routed_experts=self._routed(choice, prompt_tokens, len(token_ids), reason),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InferenceError(
                f"/v1/completions: malformed response ({exc!r}): {str(reply)[:500]}"
            ) from exc

    def generate_payload(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None, model: str | None = None
    ) -> dict[str, Any]:
        """The `/inference/v1/generate` body: the same sampling as `completion_payload`, as vLLM's
        `SamplingParams` (`GenerateRequest` in `entrypoints/scale_out/token_in_token_out/protocol.py`);
        `model` names a served adapter (else `self.model`)."""
        body = self.completion_payload(input_ids, sampling_params, None, None)
        for key in ("prompt", "model", "return_token_ids"):
            body.pop(key, None)
        payload: dict[str, Any] = {"token_ids": list(input_ids), "sampling_params": body}
        if (model or self.model) is not None:
            payload["model"] = model or self.model
        if rid is not None:
            payload["request_id"] = rid
        return payload

    def parse_generate(self, reply: Any, prompt_tokens: int) -> GenerateResult:
        """A `/inference/v1/generate` reply to a prompt of `prompt_tokens` tokens; its version is that
        of the weights behind the first output token (vLLM's per-token `weight_versions` spans; see
        `span_version`)."""
        try:
            choice = reply["choices"][0]
            token_ids = choice["token_ids"]
            if token_ids is None:
                raise InferenceError("vLLM returned no token_ids")
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(entry["logprob"]) for entry in content]
            reason, matched = _finish(choice.get("finish_reason") or "abort", choice.get("stop_reason"))
            usage = reply.get("usage") or {}
            return GenerateResult(
                output_ids=[int(t) for t in token_ids],
                logprobs=logprobs,
                finish_reason=reason,
                matched=matched,
                weight_version=span_version(choice.get("weight_versions"), len(token_ids)),
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                completion_tokens=int(usage.get("completion_tokens", len(token_ids))),
                server=self.url,
                routed_experts=self._routed(choice, prompt_tokens, len(token_ids), reason),
            )
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise InferenceError(
                f"/inference/v1/generate: malformed response ({exc!r}): {str(reply)[:500]}"
            ) from exc

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        session_id: str | None = None,
    ) -> GenerateResult:
        """`/inference/v1/generate` (exact per-token versions), or, on a server started without
        `--enable-scale-out` (403) or a vLLM without it (404), `/v1/completions` with the version
        read from `/weight_info` just before sending. With `lora`, the request names the newest
        served version of the adapter as its `model`, and the result carries that version."""
        if self.lora is None:
            return await self._generate(input_ids, sampling_params, rid, session_id, None)
        return await generate_with_adapter(
            self, self.lora, lambda name: self._generate(input_ids, sampling_params, rid, session_id, name)
        )

    async def _generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None,
        session_id: str | None,
        model: str | None,
    ) -> GenerateResult:
        if self._scale_out is not False:
            payload = self.generate_payload(input_ids, sampling_params, rid, model)
            try:
                reply = await self.http.request("POST", GENERATE, payload)
            except BadRequestError as exc:
                if not no_route(exc) or self._scale_out:
                    raise
                logger.warning(
                    "%s: no %s (HTTP %d; start vLLM with --enable-scale-out for exact weight "
                    "versions): using /v1/completions",
                    self.url,
                    GENERATE,
                    exc.status,
                )
                self._scale_out = False
            else:
                self._scale_out = True
                return self.parse_generate(reply, len(input_ids))
        version = await self._server_version()
        payload = self.completion_payload(input_ids, sampling_params, rid, session_id)
        if model is not None:
            payload["model"] = model
        reply = await self.http.request("POST", "/v1/completions", payload)
        return self.parse_completion(reply, version, len(input_ids))

    def _routed(self, choice: dict[str, Any], prompt_tokens: int, output_tokens: int, reason: str) -> Any:
        if not self.routed_experts:
            return None
        return routed_rows(choice.get("routed_experts"), prompt_tokens, output_tokens, reason)

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        if not abort_all and rid is None:
            raise InferenceError("abort_request: give rid or abort_all=True")
        if abort_all:
            body: dict[str, Any] = {}
        else:  # the engine's id depends on the route that started the request (both, if not known yet)
            ids = {True: [generate_request_id(rid)], False: [engine_request_id(rid)]}.get(
                self._scale_out, [generate_request_id(rid), engine_request_id(rid)]
            )
            body = {"request_ids": ids}
        await self.http.request("POST", "/abort_requests", body)


def engine_request_id(rid: str | None) -> str:
    """The id vLLM's engine gives the one completion of request `rid` (`cmpl-{rid}-{index}`, n=1)."""
    return f"cmpl-{rid}-0"


def generate_request_id(rid: str | None) -> str:
    """The id vLLM's engine gives request `rid` of `/inference/v1/generate` (`generate-tokens-{rid}`)."""
    return f"generate-tokens-{rid}"


def span_version(spans: Any, num_tokens: int) -> int:
    """The version of the weights behind the first output token, from vLLM's `weight_versions`
    (`[{version, start, end}]`, contiguous spans over the output tokens, `WeightVersionSpan` in
    `vllm/outputs.py`): the oldest one, so a request that spans a push never understates its
    staleness. No spans (no output tokens yet) → the version the engine held then is unknown: 0
    only if there are no tokens to label."""
    if not spans:
        if num_tokens:
            raise InferenceError("vLLM returned output tokens without weight_versions")
        return 0
    return min(parse_weight_version(span["version"]) for span in spans)


def routed_rows(text: Any, prompt_tokens: int, output_tokens: int, finish_reason: str) -> np.ndarray | None:
    """vLLM 0.32's `routed_experts` (base64 `.npy`, [prompt + output − 1, layers, top_k], uint8 or
    uint16) as the int32 [prompt + output − 1, layers·top_k] rows `GenerateResult.routed_experts`
    holds; None for an aborted request that has none (aborted before any forward). InferenceError
    for anything else that is not exactly those rows: absent, not an integer `.npy` array, or of
    another shape."""
    import base64
    import binascii
    import io

    import numpy as np

    rows = prompt_tokens + output_tokens - 1
    if text is None:
        if finish_reason == "abort":
            return None
        raise InferenceError(
            "vLLM returned no routed_experts for a finished request: was it started with "
            "--enable-return-routed-experts (agentrl starts it so with inference.routed_experts: true), "
            "and is the model a mixture of experts?"
        )
    if not isinstance(text, str):
        raise InferenceError(f"vLLM routed_experts is a {type(text).__name__}, not base64 text")
    try:
        array = np.load(io.BytesIO(base64.b64decode(text, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise InferenceError(f"vLLM routed_experts is not the base64 of a .npy array: {exc}") from None
    if not isinstance(array, np.ndarray) or array.dtype.kind not in "ui" or array.dtype.itemsize > 4:
        raise InferenceError(
            f"vLLM routed_experts of dtype {getattr(array, 'dtype', type(array).__name__)}: "
            "expected expert ids (uint8, uint16)"
        )
    if array.ndim != 3 or array.shape[0] != rows or 0 in array.shape[1:]:
        raise InferenceError(
            f"vLLM routed_experts of shape {list(array.shape)}: expected [{rows}, layers, top_k], one row "
            f"per token fed to the model (prompt {prompt_tokens} + output {output_tokens} - 1)"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > np.iinfo(np.int32).max):
        raise InferenceError("vLLM routed_experts holds ids outside 0..2^31-1")
    return array.astype(np.int32).reshape(rows, -1)


def _finish(reason: str, stop_reason: Any) -> tuple[str, Any]:
    """vLLM's finish reason → agentrl's (stop / length / abort) and the `matched` value."""
    if reason in ("stop", "length", "abort"):
        return reason, stop_reason
    if reason == "repetition":
        return "length", "repetition"
    if reason == "error":
        raise ServerError(
            "vLLM finished the request with finish_reason 'error' (a request-level internal error)"
        )
    raise InferenceError(
        f"vLLM finish_reason {reason!r} is not one agentrl knows (stop, length, abort, repetition, error)"
    )
