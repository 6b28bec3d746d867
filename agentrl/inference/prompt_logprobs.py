"""Prompt log-probs: each given token's log-prob under a served model, from any backend.

On-policy distillation (`agentrl/learner/distill.py`) scores the student's own sequences with a
teacher: for token ids t_0 … t_{n-1} it needs log P_teacher(t_i | t_<i) for i ≥ 1 (nothing is
generated). Each backend has its own request for that:

    embedded   POST /prompt_logprobs {"input_ids": [[...], ...]} → {"logprobs": [[null, lp_1, ...], ...]}
               (this module's `handle`, a route of `agentrl serve`: one batched forward in the
               engine thread between decode steps, log-softmax in float32 at temperature 1)
    sglang     POST /generate with `input_ids`, `return_logprob: true`, `logprob_start_len: 0`,
               `max_new_tokens: 0`; `meta_info.input_token_logprobs` holds (logprob, token id, text)
               per input token, None for the first (`GenerateReqInput` in
               `sglang/srt/managers/io_struct.py`, `meta_info` in `tokenizer_manager.py`, 0.5.23)
    vllm       POST /v1/completions with token ids as `prompt`, `prompt_logprobs: 0`, `max_tokens: 1`;
               `choices[0].prompt_logprobs` is None for the first token, then {token id: {logprob,
               rank, decoded_token}} holding at least the prompt's own token (`CompletionRequest`
               in `vllm/entrypoints/openai/completion/protocol.py`, vLLM 0.32)

`fetch` returns, per sequence, a list of n floats whose first entry is 0.0 (the first token has
no context); a reply that does not name the sent tokens, or has the wrong length, raises
`InferenceError` with the server's address.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from agentrl.inference.base import InferenceError
from agentrl.inference.http import HTTPClient

# ---------------------------------------------------------------------------- server side (embedded)


def engine_prompt_logprobs(engine: Any, sequences: list[list[int]]) -> list[list[float | None]]:
    """(engine thread) log P(t_i | t_<i) of every token of every sequence, None for the first:
    one right-padded forward of the whole batch without a KV cache."""
    import torch

    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    ids, mask = ids.to(engine.device), mask.to(engine.device)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    rows = logp.cpu().tolist()
    return [[None, *rows[i][: len(s) - 1]] for i, s in enumerate(sequences)]


async def handle(request: Any) -> Any:
    """POST /prompt_logprobs of the embedded server (see the module docstring); bad input → 400."""
    from aiohttp import web

    from agentrl.inference.protocol import ENGINE, BadInput

    engine = request.app[ENGINE]
    try:
        body = await request.json()
    except ValueError:
        raise BadInput("body: not JSON") from None
    seqs = body.get("input_ids") if isinstance(body, dict) else None
    if not isinstance(seqs, list) or not seqs or not all(isinstance(s, list) and s for s in seqs):
        raise BadInput("input_ids: a non-empty list of non-empty token-id lists")
    vocab, context = engine.vocab_size, engine.context_length
    for i, s in enumerate(seqs):
        if not all(isinstance(t, int) and 0 <= t < vocab for t in s):
            raise BadInput(f"input_ids[{i}]: token ids must be ints in [0, {vocab})")
        if len(s) > context:
            raise BadInput(f"input_ids[{i}]: {len(s)} tokens exceed the context length {context}")
    future = engine.call(lambda: engine_prompt_logprobs(engine, seqs))
    try:
        rows = await asyncio.wrap_future(future)
    except Exception as exc:  # the engine failed the forward: the server's own failure
        return web.json_response({"detail": f"prompt log-probs failed: {exc!r}"}, status=500)
    return web.json_response({"logprobs": rows})


# ---------------------------------------------------------------------------- client side


def _embedded_body(seqs: list[list[int]]) -> tuple[str, Any]:
    return "/prompt_logprobs", {"input_ids": seqs}


def _embedded_parse(reply: Any, seqs: list[list[int]]) -> list[list[float | None]]:
    return reply["logprobs"]


def _sglang_body(seqs: list[list[int]]) -> tuple[str, Any]:
    return "/generate", {
        "input_ids": seqs,
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }


def _sglang_parse(reply: Any, seqs: list[list[int]]) -> list[list[float | None]]:
    items = reply if isinstance(reply, list) else [reply]
    out = []
    for item, seq in zip(items, seqs, strict=True):
        entries = item["meta_info"]["input_token_logprobs"]
        if [int(e[1]) for e in entries] != seq:
            raise ValueError("input_token_logprobs do not name the sent tokens")
        out.append([e[0] for e in entries])
    return out


async def _vllm_one(http: HTTPClient, seq: list[int], model: str | None) -> list[float | None]:
    body: dict[str, Any] = {"prompt": seq, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    if model is not None:
        body["model"] = model
    reply = await http.request("POST", "/v1/completions", body)
    entries = reply["choices"][0]["prompt_logprobs"]
    out: list[float | None] = [None]
    for tok, entry in zip(seq[1:], entries[1:], strict=True):
        out.append(float(entry[str(tok)]["logprob"]))  # KeyError: the reply does not name the token
    return out


_SIMPLE: dict[str, tuple[Callable, Callable]] = {
    "embedded": (_embedded_body, _embedded_parse),
    "sglang": (_sglang_body, _sglang_parse),
}
BACKENDS = ("embedded", "sglang", "vllm")


async def fetch_async(
    backend: str,
    url: str,
    sequences: list[list[int]],
    model: str | None = None,
    api_key: str | None = None,
    timeout_s: float = 300.0,
) -> list[list[float]]:
    """Per sequence, log P(t_i | t_<i) for every token (0.0 for the first), from the server at `url`
    of kind `backend` (embedded, sglang or vllm); `model` names the served model for vLLM."""
    if backend not in BACKENDS:
        raise InferenceError(f"prompt log-probs: unknown backend {backend!r}; choose one of {BACKENDS}")
    http = HTTPClient(url, api_key, timeout_s)
    try:
        if backend == "vllm":
            rows = await asyncio.gather(*(_vllm_one(http, s, model) for s in sequences))
        else:
            make, parse = _SIMPLE[backend]
            path, body = make(sequences)
            rows = parse(await http.request("POST", path, body), sequences)
        out = []
        for row, seq in zip(rows, sequences, strict=True):
            if len(row) != len(seq) or any(x is None for x in row[1:]):
                raise ValueError(f"{len(row)} log-probs for {len(seq)} tokens, or a missing one")
            out.append([0.0, *(float(x) for x in row[1:])])
        return out
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise InferenceError(f"{url}: prompt log-probs: malformed reply ({exc!r})") from exc
    finally:
        await http.close()


def fetch(backend: str, url: str, sequences: list[list[int]], **kwargs: Any) -> list[list[float]]:
    """`fetch_async` from synchronous code (the learner)."""
    return asyncio.run(fetch_async(backend, url, sequences, **kwargs))
