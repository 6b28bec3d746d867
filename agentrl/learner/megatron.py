"""The Megatron-core learner backend (`MegatronBackend`, `learner.backend: megatron`): the policy
as a Megatron-core `GPTModel` with tensor parallel (`learner.megatron.tp`), pipeline parallel
(`pp`, Megatron's own 1F1B schedule) and data parallel over the remaining ranks.

    backend = MegatronBackend(tp=2, pp=1)       # world 4: 2 data-parallel replicas of a TP-2 model
    actor = backend.build("policy", "runs/models/tiny", optim=cfg.optim)

The model is built from the checkpoint's Hugging Face config with Megatron's local layer spec
(no Transformer Engine, so the same code runs on CPU) as a `megatron_model.MegatronModel` and
loaded from its safetensors by `megatron_model.load_hf` (the layouts: `megatron_convert`). Every forward goes through `get_forward_backward_func()` (with one stage
it runs the micro-batches in turn); the learner's `loss_fn` runs on the last stage, on the
vocabulary-parallel logits gathered over the TP group, so the same log-prob code, losses and
corrections as the FSDP2 backend apply. Packed rows get an explicit block-diagonal causal mask;
Megatron's RoPE numbers positions along the row, which within each sequence differs from the
restarting position ids by a constant shift (RoPE attends by relative position).

Optimizer: torch AdamW over each rank's TP/PP shard (AdamW is elementwise, so sharded AdamW is
full AdamW), gradients summed over the data-parallel group, tied embeddings' two copies
(first and last pipeline stage) summed over Megatron's embedding group, and the global norm
clipped as `clip_grad_norm_` does. Megatron's DistributedOptimizer (optimizer state sharded
over DP) is not used here.

On a machine without CUDA, `megatron_cpu.apply()` installs the shims Megatron needs first.
Resumable checkpoints (`megatron_checkpoint`) are one file per (TP, PP) coordinate, written by
data-parallel rank 0: resuming needs the same tp and pp (any data-parallel size).

The critic (`kind="value"`) is the same GPTModel whose last stage ends in a `ValueHead` (HF's
`score`, hidden -> 1, zero-initialised) instead of the vocabulary; it loads from, and exports to,
the HF token-classification names (`model.*`, `score.*`) the FSDP2 critic uses. A frozen
reference is a policy built without an optimizer. `local_shards` gives the colocated HybridEngine
each rank's TP shard in HF layout (one pipeline stage).

A mixture-of-experts model (Qwen2-MoE, Qwen3-MoE; `megatron_convert.moe_config`) has Megatron MoE
layers whose routed experts are whole on every TP rank; with `routed_experts` in a micro-batch
(`learner.moe.router_replay`) each router takes the recorded experts (`megatron_model.RoutingReplay`,
set per micro-batch in the schedule's forward step).

With `learner.lora` the policy is frozen and carries LoRA adapters on its parallel linear layers
(`megatron_lora`): only they are in AdamW and in checkpoints, the KL reference is the same model
with them off (`adapter_disabled`), and `adapter_tensors` / `merged_tensors` give them in PEFT's
names or merged into the HF weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from agentrl.learner import megatron_checkpoint, megatron_lora
from agentrl.learner import megatron_convert as convert
from agentrl.learner.backend import LocalShard, ModelPart, NonFiniteError, PartKind
from agentrl.learner.fsdp import FSDP2Backend, init_distributed
from agentrl.learner.megatron_model import (
    MegatronModel,
    ValueHead,
    causal_mask,
    grad_through,
    layer_spec,
    load_hf,
    padding_idx,
    replayable_moe,
)
from agentrl.learner.packing import MicroBatch
from agentrl.log import get_logger

log = get_logger("learner.megatron")


def _refuse(
    kind: PartKind, hf: Any, shape: Any, *, trained: bool, sharded: bool, bf16: bool, lora: Any
) -> None:
    """What `MegatronBackend.build` cannot build, refused with the setting to change."""
    if sharded:
        raise ValueError(
            "learner.backend megatron: `shard` is an FSDP2 layout; the Megatron backend keeps its own TP "
            "layout (colocated mode reads it through local_shards)"
        )
    if bf16:
        raise ValueError("learner.backend megatron: learner.dtype bfloat16 is not wired here; use float32")
    if lora is not None and (kind != "policy" or not trained):
        raise ValueError("learner.lora: adapters go on the trained policy only")
    if lora is not None and shape.experts:
        raise ValueError(f"learner.lora with learner.backend megatron: {hf.model_type} is a mixture-of-experts "
                         "model, whose experts the Megatron adapters do not cover; use learner.backend fsdp2")  # fmt: skip


class MegatronBackend:
    """`LearnerBackend` on Megatron-core (see `backend.py` for each method's contract)."""

    def __init__(self, tp: int = 1, pp: int = 1, seed: int = 0) -> None:
        self.rank, self.world_size, self.device = init_distributed()
        if self.device.type == "cpu":
            from agentrl.learner import megatron_cpu

            megatron_cpu.apply()
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        if self.world_size % (tp * pp):
            raise ValueError(f"learner.megatron: tp {tp} x pp {pp} must divide the {self.world_size} learner "
                             "ranks (learner.num_processes)")  # fmt: skip
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        # routed experts whole on every TP rank (megatron_convert.moe_config); no effect on dense models
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_tensor_parallel_size=1
        )
        model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
        self.ps = ps
        self.tp, self.pp, self.seed = tp, pp, seed
        self.tp_rank, self.pp_rank = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
        )
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.first, self.last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self._output: torch.Tensor | None = None  # the last stage's output inside the schedule
        self._mb: MicroBatch | None = None  # the micro-batch whose forward the schedule is running
        self._tp_mesh: Any = None  # the TP group as a DeviceMesh (local_shards' placements)
        log.info("megatron: rank %d is tp %d/%d, pp %d/%d, dp %d/%d", self.rank, self.tp_rank, tp,
                 self.pp_rank, pp, self.dp_rank, self.dp_size)  # fmt: skip

    # -- building and loading -------------------------------------------------------------

    def build(
        self,
        kind: PartKind,
        path: str | Path,
        *,
        name: str = "actor",
        optim: Any = None,
        lr_lambda: Callable[[int], float] | None = None,
        activation_checkpointing: bool = False,
        bf16: bool = False,
        shard: Callable[[nn.Module], nn.Module] | None = None,
        lora: Any = None,
        push_buckets: int | None = None,  # ignored: a push converts to HF layout (a copy) anyway
    ) -> ModelPart:
        from megatron.core.models.gpt import GPTModel
        from transformers import AutoConfig

        path = Path(path)
        hf = AutoConfig.from_pretrained(str(path))
        shape = convert.shape_of(hf)
        _refuse(kind, hf, shape, trained=optim is not None, sharded=shard is not None, bf16=bf16, lora=lora)
        if kind == "value":  # the decoder's embedding alone: the head is not the vocabulary
            shape = dataclasses.replace(shape, tied=False)
        config = convert.transformer_config(hf, self.tp, self.pp, torch.float32, activation_checkpointing)
        gpt = GPTModel(
            config,
            layer_spec(config, shape),
            vocab_size=shape.vocab,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=self.first,
            post_process=self.last,
            share_embeddings_and_output_weights=shape.tied,
            position_embedding_type="rope",
            rotary_base=convert.rope_theta(hf),
        ).to(self.device)
        if self.first and getattr(hf, "pad_token_id", None) is not None:
            padding_idx(gpt.embedding.word_embeddings, hf.pad_token_id)
        if kind == "value" and self.last:
            gpt.output_layer = ValueHead(shape.hidden).to(self.device)
        module = MegatronModel(gpt, hf, shape, kind)
        if shape.experts:
            replayable_moe(module)
        load_hf(module, path, self.tp, self.tp_rank)
        if optim is None:
            module.eval().requires_grad_(False)
            return ModelPart(name, kind, module)
        if lora is not None:  # adapters on the frozen base: only they train
            module.adapter_names = megatron_lora.attach(
                module, lora, self.tp, self.tp_rank, self.pp, self.seed
            )
            module.lora, module.base_path = lora, str(path)
            if self.first and activation_checkpointing:
                grad_through(gpt.embedding)
        module.train()
        trained = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trained, lr=optim.lr, betas=optim.adam_betas,
                                      weight_decay=optim.weight_decay, fused=True)  # fmt: skip
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda or (lambda step: 1.0))
        return ModelPart(name, kind, module, optimizer, scheduler)

    # -- forwards and the step ------------------------------------------------------------

    def _schedule(
        self,
        part: ModelPart,
        mbs: list[MicroBatch],
        on_output: Callable[[MicroBatch], torch.Tensor],
        forward_only: bool,
    ) -> None:
        """Run Megatron's forward(-backward) schedule over `mbs`; on the last stage, `on_output(mb)`
        runs with that micro-batch's output in `self._output` (a policy's logits gathered over the
        TP group, a value model's values) and returns its loss."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        def forward_step(data: Iterator[MicroBatch], gpt: nn.Module) -> tuple[torch.Tensor, Callable]:
            mb = next(data)
            self._mb = mb
            self._route(part, mb.routed_experts, mb.input_ids.shape[0])
            out = gpt(mb.input_ids, mb.position_ids, causal_mask(mb.position_ids))

            def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                policy = part.kind == "policy"
                self._output = gather_from_tensor_model_parallel_region(output) if policy else output
                try:
                    loss = on_output(mb)
                finally:
                    self._output = None
                # (loss, tokens, metrics) with calculate_per_token_loss: taken as is (no rescaling)
                return loss, torch.ones((), dtype=torch.int), {}

            return out, loss_func

        rows, width = mbs[0].input_ids.shape
        # a LoRA actor's KL reference runs the actor's model with its adapters off
        disabled = isinstance(part.module, megatron_lora.AdapterDisabled)
        try:
            with part.module.off() if disabled else contextlib.nullcontext():
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iter(mbs), model=[part.module.gpt],
                    num_microbatches=len(mbs), seq_length=width, micro_batch_size=rows, forward_only=forward_only,
                )  # fmt: skip
        finally:
            self._mb = None
            self._route(part, None, rows)

    def _route(self, part: ModelPart, routed: torch.Tensor | None, rows: int) -> None:
        """Set this stage's routers to replay `routed` ([rows·T, layers·top_k], in the layout of
        `input_ids.reshape(-1)`; None: their own top-k). Megatron routes the tokens of its
        [T, rows, H] hidden states, position-major, so the rows are transposed to that order.
        With activation recompute the recomputed forward runs right after the micro-batch's own
        (one pipeline stage), with the same target."""
        routers = getattr(part.module, "routers", [])
        if routed is None:
            for _, router in routers:
                router.router_replay.target = None
            return
        shape = part.module.shape
        layers = sum(shape.sparse)
        if not layers:
            raise ValueError(f"router replay: {shape} is not a mixture-of-experts model")
        if routed.dim() != 2 or routed.shape[1] != layers * shape.top_k or routed.shape[0] % rows:
            raise ValueError(f"router replay: routed experts of shape {tuple(routed.shape)}, the model has "
                             f"{layers} MoE layers of top-{shape.top_k} ([tokens, layers·top_k] expected)")  # fmt: skip
        seq_major = (
            routed.view(rows, -1, layers, shape.top_k).transpose(0, 1).reshape(-1, layers, shape.top_k)
        )
        for moe_layer, router in routers:
            router.router_replay.target = seq_major[:, moe_layer]

    def _forward_only(
        self, part: ModelPart, mb: MicroBatch, compute: Callable[[MicroBatch], torch.Tensor]
    ) -> torch.Tensor:
        """A forward of its own (outside `forward_backward`): the last stage computes `compute(mb)`
        (flat, one float per position) from the output, and every stage receives it."""
        result: dict[str, torch.Tensor] = {}

        def keep(mb: MicroBatch) -> torch.Tensor:
            result["out"] = compute(mb).detach().float()
            return result["out"].sum() * 0

        self._schedule(part, [mb], keep, forward_only=True)
        out = result["out"] if self.last else torch.empty(mb.input_ids.numel(), device=self.device)
        if self.pp > 1:
            group = self.ps.get_pipeline_model_parallel_group()
            dist.broadcast(out, dist.get_process_group_ranks(group)[-1], group=group)
        return out

    def logprobs(
        self, part: ModelPart, mb: MicroBatch, temperature: float = 1.0, entropy: str = "none"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from agentrl.learner.hf_model import logprobs_from_logits

        if self._output is not None:  # inside the schedule, on the last stage
            if self._own_routing_of_current(mb):
                return self._own_routing_logprobs(part, mb, temperature), None
            return logprobs_from_logits(self._output, mb, temperature, entropy)
        if entropy != "none":
            raise ValueError("MegatronBackend.logprobs: entropy is computed inside forward_backward only")
        logp = self._forward_only(part, mb, lambda mb: logprobs_from_logits(self._output, mb, temperature)[0])
        return logp, None

    def _own_routing_of_current(self, mb: MicroBatch) -> bool:
        """Whether `mb` is the micro-batch the schedule is running with its routed experts left out
        (`train_step.mismatch_without_replay`): its log-probs need a forward of their own."""
        current = self._mb
        return (
            current is not None
            and current.routed_experts is not None
            and mb.routed_experts is None
            and mb.input_ids is current.input_ids
        )

    def _own_routing_logprobs(self, part: ModelPart, mb: MicroBatch, temperature: float) -> torch.Tensor:
        """Inside the schedule's loss function: the log-probs of the running micro-batch under the
        model's own routing, from a second forward without gradient on this (only) stage; the
        replay targets are restored for the backward's recompute."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        from agentrl.learner.hf_model import logprobs_from_logits

        if self.pp > 1:
            raise NotImplementedError(
                "learner.backend megatron: the log-probs without router replay need one pipeline stage (pp 1)"
            )
        current = self._mb
        self._route(part, None, mb.input_ids.shape[0])
        try:
            with torch.no_grad():
                out = part.module.gpt(mb.input_ids, mb.position_ids, causal_mask(mb.position_ids))
                logits = gather_from_tensor_model_parallel_region(out)
                return logprobs_from_logits(logits, mb, temperature)[0]
        finally:
            self._route(part, current.routed_experts, current.input_ids.shape[0])

    def values(self, part: ModelPart, mb: MicroBatch) -> torch.Tensor:
        if self._output is not None:  # inside the schedule, on the last stage: [rows, T, 1]
            return self._output.reshape(-1).float()
        return self._forward_only(part, mb, lambda mb: self._output.reshape(-1))

    # framework-independent: eval mode and no_grad; rank 0's object over the world
    frozen = FSDP2Backend.frozen
    broadcast_object = FSDP2Backend.broadcast_object

    def forward_backward(
        self, part: ModelPart, mbs: list[MicroBatch], loss_fn: Callable[[MicroBatch], torch.Tensor]
    ) -> None:
        part.optimizer.zero_grad(set_to_none=True)
        self._schedule(part, mbs, loss_fn, forward_only=False)
        params = [p for p in part.module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a stage can leave a parameter unused (e.g. empty micro-batches)
                p.grad = torch.zeros_like(p)
        if self.dp_size > 1:  # each rank's loss is already normalised over the whole batch: sum
            _all_reduce_flat([p.grad for p in params], self.ps.get_data_parallel_group())
        tied = self._tied_copy(part)
        # the embedding on the first stage and its copy on the last (frozen under LoRA)
        if tied is not None and tied.requires_grad:
            dist.all_reduce(tied.grad, group=self.ps.get_embedding_group())

    def adapter_disabled(self, part: ModelPart) -> ModelPart:
        """The KL reference of a LoRA actor: its model with the adapters off (no second copy)."""
        return ModelPart("ref", "policy", megatron_lora.AdapterDisabled(part.module))

    def _tied_copy(self, part: ModelPart) -> nn.Parameter | None:
        """Under pipeline parallel with tied embeddings, this stage's copy of the shared matrix."""
        gpt = part.module.gpt
        if self.pp == 1 or not part.module.shape.tied:
            return None
        if self.first:
            return gpt.embedding.word_embeddings.weight
        return gpt.output_layer.weight if self.last else None

    def _grad_norm(self, part: ModelPart) -> float:
        """The global L2 norm of the gradients: TP-sharded parameters summed over the TP group,
        replicated ones counted once, the stages summed, the tied copy on the last stage skipped."""
        gpt = part.module.gpt
        skip = gpt.output_layer.weight if (self.pp > 1 and part.module.shape.tied and self.last) else None
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in gpt.named_parameters():
            if p.grad is None or p is skip:
                continue
            if part.module.partition_dim(name) is not None or self.tp_rank == 0:
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.ps.get_model_parallel_group())
        return math.sqrt(float(squares))

    def optimizer_step(self, part: ModelPart, max_grad_norm: float, skip: bool = False) -> tuple[float, bool]:
        norm = self._grad_norm(part)
        grads = [p.grad for p in part.module.parameters() if p.grad is not None]
        if math.isfinite(norm) and grads:  # as torch's clip_grad_norm_: scale by min(1, max/(norm+1e-6))
            torch._foreach_mul_(grads, min(1.0, max_grad_norm / (norm + 1e-6)))
        applied = math.isfinite(norm) and not skip
        if applied:
            self._checked_step(part)
        part.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def _checked_step(self, part: ModelPart) -> None:
        """AdamW and the LR schedule between finiteness checks of the state it reads and the
        weights it writes (`NonFiniteError`; as the FSDP2 backend's)."""
        bad = self.first_nonfinite(part, params=False, state=True)
        if bad is not None:
            part.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteError(f"{bad} of the {part.name} is not finite: the optimizer step was not taken "
                                 "(resume from an earlier checkpoint)")  # fmt: skip
        lr = part.lr
        part.optimizer.step()
        part.scheduler.step()
        bad = self.first_nonfinite(part, params=True, state=False)
        if bad is not None:
            raise NonFiniteError(f"{bad} of the {part.name} is not finite after the optimizer step (lr {lr:g}): "
                                 "not pushed and not saved")  # fmt: skip

    def first_nonfinite(self, part: ModelPart, params: bool = True, state: bool = True) -> str | None:
        bad = None
        for name, param in part.module.gpt.named_parameters():
            tensors = [(name, param.detach())] if params else []
            if state and part.optimizer is not None:
                tensors += [(f"{name} ({k})", v) for k, v in part.optimizer.state.get(param, {}).items()
                            if torch.is_tensor(v) and v.dim() > 0]  # fmt: skip
            bad = next((n for n, t in tensors if not torch.isfinite(t).all()), None)
            if bad is not None:
                bad = f"{bad} (tp {self.tp_rank}, pp {self.pp_rank})"
                break
        found = [None] * self.world_size
        dist.all_gather_object(found, bad)
        return next((b for b in found if b is not None), None)

    def all_reduce(self, values: dict[str, float], op: Literal["sum", "max"]) -> dict[str, float]:
        """Over one rank per data-parallel replica (TP rank 0 of the last stage: where the loss ran)."""
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (self.tp_rank == 0 and self.last, values))
        counted = [v for speaks, v in gathered if speaks]
        combine = sum if op == "sum" else max
        return {k: float(combine(v[k] for v in counted)) for k in counted[0]}

    # -- gathering, saving, exporting -----------------------------------------------------

    def _over_stages(
        self,
        mine: list[tuple[tuple[str, ...], list[torch.Size]]],
        make: Callable[[int], tuple[torch.Tensor, ...]],
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's named tensors on every rank, stage by stage: `mine` lists this stage's
        entries (names, shapes); `make(i)` builds entry i's tensors on its own stage (with any TP
        gathers), and the other stages receive them by broadcast over the pipeline group."""
        stages: list[Any] = [None] * self.world_size
        dist.all_gather_object(stages, (self.pp_rank, mine))
        group = self.ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        for stage in range(self.pp):
            entries = next(m for r, m in stages if r == stage)
            for i, (names, shapes) in enumerate(entries):
                if stage == self.pp_rank:
                    tensors = make(i)
                else:
                    tensors = [torch.empty(s, device=self.device) for s in shapes]
                for name, tensor in zip(names, tensors, strict=True):
                    if group is not None:
                        tensor = tensor.contiguous()
                        dist.broadcast(tensor, dist.get_process_group_ranks(group)[stage], group=group)
                    yield name, tensor

    def _full(self, part: ModelPart, name: str, param: torch.Tensor) -> torch.Tensor:
        """The full Megatron tensor of a parameter (its TP shards gathered)."""
        dim = part.module.partition_dim(name)
        if self.tp == 1 or dim is None:
            return param.detach()
        shards = [torch.empty_like(param) for _ in range(self.tp)]
        dist.all_gather(shards, param.detach().contiguous(), group=self.ps.get_tensor_model_parallel_group())
        return torch.cat(shards, dim=dim)

    def _whole_shape(self, part: ModelPart, name: str, param: torch.Tensor) -> torch.Size:
        full, dim = list(param.shape), part.module.partition_dim(name)
        if dim is not None:
            full[dim] *= self.tp
        return torch.Size(full)

    def full_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """The base model's tensors under HF names (a LoRA model's adapters are `adapter_tensors`); an
        MoE model's experts fused per layer as transformers holds them (`convert.fuse_experts`)."""
        module = part.module
        params = [(n, p) for n, p in module.base_parameters()
                  if not (p is self._tied_copy(part) and self.last and not self.first)]  # fmt: skip
        # (the tied matrix is exported once, from the first stage)
        mine = []
        for name, param in params:
            meta = torch.empty(self._whole_shape(part, name, param), device="meta")
            mine.append(
                (module.hf_names(name), [t.shape for t in convert.to_hf(name, meta, module.shape, self.tp)])
            )

        def make(i: int) -> tuple[torch.Tensor, ...]:
            name, param = params[i]
            return convert.to_hf(name, self._full(part, name, param), module.shape, self.tp)

        tensors = self._over_stages(mine, make)
        return convert.fuse_experts(tensors, module.shape.experts) if module.shape.experts else tensors

    def adapter_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """A LoRA actor's lora_A / lora_B, whole (gathered over TP), under PEFT's saved names
        (`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`). A collective."""
        module = part.module
        params = [(n, p) for n, p in module.gpt.named_parameters() if n in module.adapter_names]
        mine = [((module.adapter_names[n],), [self._whole_shape(part, n, p)]) for n, p in params]
        return self._over_stages(mine, lambda i: (self._full(part, *params[i]),))

    def merged_tensors(self, part: ModelPart) -> Iterator[tuple[str, torch.Tensor]]:
        """`full_tensors` with each adapted Linear's weight merged, W + (alpha / rank) B A: a plain
        HF model's weights, for servers without adapters. A collective."""
        adapters = dict(self.adapter_tensors(part))
        scaling = part.module.lora.alpha / part.module.lora.rank
        for name, tensor in self.full_tensors(part):
            module = megatron_lora.PEFT_PREFIX + name.removesuffix(".weight")
            if name.endswith(".weight") and f"{module}.lora_A.weight" in adapters:
                a, b = adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
                tensor = tensor + (b @ a) * scaling
            yield name, tensor

    def local_shards(self, part: ModelPart) -> Iterator[LocalShard]:
        """This rank's TP shard of every parameter under its HF name and in HF layout, placed
        `Shard(dim)` (or `Replicate()`) over the TP group: what the colocated HybridEngine
        reshards from. Views of the parameters, except q/k/v when this rank holds more than one
        key/value group of the grouped `linear_qkv` (then a re-arranged copy of its own shard;
        the engine copies it into its generation buffer). One pipeline stage only."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate, Shard

        if self.pp > 1:
            raise NotImplementedError(
                "learner.backend megatron: the colocated HybridEngine reshards one pipeline stage (pp 1)"
            )
        if part.module.lora is not None:
            raise NotImplementedError("learner.lora: the colocated HybridEngine does not take adapters")
        if part.module.shape.experts:
            raise NotImplementedError(
                "learner.backend megatron: the colocated HybridEngine does not reshard a mixture-of-experts "
                "model's experts from Megatron (use learner.backend fsdp2, or mode: decoupled)"
            )
        if self._tp_mesh is None:
            self._tp_mesh = DeviceMesh.from_group(self.ps.get_tensor_model_parallel_group(), self.device.type)
        module = part.module
        local_shape = convert.tp_local(module.shape, self.tp)
        for name, param in module.base_parameters():
            dim = module.partition_dim(name)
            placement = (Shard(dim),) if dim is not None else (Replicate(),)
            if name.endswith("linear_fc1.weight"):  # this rank's [gate_r; up_r]: two views
                pieces = tuple(param.detach().chunk(2))
            else:
                pieces = convert.to_hf(name, param.detach(), local_shape, 1)
            for hf_name, local in zip(module.hf_names(name), pieces, strict=True):
                full = list(local.shape)
                if dim is not None:
                    full[dim] *= self.tp
                yield LocalShard(hf_name, local, placement, self._tp_mesh, torch.Size(full))

    def save(self, parts: list[ModelPart], path: Path) -> None:
        megatron_checkpoint.save(self, parts, path)

    def load(self, parts: list[ModelPart], path: Path) -> None:
        megatron_checkpoint.load(self, parts, path)

    def export(self, part: ModelPart, out_dir: Path, tokenizer_path: str | Path | None) -> Path:
        return megatron_checkpoint.export(self, part, out_dir, tokenizer_path)


def _all_reduce_flat(tensors: list[torch.Tensor], group: Any) -> None:
    """Sum `tensors` over `group` in one collective (flattened into one buffer and back)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for tensor, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
        tensor.copy_(reduced)
