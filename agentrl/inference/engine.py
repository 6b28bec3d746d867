"""The embedded server's batched generation loop (continuous batching over a HF causal LM).

Why our own loop rather than transformers' continuous-batching manager (`generate_batch`,
`ContinuousBatchingManager` in transformers 5.x): that manager applies one generation
config to every request, drops the partial output of a cancelled request, and offers no
point between decode steps where weights can be swapped — RL needs per-request sampling
parameters, partial results on abort (so a roller can resume), and weight loads that never
land inside a step. The loop here is compact:

* one engine thread owns the model; HTTP handlers hand it requests and commands;
* running sequences share one left-padded KV cache (per-layer tensors, agentrl/inference/batch.py);
  new requests are prefilled together and concatenated into the running batch between decode
  steps, finished ones are dropped and leading all-padding columns trimmed;
* prefill runs the model's forward (a `DynamicCache` built from those tensors); decode steps of a
  plain Qwen2 model run agentrl/inference/decode.py's lean step (the same math without
  transformers' per-call overhead), any other model its own forward;
* each step samples every row with its own temperature / top-k / top-p / min-p and returns
  the log-prob of the sampled token under the distribution actually sampled from (tempered
  and truncated), taken from the same forward pass;
* commands (weight loads, abort, pause, continue) run between steps, in arrival order;
* a step that raises (NaN weights, say) fails the requests in it as engine errors — SGLang's
  finish reason with status 500, which the HTTP server answers as an error, not as a resumable
  abort — and the server goes on; repeats of one error are logged rate-limited (`StepErrors`).

Colocated mode (agentrl/colocated) builds the engine on a module it already holds (`model=`:
its parameters are the generation buffers the reshard fills, no second `from_pretrained`) and
between phases calls `release()` (KV cache dropped; parameter storage freed on CPU, offloaded to
pinned CPU memory on CUDA) and `rebuild()` (agentrl/inference/buffers.py). With a `replica`
(agentrl/colocated/lockstep.py) the model is one tensor-parallel shard: this engine, the
replica's leader, broadcasts every change of the running batch (prefill inputs, the sampled
tokens of each decode step, the rows kept) so the followers run the identical forward on their
shards (agentrl/inference/replica.py); only the leader samples.

The module runs past 500 lines because `Engine` is one thread's state: the running batch, the
held requests, the paused flag and the served weights (base and adapter) are read and written by
the loop, by abort/pause and by the weight and adapter loads, which all run on the engine thread
between steps (HTTP handlers reach them through `submit` and `call`). What stands apart from that
state already has its own module (the KV batch, sampling, the lean decode step, the buffer
phases, the replica broadcasts, the served adapter); a further split would pass the thread's
state between modules.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agentrl.inference.batch import Batch, local, merge, select
from agentrl.inference.buffers import BufferPhases
from agentrl.inference.decode import lean_decoder
from agentrl.inference.replica import ReplicaFollowing
from agentrl.inference.sampling import SamplingParams, sample
from agentrl.log import get_logger
from agentrl.moe import RoutingRecorder, routing_shape

logger = get_logger(__name__)


@dataclass
class Request:
    """One sequence being generated; `on_done(request)` is called from the engine thread."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    """Version of the weights that generated the first token: if an update lands while the request
    runs, the older version is reported, so staleness is over- rather than under-stated."""
    created: float = field(default_factory=time.monotonic)
    generator: torch.Generator | None = None
    abort_message: str | None = None
    return_routed_experts: bool = False
    routed_experts: list[torch.Tensor] = field(default_factory=list)
    """MoE models, when asked: the experts of each token fed to the model ([n, layers, top_k] int32
    chunks, prompt first; agentrl/moe.py)."""


def engine_error(message: str) -> dict[str, Any]:
    """The finish reason of a request the engine failed: SGLang 0.5.23's `FINISH_ABORT(message,
    HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")` (`srt/managers/schedule_batch.py`),
    which its HTTP server answers as an HTTP 500 error, never as a resumable abort."""
    return {"type": "abort", "message": message, "status_code": 500, "err_type": "InternalServerError"}


def error_status(finish_reason: dict[str, Any] | None) -> int | None:
    """The HTTP status a finish reason stands for (an engine error: 500; a bad request: 400), or None
    for a plain abort (pause, weight update, abort request: resubmit to continue). SGLang 0.5.23's
    `TokenizerManager._handle_abort_finish_reason` turns a status in [400, 600) into an error."""
    status = (finish_reason or {}).get("status_code")
    return status if isinstance(status, int) and 400 <= status < 600 else None


class StepErrors:
    """The log of failing generation steps, rate-limited: a step that fails the same way over and
    over (NaN weights fail every step) logs its first failure with the traceback, then one line per
    `every_s` counting the repeats, and one line when steps succeed again."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.error: str | None = None  # the error of the failures in a row; None after a success
        self.repeats = 0  # failures with that error not yet logged
        self.total = 0  # failures in a row
        self._logged = 0.0

    def failed(self, exc: BaseException) -> None:
        error, now = f"{type(exc).__name__}: {exc}", time.monotonic()
        self.total += 1
        if error != self.error:
            self._flush()
            self.error, self._logged = error, now
            logger.error("generation step failed; its requests fail with HTTP 500: %s", error, exc_info=exc)
            return
        self.repeats += 1
        if now - self._logged >= self.every_s:
            self._flush()
            self._logged = now

    def succeeded(self) -> None:
        if self.error is not None:
            self._flush()
            logger.warning("generation steps succeed again after %d failed in a row", self.total)
            self.error, self.total = None, 0

    def _flush(self) -> None:
        if self.repeats:
            logger.error("generation step failed %d more time(s) with the same error since the last "
                         "report: %s", self.repeats, self.error)  # fmt: skip
            self.repeats = 0


class Engine(BufferPhases, ReplicaFollowing):
    """Owns a model and a thread that decodes all admitted requests together.

    Start-up: `Engine(...)` loads the model; `start()` launches the `_generate_loop` thread.
    Shutdown: `stop()` aborts what is left and joins the thread."""

    def __init__(
        self,
        model_path: str | None,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        context_length: int | None = None,
        cpu_threads: int | None = 1,
        logprobs: str = "full",
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
        replica: Any = None,
        lean_decode: bool = True,
        adapter: Any = None,
    ) -> None:
        """`model_path` is loaded with `from_pretrained` unless `model` is given: then that module
        (already on `device`, in `dtype`) is served as it is, and `model_path`, if set, only names
        where the tokenizer is (or pass `tokenizer`). `replica`: see the module docstring.
        `lean_decode`: decode steps of a plain Qwen2 model skip transformers' per-call machinery
        (agentrl/inference/decode.py; same logits); False always uses the model's forward.
        `adapter`: a `peft_adapter.ServedAdapter` already injected into `model`, served from the
        start (colocated LoRA: the HybridEngine refills its A and B in place)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if model is None and model_path is None:
            raise ValueError("Engine needs model_path or model")
        if cpu_threads is not None and not device.startswith("cuda"):
            torch.set_num_threads(cpu_threads)  # process-wide; see InferenceConfig.cpu_threads
        if logprobs not in ("full", "truncated"):
            raise ValueError(f"logprobs {logprobs!r}: use full or truncated (see InferenceConfig.logprobs)")
        self.full_logprobs = logprobs == "full"
        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.owns_params = model is None
        """The engine loaded its model itself: `load_weights(adopt=True)` may rebind its parameters.
        An engine built on a given module (colocated mode) only ever copies into them."""
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device)
        self.model = model.eval()
        self.tokenizer = tokenizer
        if tokenizer is None and model_path is not None:
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            except Exception as exc:  # a weights-only directory still serves input_ids requests
                logger.warning("no tokenizer in %s (%s): text in/out disabled", model_path, exc)
        self.replica = replica
        self._offloaded: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._offloaded_bytes: list[int] = []
        config = self.model.config
        self.vocab_size = int(config.vocab_size)
        self.context_length = int(context_length or getattr(config, "max_position_embeddings", 4096))
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.max_batch_size = max_batch_size
        self.weight_version = "0"
        self._adapter = adapter  # peft_adapter.ServedAdapter, from the first adapter loaded
        self._base_replaced: str | None = None  # the version of the last full-weight load
        self._lean = lean_decoder(self.model) if lean_decode else None
        self.routing_shape = routing_shape(self.model)  # (MoE layers, top-k); None for a dense model
        self._routing = RoutingRecorder(self.model) if self.routing_shape else None
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.Queue()
        self._wake = threading.Event()
        self._stopping = False
        self._paused = False
        self._batch: Batch | None = None
        self._held: list[Request] = []  # admitted while paused; start on continue
        self._thread: threading.Thread | None = None
        self._errors = StepErrors()
        self.steps = 0

    # ------------------------------------------------------------------ public, any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._generate_loop, name="generate_loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_running(self) -> int:
        batch = self._batch
        return len(batch.reqs) if batch is not None else 0

    def submit(self, req: Request) -> None:
        """Queue a request; it joins the running batch at the next step boundary."""
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(req.params.sampling_seed)
        self._waiting.put(req)
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` in the engine thread between two decode steps; its result lands in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return future

    def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "aborted") -> int:
        """(engine thread) Finish running/waiting requests whose rid starts with `rid` (SGLang 0.5.23
        `Scheduler.abort_request` matches by prefix; an empty rid matches nothing here) now with
        `finish_reason.type == "abort"`."""
        if not abort_all and not rid:
            return 0
        count = 0
        self._drain_waiting()
        held = []
        for req in self._held:
            if abort_all or req.rid.startswith(rid):
                self._finish(req, {"type": "abort", "message": message})
                count += 1
            else:
                held.append(req)
        self._held = held
        if self._batch is not None:
            keep = []
            for i, req in enumerate(self._batch.reqs):
                if abort_all or req.rid.startswith(rid):
                    self._finish(req, {"type": "abort", "message": message})
                    count += 1
                else:
                    keep.append(i)
            self._keep(keep)
        return count

    def pause(self, mode: str = "abort") -> int:
        """(engine thread) Stop generating until `resume()`; new requests are held. SGLang 0.5.23's
        modes (`PauseGenerationReqInput`): "abort" finishes everything in flight (partial output,
        finish_reason abort); "in_place" and "retract" keep the running requests, which go on after
        `resume()` with the KV cache they had (SGLang's retract recomputes it; here both keep it)."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"pause mode {mode!r}: use abort, retract or in_place")
        self._paused = True
        return self.abort(abort_all=True, message="generation paused") if mode == "abort" else 0

    def resume(self) -> None:
        """(engine thread) Start the held requests."""
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ weights (engine thread)

    def check_weights(self, tensors: dict[str, torch.Tensor], state: dict | None = None) -> None:
        """Raise ValueError naming every name the model lacks and every shape that differs (a
        tensor-parallel shard takes its full tensor or its local shard). `state`: the model's
        state dict, when the caller has it already."""
        if self._adapter is not None:
            tensors = self._adapter.base_names(tensors)
        state = self.model.state_dict() if state is None else state
        unknown = [n for n in tensors if n not in state]
        wrong = [
            f"{n}: got {list(t.shape)}, model has {list(state[n].shape)}"
            for n, t in tensors.items()
            if n in state and tuple(t.shape) not in (tuple(state[n].shape), tuple(local(state[n]).shape))
        ]
        problems = []
        if unknown:
            problems.append(f"unknown parameter names: {unknown[:5]}{' …' if len(unknown) > 5 else ''}")
        if wrong:
            problems.append(f"shape mismatch: {wrong[:5]}{' …' if len(wrong) > 5 else ''}")
        if problems:
            raise ValueError("; ".join(problems))

    def load_weights(
        self,
        tensors: dict[str, torch.Tensor],
        weight_version: str | None,
        adopt: bool = False,
        state: dict | None = None,
    ) -> None:
        """Load `tensors` into the model (checked first, so a bad update changes nothing). A DTensor
        parameter given its full tensor keeps its own slice (no communication). On a model that
        served a LoRA adapter, full weights replace the base and the adapter is cleared; adapters
        are refused from then on (they were trained on the original base).

        Each tensor is copied into its parameter in place, unless `adopt` (the caller hands the
        tensors over and will not write to them again) and the engine owns its parameters: then a
        tensor of the parameter's exact dtype, device and shape becomes the parameter's data
        (`param.data = tensor`, no copy; every module holding that parameter, tied ones included,
        sees it). Parameters that share storage with another parameter object, DTensor shards,
        buffers, and the parameters of an engine built on a module it was given (colocated mode:
        the reshard fills those buffers in place) are always copied into. `state`: the model's
        state dict, when the caller took it since the model last changed (a push's session)."""
        if self._offloaded is not None:
            raise RuntimeError("load_weights on released buffers: call rebuild() first")
        state = self.model.state_dict() if state is None else state
        self.check_weights(tensors, state)
        if self._adapter is not None:  # full weights (merged, or a full model) replace the adapter
            tensors = self._adapter.base_names(tensors)
            self._adapter.clear()
            state = self.model.state_dict()
        self._base_replaced = str(weight_version)
        params = self._adoptable() if adopt and self.owns_params else {}
        adopted = 0
        with torch.no_grad():
            for name, tensor in tensors.items():
                param = params.get(name)
                if param is not None and (tensor.dtype, tensor.device, tensor.shape) == (
                    param.dtype,
                    param.device,
                    param.shape,
                ):
                    param.data = tensor
                    adopted += 1
                    continue
                target = local(state[name])
                if tuple(tensor.shape) != tuple(target.shape):  # a full tensor for a TP shard
                    from torch.distributed.tensor import distribute_tensor

                    dt = state[name]
                    tensor = distribute_tensor(tensor, dt.device_mesh, dt.placements, src_data_rank=None)
                    tensor = tensor.to_local()
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        if weight_version is not None:
            self.weight_version = str(weight_version)
        logger.info("loaded %d tensors (%d adopted without a copy); weight_version=%s", len(tensors), adopted,
                    self.weight_version)  # fmt: skip

    def _adoptable(self) -> dict[str, torch.nn.Parameter]:
        """{name: parameter} (tied names included) of the parameters `load_weights` may rebind: plain
        tensors whose memory no other parameter object overlaps (a tie by shared storage, rather
        than by one shared parameter, would come apart if one side were rebound)."""
        named = dict(self.model.named_parameters(remove_duplicate=False))
        unique = {id(p): p for p in named.values()}
        if any(hasattr(p, "to_local") for p in unique.values()):
            return {}
        spans = sorted(
            (p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), key)
            for key, p in unique.items()
            if p.numel()
        )
        overlapping: set[int] = set()
        reach, owner = -1, None
        for start, end, key in spans:
            if start < reach:
                overlapping.update((key, owner))
            if end > reach:
                reach, owner = end, key
        return {name: p for name, p in named.items() if id(p) not in overlapping}

    @property
    def adapter_name(self) -> str | None:
        """The name of the LoRA adapter served on the base (None: none loaded)."""
        return None if self._adapter is None else self._adapter.name

    def check_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        """Raise ValueError unless `tensors` (PEFT's saved names) form the adapter `config`
        describes on this model (`peft_adapter.ServedAdapter.check`)."""
        from agentrl.inference.peft_adapter import ServedAdapter

        self._refuse_on_a_replaced_base()
        (self._adapter or ServedAdapter(self.model)).check(tensors, config)

    def _refuse_on_a_replaced_base(self) -> None:
        if self._base_replaced is not None:
            raise ValueError(
                f"this server's base weights were replaced by a full-weight push (version {self._base_replaced}): "
                "an adapter trained on the original base would not apply; restart the server from the base model"
            )

    def load_adapter(
        self, tensors: dict[str, torch.Tensor], config: dict[str, Any], weight_version: str | None
    ) -> None:
        """Serve base + the LoRA adapter `tensors` from now on (checked whole first: a refused one
        changes nothing), under `config["name"]`, tagged `weight_version`."""
        from agentrl.inference.peft_adapter import ServedAdapter

        if self._offloaded is not None:
            raise RuntimeError("load_adapter on released buffers: call rebuild() first")
        if self.replica is not None:
            raise ValueError("LoRA adapters on a tensor-parallel replica are not supported")
        self._refuse_on_a_replaced_base()
        adapter = self._adapter or ServedAdapter(self.model)
        adapter.load(tensors, config)  # checks the whole adapter before it injects or copies anything
        self._adapter = adapter
        if weight_version is not None:
            self.weight_version = str(weight_version)
        logger.info("loaded adapter %s (%d tensors); weight_version=%s", adapter.name, len(tensors),
                    self.weight_version)  # fmt: skip

    # ------------------------------------------------------------------ the loop

    def _generate_loop(self) -> None:
        """Commands, admission + prefill, one decode step; sleep when there is nothing to do."""
        torch.set_grad_enabled(False)
        while not self._stopping:
            self._run_commands()
            admitted = self._admit()
            stepped = False
            try:
                if admitted:
                    stepped = True
                    self._prefill(admitted)
                if self._batch is not None and not self._paused:
                    stepped = True
                    self._decode_step()
            except Exception as exc:  # keep serving: fail the rows in this step, not the server
                self._errors.failed(exc)
                for req in admitted + (self._batch.reqs if self._batch else []):
                    if req.finish_reason is None:
                        self._finish(req, engine_error(f"engine error: {type(exc).__name__}: {exc}"))
                self._keep([])
            else:
                if stepped:
                    self._errors.succeeded()
            if (self._batch is None or self._paused) and not admitted and self._commands.empty():
                self._wake.wait(0.05)
                self._wake.clear()
        self._run_commands()
        self.abort(abort_all=True, message="server shutting down")

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

    def _drain_waiting(self) -> None:
        while True:
            try:
                self._held.append(self._waiting.get_nowait())
            except queue.Empty:
                return

    def _admit(self) -> list[Request]:
        self._drain_waiting()
        if self._paused or not self._held:
            return []
        free = self.max_batch_size - self.num_running
        admitted, self._held = self._held[:free], self._held[free:]
        ready = []
        for req in admitted:
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
            else:
                ready.append(req)
        return ready

    def _forward(self, input_ids, mask, positions, keys=None, values=None):
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(ddp_cache_data=list(zip(keys, values, strict=True))) if keys else DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        layers = cache.layers
        return out.logits[:, -1, :].float(), [x.keys for x in layers], [x.values for x in layers]

    def _prefill(self, reqs: list[Request]) -> None:
        length = max(len(r.input_ids) for r in reqs)
        ids = torch.zeros(len(reqs), length, dtype=torch.long)
        mask = torch.zeros(len(reqs), length, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, length - len(r.input_ids) :] = torch.tensor(r.input_ids)
            mask[i, length - len(r.input_ids) :] = 1
        for r in reqs:
            r.weight_version = self.weight_version
        self._publish(("prefill", ids, mask))
        logits = self._prefill_rows(ids, mask, reqs)
        self._sample_and_advance(logits, first=len(self._batch.reqs) - len(reqs))

    def _prefill_rows(self, ids: torch.Tensor, mask: torch.Tensor, reqs: list) -> torch.Tensor:
        """Prefill left-padded `ids` and append the rows to the running batch; their last logits."""
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits, keys, values = self._forward(ids, mask, positions)
        self._record_routing(reqs, ids.shape[1])
        pad = (mask == 0)[:, None, :, None]
        keys = [k.masked_fill(pad, 0) for k in keys]
        values = [v.masked_fill(pad, 0) for v in values]
        new = Batch(reqs, keys, values, mask, mask.sum(1), torch.zeros(len(reqs), dtype=torch.long))
        self._batch = merge(self._batch, new)
        return logits

    def _decode_step(self) -> None:
        if self.replica is not None and self.replica.size > 1:
            self._publish(("decode", self._batch.last.cpu()))
        logits = self._decode_rows()
        self.steps += 1
        self._sample_and_advance(logits, first=0)

    def _decode_rows(self) -> torch.Tensor:
        b = self._batch
        ones = torch.ones(len(b.reqs), 1, dtype=b.mask.dtype, device=b.mask.device)
        mask = torch.cat([b.mask, ones], dim=1)
        if self._lean is not None:
            logits, keys, values = self._lean(b.last, mask, b.positions, b.keys, b.values)
        else:
            logits, keys, values = self._forward(
                b.last[:, None], mask, b.positions[:, None], b.keys, b.values
            )
        self._record_routing(b.reqs, 1)
        b.keys, b.values, b.mask, b.positions = keys, values, mask, b.positions + 1
        return logits

    def _record_routing(self, reqs: list[Request], length: int) -> None:
        """(MoE) Append the experts the last forward chose for each of `reqs`' real tokens (rows of
        `length` left-padded positions) to the requests that asked for them."""
        if self._routing is None:
            return
        chosen = self._routing.take()
        asked = [r is not None and r.return_routed_experts for r in reqs]  # None: a replica follower's row
        if chosen is None or not any(asked):
            return
        chosen = chosen.view(chosen.shape[0], len(reqs), length, -1).permute(1, 2, 0, 3).cpu()
        for row, req, wants in zip(chosen, reqs, asked, strict=True):
            if wants:  # decode feeds the last token; prefill, the prompt
                fed = 1 if req.output_ids else len(req.input_ids)
                req.routed_experts.append(row[length - fed :])

    def _keep(self, keep: list[int]) -> None:
        """Keep only rows `keep` of the running batch (on every rank of a replica)."""
        if self._batch is not None and len(keep) < len(self._batch.reqs):
            self._publish(("keep", keep))
            self._batch = select(self._batch, keep)

    def _sample_and_advance(self, logits: torch.Tensor, first: int) -> None:
        """Sample rows `first…` of the batch from `logits`, append, and retire finished rows."""
        b = self._batch
        rows = b.reqs[first:]
        if torch.isnan(logits).any():  # NaN weights: say so, rather than fail somewhere in sampling
            raise FloatingPointError("the model's logits are NaN: are its weights finite?")
        tokens, logprobs = sample(
            logits, [r.params for r in rows], [r.generator for r in rows], self.full_logprobs
        )
        b.last[first:] = tokens
        keep = list(range(first))
        for j, (req, token, logprob) in enumerate(zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)):
            req.output_ids.append(token)
            req.logprobs.append(logprob)
            reason = self._finish_reason(req, token)
            if reason is None:
                keep.append(first + j)
            else:
                self._finish(req, reason)
        self._keep(keep)

    def _finish_reason(self, req: Request, token: int) -> dict[str, Any] | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return {"type": "stop", "matched": token}
        if p.stop and self.tokenizer is not None:
            tail = self.tokenizer.decode(req.output_ids[-64:], skip_special_tokens=False)
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if len(req.input_ids) + len(req.output_ids) >= self.context_length:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Request, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        if req.weight_version is None:  # finished before it was prefilled (aborted, max_new_tokens=0)
            req.weight_version = self.weight_version
        try:
            req.on_done(req)
        except Exception:
            logger.exception("on_done callback of %s failed", req.rid)
