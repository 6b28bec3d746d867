"""A strict stand-in for an SGLang 0.5.23 server: the rules a real one enforces, no model.

SGLang cannot run on these CPU machines (the 0.5.23 wheel pins torch 2.14.1 and CUDA
kernels), so the client and the weight sync are tested against this scripted server: real
aiohttp on 127.0.0.1, a real gloo group built the way SGLang builds it, and SGLang's rules,
each taken from the 0.5.23 wheel (`pip download --no-deps sglang==0.5.23`):

| rule | where in sglang 0.5.23 |
|---|---|
| `/update_weights_from_distributed` outside a session: 400 before receiving anything | `srt/managers/scheduler_components/weight_updater.py` `SchedulerWeightUpdaterManager.update_weights_from_distributed` |
| `/begin_weight_update` twice, `/end_weight_update` without one: 400 | same file, `begin_weight_update`, `end_weight_update` |
| group: `rendezvous(tcp://)`, `PrefixStore(group_name)`, torch's `_new_process_group_helper` | `srt/utils/common.py` `init_custom_process_group` |
| rank `rank_offset + tp_rank`; receive into tensors on the server's device, async broadcasts | `srt/model_executor/model_runner_components/weight_updater.py` `init_weights_update_group`, `receive_weights_from_distributed` |
| `load_format: "flattened_bucket"`: one uint8 broadcast, tensors back to back | same, `_receive_bucketed_weights_from_distributed`; `srt/weight_sync/tensor_bucket.py` `FlattenedTensorBucket.empty` |
| version: `"default"` at start, set by each update's `weight_version`, read at `GET /model_info` | `srt/entrypoints/http_server.py` `model_info`; `record_weight_version_after_update` |
| `/get_weight_version` does not exist (404) | `srt/entrypoints/http_server.py` (no such route) |
| `/health`, `/health_generate`: a one-token generation (≥ 1 s poll); held while paused, 503 after `HEALTH_CHECK_TIMEOUT` (20 s) | `srt/entrypoints/http_server.py` `health_generate` |
| `/ping`: a flag check, 200 while paused | `srt/entrypoints/http_server.py` `sagemaker_health` |
| `/pause_generation` modes abort / retract / in_place; abort returns partial output, finish_reason abort | `srt/managers/io_struct.py` `PauseGenerationReqInput`; `tokenizer_manager.py` `pause_generation` |
| `/abort_request`: prefix match, empty rid ignored, 200 with no body | `tokenizer_manager.py` `abort_request`; `scheduler.py` `abort_request` (`rid.startswith`) |
| unknown fields of admin bodies ignored; validation errors as `ErrorResponse` | `srt/managers/io_struct.py` (msgspec structs); `http_server.py` `validation_exception_handler` |

Generation is scripted: each request emits `max_new_tokens` pseudo-random token ids (one
every `token_interval_s`) with log-probs, so pauses and aborts can land mid-request.
`fail_updates` makes the next buckets fail *after* it was received (as a failed
`load_weights` does), so a test can break a push midway.

Torch registers process-group names per process, so several stand-ins in one group each run
in their own process, as SGLang servers do:

    python -m tests.sglang_standin --port 30000 [--no-session-api]

`GET /_standin/state` and `POST /_standin/fail_updates {"count": n}` are the test's hooks (not SGLang's).
LoRA adapters (`--enable-lora`, `/load_lora_adapter`, `lora_path` per request) follow the rules
listed in tests/sglang_standin_lora.py.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from tests.conftest import find_free_port
from tests.sglang_standin_lora import StandInLoRA

HEALTH_CHECK_TIMEOUT_S = 20.0


@dataclass
class _Req:
    rid: str
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    aborted: bool = False


def _sglang_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str, backend: str
):
    """What SGLang 0.5.23's `init_custom_process_group` does, for the store-less tcp:// case."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    timeout = datetime.timedelta(seconds=60)
    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        backend_options=None,
        timeout=timeout,
    )
    return pg


class StandInSGLang(StandInLoRA):
    """The server, on its own event loop in a daemon thread: `start()`, `url`, `stop()`."""

    def __init__(
        self,
        vocab_size: int = 64,
        device: str = "cuda",
        token_interval_s: float = 0.01,
        session_api: bool = True,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """`lora`: None (no `--enable-lora`) or the LoRA flags, e.g. `{"max_lora_rank": 8,
        "lora_target_modules": ["all"], "max_loaded_loras": 4}` (tests/sglang_standin_lora.py)."""
        self._lora_init(lora)
        self.vocab_size = vocab_size
        self.device = device
        """The device SGLang would receive into; "cuda" receives through the group's cuda backend."""
        self.token_interval_s = token_interval_s
        self.session_api = session_api
        """False: an older SGLang without `/begin_weight_update` / `/end_weight_update` (404)."""
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.weight_version = "default"
        self.weights: dict[str, torch.Tensor] = {}
        self.paused = False
        self.pause_mode: str | None = None
        self.session = False
        self.calls: list[str] = []  # every route hit, in order
        self.refused: list[str] = []  # requests refused by a rule, with the rule's message
        self.fail_updates = 0
        """Buckets still to fail (after receiving them), set by `POST /_standin/fail_updates`."""
        self.aborted = 0  # generations that returned finish_reason abort
        self.groups: dict[str, Any] = {}
        self._running: dict[str, _Req] = {}
        self._resume: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sglang-standin-{self.port}", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> StandInSGLang:
        self._thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("stand-in did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._resume = asyncio.Event()
        self._resume.set()
        app = web.Application(middlewares=[self._record])
        post = {
            "/generate": self._generate,
            "/init_weights_update_group": self._init_group,
            "/destroy_weights_update_group": self._destroy_group,
            "/begin_weight_update": self._begin,
            "/end_weight_update": self._end,
            "/update_weights_from_distributed": self._update_distributed,
            "/pause_generation": self._pause,
            "/continue_generation": self._continue,
            "/abort_request": self._abort,
            "/_standin/fail_updates": self._script_failure,
        }
        if not self.session_api:
            del post["/begin_weight_update"], post["/end_weight_update"]
        get = {"/health": self._health, "/health_generate": self._health, "/ping": self._ping,
               "/model_info": self._model_info, "/_standin/state": self._state}  # fmt: skip
        lora_post, lora_get = self._lora_routes()
        post |= lora_post
        get |= lora_get
        app.add_routes([web.post(p, h) for p, h in post.items()] + [web.get(p, h) for p, h in get.items()])
        self._runner = web.AppRunner(app, shutdown_timeout=1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    @web.middleware
    async def _record(self, request: web.Request, handler):
        self.calls.append(request.path)
        return await handler(request)

    @staticmethod
    def _result(success: bool, message: str) -> web.Response:
        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    def _refuse(self, message: str) -> web.Response:
        self.refused.append(message)
        return self._result(False, message)

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        ids, params = body.get("input_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids:
            return web.json_response(
                {"object": "error", "message": "input_ids: a non-empty list is required", "type": "Bad Request",
                 "param": None, "code": 400}, status=400)  # fmt: skip
        adapter, error = self._resolve_lora(body.get("lora_path"))
        if error is not None:
            return web.json_response({"error": {"message": error}}, status=400)
        await self._resume.wait()  # held while paused
        req = _Req(body.get("rid") or uuid.uuid4().hex)
        self._running[req.rid] = req
        gen = torch.Generator().manual_seed(hash((tuple(ids), req.rid, adapter)) & 0xFFFF)
        try:
            for _ in range(int(params.get("max_new_tokens", 16))):
                if req.aborted:
                    break
                if not self._resume.is_set() and self.pause_mode != "abort":
                    await self._resume.wait()  # in_place / retract: kept, goes on after continue
                    continue
                await asyncio.sleep(self.token_interval_s)
                req.output_ids.append(int(torch.randint(self.vocab_size, (1,), generator=gen)))
                req.logprobs.append(-float(torch.rand(1, generator=gen)) - 0.1)
        finally:
            self._running.pop(req.rid, None)
        self.aborted += req.aborted
        finish = {"type": "abort", "message": "Abort in waiting queue"} if req.aborted else {"type": "length",
                  "length": len(req.output_ids)}  # fmt: skip
        meta = {
            "id": req.rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(req.output_ids),
            "weight_version": self.weight_version,
            "output_token_logprobs": [
                [lp, t, None] for lp, t in zip(req.logprobs, req.output_ids, strict=True)
            ],
        }
        return web.json_response({"text": "", "output_ids": req.output_ids, "meta_info": meta})

    async def _pause(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return web.json_response(
                {"object": "error", "message": f"mode: {mode!r} is not one of abort, retract, in_place",
                 "type": "Bad Request", "param": None, "code": 400}, status=400)  # fmt: skip
        self.paused, self.pause_mode = True, mode
        self._resume.clear()
        if mode == "abort":
            for req in self._running.values():
                req.aborted = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        self.paused, self.pause_mode = False, None
        self._resume.set()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all"))
        if abort_all or rid:  # an empty rid would prefix-match everything: SGLang ignores it
            for req in self._running.values():
                if abort_all or req.rid.startswith(rid):
                    req.aborted = True
        return web.Response(status=200)

    # ------------------------------------------------------------------ health and info

    async def _health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # health_generate polls once a second for the 1-token generation
        try:
            await asyncio.wait_for(self._resume.wait(), HEALTH_CHECK_TIMEOUT_S)
        except asyncio.TimeoutError:
            return web.Response(status=503)
        return web.Response(status=200)

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "calls": self.calls, "refused": self.refused, "session": self.session, "paused": self.paused,
                "weight_version": self.weight_version, "aborted": self.aborted, "weights": {n: digest(t) for n, t in self.weights.items()},
                "adapters": self._loaded(), "generated_with": self.generated_with, "lora_bodies": self.lora_bodies,
            }
        )  # fmt: skip

    async def _script_failure(self, request: web.Request) -> web.Response:
        self.fail_updates = int((await request.json()).get("count", 1))
        return web.Response(status=200)

    async def _ping(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "stand-in", "is_generation": True,
                                  "weight_version": self.weight_version, "load_format": "auto"})  # fmt: skip

    # ------------------------------------------------------------------ weight updates

    async def _init_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        try:
            pg = await asyncio.to_thread(
                _sglang_group, b["master_address"], b["master_port"], b["rank_offset"], b["world_size"],
                b.get("group_name", "weight_update_group"), b.get("backend", "nccl"),
            )  # fmt: skip
        except Exception as exc:
            return self._result(False, f"Failed to initialize custom process group: {exc}.")
        self.groups[b.get("group_name", "weight_update_group")] = pg
        return self._result(True, "Succeeded to initialize custom process group.")

    async def _destroy_group(self, request: web.Request) -> web.Response:
        b = await request.json()
        if self.groups.pop(b.get("group_name", "weight_update_group"), None) is None:
            return self._result(False, "The group to be destroyed does not exist.")
        return self._result(True, "Succeeded to destroy custom process group.")

    async def _begin(self, request: web.Request) -> web.Response:
        if self.session:
            return self._refuse("a weight-update session is already open; call end_weight_update() first")
        self.session = True
        return self._result(True, "Success")

    async def _end(self, request: web.Request) -> web.Response:
        if not self.session:
            return self._refuse("no weight-update session is open; call begin_weight_update() first")
        self.session = False
        return self._result(True, "Success")

    async def _update_distributed(self, request: web.Request) -> web.Response:
        b = await request.json()
        if self.session_api and not self.session:
            return self._refuse(
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        group_name = b.get("group_name", "weight_update_group")
        if group_name not in self.groups:
            return self._result(False, f"Failed to receive weights: group {group_name} not initialised")
        try:
            weights = await asyncio.to_thread(
                self._receive,
                self.groups[group_name],
                b["names"],
                b["dtypes"],
                b["shapes"],
                b.get("load_format"),
            )
        except Exception as exc:
            return self._result(False, f"Failed to receive weights: {exc}")
        if self.fail_updates > 0:
            self.fail_updates -= 1
            return self._result(False, "Failed to update parameter online: scripted failure. The full weights "
                                "of the ModelRunner are partially updated. Please discard the whole weights.")  # fmt: skip
        self.weights.update(weights)
        if b.get("weight_version") is not None:
            self.weight_version = str(b["weight_version"])
        return self._result(True, "Succeeded to update parameter online.")

    def _receive(self, pg, names, dtypes, shapes, load_format) -> dict[str, torch.Tensor]:
        # CPU tensors stand for the server's device; "cuda" sends them through the group's cuda backend
        backend = pg._get_backend(torch.device(self.device))
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        dtypes = [getattr(torch, d) for d in dtypes]
        if load_format == "flattened_bucket":
            sizes, offset = [], 0
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                sizes.append(torch.Size(shape).numel() * dtype.itemsize)
                offset += sizes[-1]
            flat = torch.empty(offset, dtype=torch.uint8)
            backend.broadcast([flat], opts).wait(datetime.timedelta(seconds=60))
            out, offset = {}, 0
            for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
                out[name] = flat[offset : offset + size].view(dtype).reshape(shape).clone()
                offset += size
            return out
        tensors = [torch.empty(shape, dtype=dtype) for dtype, shape in zip(dtypes, shapes, strict=True)]
        works = [backend.broadcast([t], opts) for t in tensors]
        for work in works:
            work.wait(datetime.timedelta(seconds=60))
        return dict(zip(names, tensors, strict=True))


def digest(tensor: torch.Tensor) -> str:
    """dtype, shape and a hash of the bytes: equal iff the tensors are identical."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tensor.dtype}:{list(tensor.shape)}:{hashlib.sha256(raw).hexdigest()[:16]}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.sglang_standin")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--token-interval-s", type=float, default=0.01)
    parser.add_argument("--no-session-api", action="store_true", help="act as an SGLang without begin/end")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--lora-target-modules", nargs="*", default=["all"])
    parser.add_argument("--max-loaded-loras", type=int, default=None)
    opts = parser.parse_args()
    lora = None
    if opts.enable_lora:
        lora = {"max_lora_rank": opts.max_lora_rank, "lora_target_modules": opts.lora_target_modules,
                "max_loaded_loras": opts.max_loaded_loras}  # fmt: skip
    server = StandInSGLang(opts.vocab_size, opts.device, opts.token_interval_s, not opts.no_session_api, lora)
    server.port, server.url = opts.port, f"http://127.0.0.1:{opts.port}"
    server._run()


if __name__ == "__main__":
    main()
