"""`agentrl serve`: the embedded inference server, an aiohttp app over SGLang's native API.

Rollers, weight sync and tests reach it exactly as they reach a real SGLang server (same
routes, field names and response shapes; see `protocol.py`). Handlers validate input and
hand work to the `Engine` thread: generation requests join its running batch, weight
loads and pause/abort run between decode steps. Bad input gets HTTP 4xx with a message
and never disturbs other requests; a request the engine failed gets HTTP 500 with the engine's
error, as SGLang answers one (`TokenizerManager._handle_abort_finish_reason`), while a request
aborted by a pause or an abort call answers 200 with `finish_reason.type == "abort"`. It binds 127.0.0.1 unless told otherwise. Keys follow
SGLang 0.5.23's `decide_request_auth` (`srt/utils/auth.py`): `/health*`, `/ready*` and
`/metrics*` are always open; with an API key every other route needs `Authorization: Bearer
<key>`; with an admin key the admin routes (weight updates, pause, abort) need the admin key
instead (and without one, the API key).

    agentrl serve --model runs/models/tiny --port 30000
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from agentrl.inference import admin, prompt_logprobs
from agentrl.inference import protocol as P
from agentrl.inference.engine import Engine, Request, error_status
from agentrl.inference.protocol import ENGINE, STATE, BadInput, parse
from agentrl.inference.receive_buffers import ReceiveBuffers
from agentrl.inference.sampling import SamplingParams
from agentrl.log import get_logger

logger = get_logger(__name__)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadInput as exc:
        return web.json_response(P.error_body(str(exc)), status=400)
    except ValidationError as exc:
        return web.json_response(P.error_body(P.describe(exc)), status=400)


_OPEN = ("/health", "/ready", "/metrics")
_ADMIN = {
    "/init_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_disk",
    "/destroy_weights_update_group", "/begin_weight_update", "/end_weight_update", "/pause_generation",
    "/continue_generation", "/abort_request", "/update_weight_version", "/flush_cache",
}  # fmt: skip


def _auth(api_key: str | None, admin_api_key: str | None):
    import secrets

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path.startswith(_OPEN):
            return await handler(request)
        key = admin_api_key if (request.path in _ADMIN and admin_api_key) else api_key
        given = request.headers.get("Authorization", "")
        if key and not (given.startswith("Bearer ") and secrets.compare_digest(given[7:], key)):
            return web.json_response({"error": {"message": "unauthorized: missing or wrong key"}}, status=401)
        return await handler(request)

    return check


# ---------------------------------------------------------------------------------- generate


def _sampling(raw: dict[str, Any] | None, engine: Engine) -> tuple[SamplingParams, P.SamplingParamsIn]:
    try:
        sp = P.SamplingParamsIn.model_validate(raw or {})
    except ValidationError as exc:
        raise BadInput("sampling_params." + P.describe(exc)) from None
    stop_ids = set(sp.stop_token_ids or [])
    if any(not 0 <= t < engine.vocab_size for t in stop_ids):
        raise BadInput(f"sampling_params.stop_token_ids: ids must be in [0, {engine.vocab_size})")
    params = SamplingParams(
        max_new_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        stop=sp.stops(),
        stop_token_ids=stop_ids,
        ignore_eos=sp.ignore_eos,
        sampling_seed=sp.sampling_seed,
    )
    return params, sp


def _prompt_ids(prompt: Any, engine: Engine, where: str) -> list[int]:
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise BadInput("text prompts need a tokenizer; this model directory has none (send input_ids)")
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    else:
        ids = list(prompt)
    if not ids:
        raise BadInput(f"{where}: empty prompt")
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    if bad:
        raise BadInput(f"{where}: token ids out of vocabulary [0, {engine.vocab_size}): {bad[:5]}")
    if len(ids) >= engine.context_length:
        raise BadInput(
            f"{where}: prompt of {len(ids)} tokens does not fit the context length {engine.context_length}"
        )
    return ids


def _response(req: Request, sp: P.SamplingParamsIn, want_logprob: bool, with_text: bool, engine: Engine):
    tok = engine.tokenizer
    text = tok.decode(req.output_ids, skip_special_tokens=sp.skip_special_tokens) if tok is not None else ""
    matched = (req.finish_reason or {}).get("matched")
    if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
        text = text[: text.index(matched)]  # SGLang trims a matched stop string from `text`, not from ids
    meta: dict[str, Any] = {
        "id": req.rid,
        "finish_reason": req.finish_reason,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": 0,
        "weight_version": req.weight_version,
        "e2e_latency": time.monotonic() - req.created,
    }
    if want_logprob:
        texts = [tok.decode([t]) if (with_text and tok is not None) else None for t in req.output_ids]
        meta["output_token_logprobs"] = [
            [lp, t, s] for lp, t, s in zip(req.logprobs, req.output_ids, texts, strict=True)
        ]
    if req.return_routed_experts:
        meta["routed_experts"] = _routed_experts(req, engine)
    return {"text": text, "output_ids": req.output_ids, "meta_info": meta}


def _routed_experts(req: Request, engine: Engine) -> str:
    """SGLang 0.5.23's `meta_info["routed_experts"]`: base64 int32 [prompt + output - 1, layers, top_k]."""
    import numpy as np

    from agentrl.moe import encode_routed_experts

    layers, top_k = engine.routing_shape or (0, 0)
    chunks = [c.numpy() for c in req.routed_experts]
    return encode_routed_experts(np.concatenate(chunks) if chunks else np.zeros((0, layers, top_k), np.int32))


Item = tuple[Request, P.SamplingParamsIn, bool, asyncio.Future]
"""One request of a `/generate` call: the engine's request, its sampling params, whether it
returns log-probs, and the future its completion sets."""


def _requests(body: P.GenerateIn, engine: Engine, in_flight: set[str]) -> list[Item]:
    """The engine requests of a `/generate` body: one per prompt and sample (`n`), each with a rid
    not in flight; BadInput for anything malformed."""
    prompts, single = body.prompts()
    loop = asyncio.get_running_loop()
    items: list[Item] = []
    try:
        for i, prompt in enumerate(prompts):
            where = "input_ids" if single else f"input_ids[{i}]"
            ids = _prompt_ids(prompt, engine, where if body.input_ids is not None else "text")
            params, sp = _sampling(
                body.per_item(body.sampling_params, i, len(prompts), "sampling_params"), engine
            )
            want_lp = bool(body.per_item(body.return_logprob, i, len(prompts), "return_logprob"))
            rid = body.per_item(body.rid, i, len(prompts), "rid") or uuid.uuid4().hex
            if isinstance(body.rid, str) and len(prompts) > 1:
                rid = f"{body.rid}-{i}"
            for j in range(sp.n):
                item_rid = rid if sp.n == 1 else f"{rid}-{j}"
                if item_rid in in_flight or any(r.rid == item_rid for r, *_ in items):
                    raise BadInput(f"rid {item_rid!r} is already in flight")
                future = loop.create_future()

                def done(req: Request, fut: asyncio.Future = future) -> None:
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

                req = Request(item_rid, ids, params, done, return_routed_experts=body.return_routed_experts)
                items.append((req, sp, want_lp, future))
        if body.return_routed_experts and engine.routing_shape is None:
            raise BadInput(
                "return_routed_experts: this model has no mixture-of-experts router agentrl records "
                "(Qwen2-MoE, Qwen3-MoE)"
            )
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return items


async def _run(items: list[Item], engine: Engine, in_flight: set[str]) -> None:
    """Submit every request and wait for all; a client that goes away aborts them."""
    for req, *_ in items:
        in_flight.add(req.rid)
        engine.submit(req)
    try:
        await asyncio.gather(*(f for *_, f in items))
    except asyncio.CancelledError:  # client went away: stop spending compute on it
        for req, *_ in items:
            engine.call(lambda rid=req.rid: engine.abort(rid=rid, message="client disconnected"))
        raise
    finally:
        for req, *_ in items:
            in_flight.discard(req.rid)


def _check_adapter(names: str | list[str | None] | None, engine: Engine) -> None:
    """BadInput unless every adapter named is one of agentrl's (served as the newest version)."""
    for name in names if isinstance(names, list) else [names]:
        if name is not None and not name.startswith("agentrl-lora-v"):
            raise BadInput(
                f"lora_path {name!r}: this server serves agentrl's adapter ({engine.adapter_name})"
            )
        if name is not None and engine.adapter_name is None:
            raise BadInput(f"lora_path {name!r}: no adapter has been pushed to this server yet")


async def generate(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE], request.app[STATE]
    body: P.GenerateIn = await parse(request, P.GenerateIn)
    _check_adapter(body.lora_path, engine)
    items = _requests(body, engine, state["rids"])
    await _run(items, engine, state["rids"])
    failed = next((r for r, *_ in items if error_status(r.finish_reason) is not None), None)
    if failed is not None:  # SGLang 0.5.23: FastAPI's HTTPException body (400: `_create_error_response`)
        status, message = error_status(failed.finish_reason), failed.finish_reason.get("message", "")
        reply = {"error": {"message": message}} if status == 400 else {"detail": message}
        return web.json_response(reply, status=status)
    out = [_response(r, sp, lp, body.return_text_in_logprobs, engine) for r, sp, lp, _ in items]
    single = body.prompts()[1]
    return web.json_response(out[0] if single and len(out) == 1 else out)


async def _metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    from agentrl.observe.prometheus import EngineCollector, render

    body = render(EngineCollector(request.app[ENGINE]))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def make_app(
    engine: Engine,
    api_key: str | None = None,
    group_timeout_s: float = 120.0,
    admin_api_key: str | None = None,
) -> web.Application:
    """The aiohttp application over a started `engine`; the engine is stopped on app cleanup."""
    middlewares = [_auth(api_key, admin_api_key)] if (api_key or admin_api_key) else []
    app = web.Application(middlewares=[*middlewares, _errors], client_max_size=256 << 20)
    app[ENGINE] = engine
    app[STATE] = {
        "rids": set(),
        "groups": {},
        "group_timeout_s": group_timeout_s,
        "session": 0,
        "sessions": 0,
        "staged": None,
        "staged_version": None,
        "staged_adapter": None,  # the LoRA config of an adapter session (its buckets form the adapter)
        "receive_buffers": ReceiveBuffers(),  # kept between pushes (inference/receive_buffers.py)
        "turn": 0,  # the index of the next bucket of the session to be received (`ordered_buckets`)
        "model_state": None,  # the model's state dict, taken once per session to check its buckets
        "turn_moved": asyncio.Event(),  # set (and replaced) whenever the turn moves or the session ends
    }
    post = {
        "/generate": generate,
        "/init_weights_update_group": admin.init_weights_update_group,
        "/begin_weight_update": admin.begin_weight_update,
        "/end_weight_update": admin.end_weight_update,
        "/update_weights_from_distributed": admin.update_weights_from_distributed,
        "/update_weights_from_disk": admin.update_weights_from_disk,
        "/load_lora_adapter": admin.load_lora_adapter,
        "/destroy_weights_update_group": admin.destroy_weights_update_group,
        "/pause_generation": admin.pause_generation,
        "/continue_generation": admin.continue_generation,
        "/abort_request": admin.abort_request,
        "/update_weight_version": admin.update_weight_version,
        "/flush_cache": admin.flush_cache,
        "/prompt_logprobs": prompt_logprobs.handle,  # teacher log-probs for on-policy distillation
    }
    get = {
        "/health": admin.health,
        "/health_generate": admin.health,
        "/ping": admin.health,
        "/get_weight_version": admin.get_weight_version,
        "/get_model_info": admin.get_model_info,
        "/model_info": admin.get_model_info,
        "/flush_cache": admin.flush_cache,
    }
    try:  # the engine's Prometheus metrics, on this port as SGLang's are (`observe/prometheus.py`)
        import prometheus_client  # noqa: F401

        get["/metrics"] = _metrics
    except ImportError:
        pass
    app.add_routes([web.post(p, h) for p, h in post.items()] + [web.get(p, h) for p, h in get.items()])

    async def _stop_engine(app: web.Application) -> None:
        await asyncio.to_thread(engine.stop)
        for group in app[STATE]["groups"].values():
            group.close()

    app.on_cleanup.append(_stop_engine)
    return app


def run_server(model_path: str, host: str, port: int, config) -> None:
    """Load the model, start the engine and serve until SIGINT/SIGTERM (`config`: InferenceConfig)."""
    import os
    import sys

    # The engine thread holds the GIL for most of a decode step; a short switch interval lets the
    # HTTP thread take requests in and hand results out without waiting a whole 5 ms slice.
    sys.setswitchinterval(0.0002)
    engine = Engine(
        model_path,
        device=config.device,
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        context_length=config.context_length,
        cpu_threads=config.cpu_threads,
        logprobs=config.logprobs,
    )
    engine.start()
    api_key = os.environ.get(config.api_key_env) or None
    app = make_app(engine, api_key)
    logger.info(
        "serving %s on http://%s:%d (api key: %s)", model_path, host, port, "on" if api_key else "off"
    )
    web.run_app(
        app,
        host=host,
        port=port,
        access_log=None,
        shutdown_timeout=5,
        handler_cancellation=True,  # a client that goes away aborts its generation
        print=lambda msg: print(msg, flush=True),
    )
