"""Admin routes of the embedded server: weight updates, pause/continue, abort, health, info.

They follow SGLang 0.5.23's routes and bodies (`protocol.py`; `srt/entrypoints/http_server.py`)
and its rules: weight-update routes answer `{"success", "message"}` (HTTP 400 when the request
cannot be honoured); `/update_weights_from_distributed` is refused outside a
`/begin_weight_update` … `/end_weight_update` session, before anything is received
(`SchedulerWeightUpdaterManager.update_weights_from_distributed`). Unlike SGLang, which loads
each bucket as it arrives, the embedded server stages the buckets of a session and applies them
with their version only at `/end_weight_update` (an `"abort": true` there discards them), so a
push that fails midway leaves it on its previous weights and version. Buckets are received into
buffers kept from push to push (agentrl/inference/receive_buffers.py: no allocation, no page
faults once warm), and the commit makes the received tensors the model's parameters instead of
copying them where the engine owns its parameters (`Engine.load_weights(adopt=True)`); the
buffers the weights left are the next push's. Staging costs one copy of the pushed tensors, kept
between pushes as those free buffers. `load_format:
"flattened_bucket"` receives a bucket as one uint8 broadcast (`FlattenedTensorBucket`);
aborts match rid prefixes and answer an empty body; `/ping` is a liveness flag that answers
while paused (`sagemaker_health`). Everything that touches the model or the
running batch runs in the engine thread between two decode steps (`Engine.call`), so a
weight update never lands inside a step. A bucket's receive is posted there, in index order,
and awaited off it (gloo), into a buffer the model does not use: the engine thread is free to
post the next bucket's receive while this one's bytes arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from pathlib import Path
from typing import Any

from aiohttp import web

from agentrl.inference import protocol as P
from agentrl.inference.engine import Engine
from agentrl.inference.protocol import ENGINE, STATE, parse
from agentrl.inference.receive_buffers import ReceiveBuffers


async def _in_engine(engine: Engine, fn) -> Any:
    return await asyncio.wrap_future(engine.call(fn))


def _ok(message: str = "", **extra: Any) -> web.Response:
    return web.json_response({"success": True, "message": message, **extra})


def _fail(message: str, status: int = 400, **extra: Any) -> web.Response:
    return web.json_response({"success": False, "message": message, **extra}, status=status)


async def init_weights_update_group(request: web.Request) -> web.Response:
    from agentrl.inference.weight_group import join_group

    body: P.InitGroupIn = await parse(request, P.InitGroupIn)
    state = request.app[STATE]
    if body.group_name in state["groups"]:
        return _fail(f"group {body.group_name!r} already exists; destroy it first")
    if body.backend not in ("gloo", "nccl"):
        return _fail(f"backend {body.backend!r}: use gloo or nccl")
    try:
        group = await asyncio.to_thread(
            join_group,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            state["group_timeout_s"],
        )
    except Exception as exc:
        return _fail(f"joining weight group {body.group_name!r} failed: {type(exc).__name__}: {exc}")
    state["groups"][body.group_name] = group
    return _ok(f"joined {body.group_name} as rank {body.rank_offset}")


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Receive one bucket into the session's staging area (checked against the model); the model
    and its version change only at `/end_weight_update`. A bucket that fails spoils the session:
    its commit is refused and the server keeps its weights and version. A bucket with an index
    (`bucket`, an agentrl extra) waits for the buckets before it to be queued for receiving, so a
    trainer may announce the next bucket before this one's reply (`ordered_buckets`); one that
    lists the buckets broadcast after it (`more`, another) is received with them and answers once
    (`bucket_batches`)."""
    state = request.app[STATE]
    body: P.UpdateDistributedIn = await parse(request, P.UpdateDistributedIn)
    if not state["session"]:
        return _fail(
            "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
        )
    session = state["session"]
    try:
        if body.bucket is not None and (refused := await _await_turn(state, body.bucket)):
            return _spoil(state, refused, session)
        return await _receive_bucket(request, body)
    finally:  # whatever happened, the next bucket is not held up by this one
        _pass_turn(state, session, body.bucket, 1 + len(body.more))


async def _await_turn(state: dict, bucket: int) -> str | None:
    """Wait until the buckets before `bucket` of this session are queued for receiving (bounded by
    the group timeout); why it cannot be received, or None."""
    session, timeout = state["session"], state["group_timeout_s"]
    deadline = asyncio.get_running_loop().time() + timeout
    while state["session"] == session and state["turn"] < bucket:
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            return (
                f"bucket {bucket} waited {timeout}s for bucket {state['turn']} of its session; nothing staged"
            )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(state["turn_moved"].wait(), remaining)
    if state["session"] != session:
        return "the weight-update session was closed while the bucket waited for its turn; nothing staged"
    if state["turn"] > bucket:
        return f"bucket {bucket} came after bucket {state['turn'] - 1} of its session was received"
    return None


def _pass_turn(state: dict, session: int, bucket: int | None, count: int = 1) -> None:
    """Buckets `bucket` … `bucket + count - 1` of `session` are queued (or refused): the next one
    may go."""
    if bucket is not None and state["session"] == session and state["turn"] == bucket:
        state["turn"] += count
        _wake_turns(state)


def _wake_turns(state: dict) -> None:
    state["turn_moved"].set()
    state["turn_moved"] = asyncio.Event()


async def _receive_bucket(request: web.Request, body: P.UpdateDistributedIn) -> web.Response:
    """Receive the bucket `body` describes, and the ones it announces after it (`more`), into
    receive buffers; stage them all, or spoil the session."""
    import torch

    from agentrl.inference.weight_group import parse_dtype, unflatten

    engine, state = request.app[ENGINE], request.app[STATE]
    parts: list[P.BucketIn] = [body, *body.more]
    if bad := [p.load_format for p in parts if p.load_format not in (None, "flattened_bucket")]:
        return _fail(f"load_format {bad[0]!r}: the embedded server takes none or flattened_bucket")
    session, adapter = state["session"], state["staged_adapter"]
    group = state["groups"].get(body.group_name)
    if group is None:
        return _spoil(state, f"no weight group {body.group_name!r}; call /init_weights_update_group first")
    try:
        specs = [list(zip(p.names, [parse_dtype(d) for d in p.dtypes], p.shapes, strict=True)) for p in parts]
    except ValueError as exc:
        return _spoil(state, str(exc))
    device = engine.device if group.backend == "nccl" else torch.device("cpu")
    pool: ReceiveBuffers = state["receive_buffers"]
    into: list[list[torch.Tensor]] = []  # per bucket: one flat buffer, or one tensor per name

    def post() -> tuple[list, Exception | None]:
        """(engine thread) Post the receives, in the order the buckets are queued, and check the
        buckets against the model while they arrive (names and shapes are all the check needs)."""
        # receive everything the trainer sends even if it will be refused: the collective stays aligned
        if body.abort_all_requests:
            engine.abort(abort_all=True, message="weights updated")
        for part, spec in zip(parts, specs, strict=True):
            sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in spec]
            if part.load_format == "flattened_bucket":
                into.append([pool.take(sum(sizes), device, receiving=True)])
            else:
                into.append([pool.take(size, device, receiving=True).view(dtype).reshape(shape)
                             for (_, dtype, shape), size in zip(spec, sizes, strict=True)])  # fmt: skip
        works = [group.post(t, 0) for bucket in into for t in bucket]
        if group.backend == "nccl":  # waited here: the engine's stream is the one that must wait
            wait(works)
            works = []
        try:
            for spec in specs:
                meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, dtype, shape in spec}
                if adapter is not None:
                    engine.check_adapter(meta, adapter)
                else:  # the model does not change within a session: its state dict is taken once
                    if state["model_state"] is None:
                        state["model_state"] = engine.model.state_dict()
                    engine.check_weights(meta, state["model_state"])
        except Exception as exc:
            return works, exc
        return works, None

    def wait(works: list) -> None:
        for work in works:
            group.wait(work)

    queued = engine.call(post)
    _pass_turn(state, session, body.bucket, len(parts))  # the next bucket's receive queues behind these
    tensors: dict[str, torch.Tensor] = {}
    try:
        works, refused = await asyncio.wrap_future(queued)
        # off the engine thread (gloo): it is free to post the next bucket's receive meanwhile
        await asyncio.get_running_loop().run_in_executor(None, wait, works)
        if refused is not None:
            raise refused
        for part, spec, buffers in zip(parts, specs, into, strict=True):
            if part.load_format == "flattened_bucket":
                tensors.update(unflatten(buffers[0], spec))
            else:
                tensors.update(zip(part.names, buffers, strict=True))
    except ValueError as exc:
        return _spoil(state, f"update rejected, weights unchanged: {exc}", session)
    except Exception as exc:
        return _spoil(state, f"update failed, weights unchanged: {type(exc).__name__}: {exc}", session, 500)
    finally:
        for bucket in into:
            for buffer in bucket:
                pool.received(buffer)
    if state["session"] != session:  # aborted while receiving
        return _fail("the weight-update session was closed while receiving; nothing staged")
    if state["staged"] is None:
        return _fail("an earlier bucket of this session failed; nothing more is staged")
    state["staged"].update(tensors)
    if body.weight_version is not None:
        state["staged_version"] = str(body.weight_version)
    return _ok(
        f"staged {len(tensors)} tensors in {len(parts)} bucket(s)", weight_version=engine.weight_version
    )


def _spoil(state: dict, message: str, session: int | None = None, status: int = 400) -> web.Response:
    """Refuse a bucket and spoil the session it belongs to (its commit is then refused)."""
    if session is None or state["session"] == session:
        state["staged"] = None
    return _fail(message, status)


def _read_checkpoint(path: str) -> dict:
    from safetensors.torch import load_file

    root = Path(path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else [root]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no safetensors checkpoint at {path}")
    tensors: dict = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body: P.UpdateDiskIn = await parse(request, P.UpdateDiskIn)
    try:
        tensors = await asyncio.to_thread(_read_checkpoint, body.model_path)
    except Exception as exc:
        return _fail(f"cannot read {body.model_path}: {type(exc).__name__}: {exc}")
    version = None if body.weight_version is None else str(body.weight_version)

    def load() -> int:
        aborted = engine.abort(abort_all=True, message="weights updated") if body.abort_all_requests else 0
        engine.load_weights(tensors, version)
        return aborted

    try:
        aborted = await _in_engine(engine, load)
    except ValueError as exc:
        return _fail(f"checkpoint does not match the model, weights unchanged: {exc}")
    return _ok(f"loaded {body.model_path}", num_paused_requests=aborted, weight_version=engine.weight_version)


async def load_lora_adapter(request: web.Request) -> web.Response:
    """SGLang's route for a PEFT adapter directory; the embedded server serves one adapter at a
    time on its base (the newest loaded), all or nothing, and reports `weight_version`."""
    from agentrl.inference.peft_adapter import read_adapter_dir

    engine = request.app[ENGINE]
    body: P.LoadLoraIn = await parse(request, P.LoadLoraIn)
    try:
        tensors, config = await asyncio.to_thread(read_adapter_dir, body.lora_path)
    except Exception as exc:
        return _fail(f"cannot read adapter {body.lora_path}: {type(exc).__name__}: {exc}")
    config = {**config, "name": body.lora_name}
    version = None if body.weight_version is None else str(body.weight_version)
    try:
        await _in_engine(engine, lambda: engine.load_adapter(tensors, config, version))
    except ValueError as exc:
        return _fail(f"adapter refused, weights unchanged: {exc}")
    return _ok(f"loaded adapter {body.lora_name}", weight_version=engine.weight_version)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body: P.DestroyGroupIn = await parse(request, P.DestroyGroupIn)
    group = request.app[STATE]["groups"].pop(body.group_name, None)
    if group is None:
        return _fail(f"no weight group {body.group_name!r}")
    group.close()
    return _ok(f"destroyed {body.group_name}")


async def begin_weight_update(request: web.Request) -> web.Response:
    """Open a session, pausing generation first if asked (`pause_generation`). Agentrl extras in
    the reply tell the client how this server takes a push: `staged_commit` (buckets are staged
    until `/end_weight_update`), `ordered_buckets` (buckets with an index are received in index
    order), `session_control` (begin pauses and end continues generation when asked, and end
    answers with the version served after it)."""
    body: P.BeginUpdateIn = await parse(request, P.BeginUpdateIn)
    engine, state = request.app[ENGINE], request.app[STATE]
    if state["session"]:
        return _fail("a weight-update session is already open; call end_weight_update() first")
    if body.pause_generation:
        await _in_engine(engine, lambda: engine.pause("abort"))
        if state["session"]:  # another begin opened one while this one paused
            return _fail("a weight-update session is already open; call end_weight_update() first")
    state["sessions"] += 1
    state["session"], state["staged"], state["staged_version"] = state["sessions"], {}, None
    state["staged_adapter"], state["turn"], state["model_state"] = body.lora, 0, None
    _wake_turns(state)  # buckets still waiting from an earlier session give up
    return _ok("Success", staged_commit=True, ordered_buckets=True, bucket_batches=True,
               session_control=True, paused=body.pause_generation)  # fmt: skip


async def end_weight_update(request: web.Request) -> web.Response:
    """Commit: load every staged tensor and set the staged version, in the engine thread, all or
    nothing (`Engine.load_weights` checks first; it adopts the received tensors as parameters where
    it can). With `abort` (an agentrl extra): discard them. Either way the receive buffers the model
    no longer uses are free for the next push."""
    body: P.EndUpdateIn = await parse(request, P.EndUpdateIn)
    engine, state = request.app[ENGINE], request.app[STATE]
    if not state["session"]:
        return _fail("no weight-update session is open; call begin_weight_update() first")
    staged, version, adapter = state["staged"], state["staged_version"], state["staged_adapter"]
    state["session"], state["staged"], state["staged_version"], state["staged_adapter"] = 0, None, None, None
    model_state, state["model_state"] = state["model_state"], None  # taken in this session, if any
    _wake_turns(state)  # buckets still waiting give up

    resume = body.continue_generation
    extra = {"continued": True} if resume else {}

    def settled(load: Any = None) -> Any:
        """Run `load` (if any) in the engine thread, then free the buffers the model does not use
        and continue generation if asked (whether the load succeeded or not: staged buckets never
        leave the weights a mix); the engine's future of that."""

        def run() -> str:
            try:
                if load is not None:
                    load()
            finally:
                state["receive_buffers"].settle(engine.model)  # up to one copy of the weights
                if resume:
                    engine.resume()
            return engine.weight_version  # read in the engine thread, after the load

        return engine.call(run)

    if body.abort or staged is None:
        resumed = settled()  # not awaited unless it continues: a receive may still be in flight
        if resume:
            await asyncio.wrap_future(resumed)
        if body.abort:
            return _ok(f"aborted, {len(staged or {})} staged tensors discarded",
                       weight_version=engine.weight_version, **extra)  # fmt: skip
        return _fail(
            f"a bucket of this session failed: nothing applied, weights stay at {engine.weight_version}",
            **extra,
        )
    if adapter is not None:
        load = lambda: engine.load_adapter(staged, adapter, version)  # noqa: E731
    elif staged:
        load = lambda: engine.load_weights(staged, version, adopt=True, state=model_state)  # noqa: E731
    else:
        load = None
    try:
        served = await asyncio.wrap_future(settled(load))
    except ValueError as exc:
        if adapter is None:
            return _fail(f"commit failed, weights unchanged: ValueError: {exc}", status=500, **extra)
        return _fail(f"adapter refused, weights unchanged: {exc}", **extra)
    except Exception as exc:
        return _fail(f"commit failed, weights unchanged: {type(exc).__name__}: {exc}", status=500, **extra)
    return _ok("Success", weight_version=served, **extra)


async def pause_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body: P.PauseIn = await parse(request, P.PauseIn)
    await _in_engine(engine, lambda: engine.pause(body.mode))
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    await _in_engine(engine, engine.resume)
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    """Every request whose rid starts with `rid` (or all); an empty rid aborts nothing. 200, no body."""
    engine = request.app[ENGINE]
    body: P.AbortIn = await parse(request, P.AbortIn)
    await _in_engine(engine, lambda: engine.abort(rid=body.rid, abort_all=body.abort_all))
    return web.Response(status=200)


async def update_weight_version(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    body: P.UpdateVersionIn = await parse(request, P.UpdateVersionIn)

    def bump() -> None:
        if body.abort_all_requests:
            engine.abort(abort_all=True, message="weight version changed")
        engine.weight_version = str(body.new_version)

    await _in_engine(engine, bump)
    return _ok("updated", new_version=engine.weight_version)


async def flush_cache(request: web.Request) -> web.Response:
    return _ok("no prefix cache to flush")  # requests never share KV across calls here


async def health(request: web.Request) -> web.Response:
    """`/health`, `/health_generate`, `/ping`: 200 while the engine thread runs (paused or not)."""
    if not request.app[ENGINE].alive:
        return web.Response(status=503)
    return web.Response(status=200)


async def get_weight_version(request: web.Request) -> web.Response:
    """An extra of the embedded server (SGLang 0.5.23 has no such route; clients read `/model_info`)."""
    return web.json_response({"weight_version": request.app[ENGINE].weight_version})


async def get_model_info(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.json_response(
        {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path if engine.tokenizer is not None else None,
            "is_generation": True,
            "weight_version": engine.weight_version,
            "context_length": engine.context_length,
            "vocab_size": engine.vocab_size,
            "max_batch_size": engine.max_batch_size,
            "paused": engine.paused,
            "lora_adapter": engine.adapter_name,
        }
    )
