"""The HybridEngine reshard: the actor's FSDP2 (optionally FSDP2 + TP) training shards become the
generation layout's tensor-parallel shards, gathered inside each micro-DP group only, and the
generation buffers are released again before training.

Layouts and rank maps are in layout.py, the TP plan in tp.py. The training layouts supported
here are FSDP2 over `d` ranks, optionally tensor parallel over `t` (`p = 1`; a (dp, tp)
DeviceMesh, `rank = d_idx·t + t_idx`, torch-native `parallelize_module` with tp.py's plan, then
`fully_shard` over dp), and Megatron's tensor parallel over every rank (`fsdp=False`, `d = 1`:
the Megatron backend's `local_shards` gives its TP shards in HF layout, norms whole); the
generation layout is `tg`-way TP with `dg = t·d/tg` micro-DP replicas,
on a DeviceMesh ("dg", "tg") built from `layout.gen_mesh()`. Pipeline stages (`p > 1`) and
replicated data parallel exist in the rank maps only.

FSDP shards each parameter on its TP dim (tp.fsdp_shard_placement), and on top of TP it shards
the TP-local tensor (`_StridedShard`): rank `r` holds block `s = t_idx·d + d_idx` of the `t·d`
blocks of the TP dim, and its generation shard is blocks `g·dg .. g·dg + dg - 1` (layout.py's
grouping `s = g·dg + j`). So per parameter:

- column-wise and vocab-parallel (`Shard(0)`): the rank copies its block into slot `j` of the
  generation buffer and runs `all_gather_into_tensor` over its micro-DP group.
- row-wise (`Shard(1)`): the generation buffer is stored transposed, `(in/tg, out)`, and the
  module's weight is its `.t()` view, so the gathered column blocks are contiguous rows and the
  same all-gather applies.
- replicated (RMSNorms; FSDP shards them over the `d` ranks of the rank's TP index): gathered
  over that FSDP group (a few KB).
- a gather over one rank (`dg = 1`, or a norm at `d = 1`): the generation parameter is a view of
  the training shard itself; nothing is copied and no memory is added. (Where the backend's block
  is a re-arranged copy of its shard, Megatron's q/k/v with several KV groups per rank, the bound
  copy is refreshed from the current one at each `to_generation()`.)

Parameters whose generation shard is at most `bucket_bytes` are gathered in buckets (one
all-gather per bucket and group: on gloo each collective costs a fixed latency that dominates
small models): each rank packs its blocks into a staging buffer of the bucket's gathered size,
one all-gather fills it, and the blocks are copied out to the generation buffers. At most
`MAX_STAGING` stagings are alive at once; `staging_bytes` is their bound and counts in
`peak_param_bytes` (training shard + generation buffers + staging). Larger parameters are
gathered in place in their own buffers, no staging. `release()` frees the generation storages
(`untyped_storage().resize_(0)`); the generation model keeps its parameter objects, so an engine
built on it stays valid and the next `to_generation()` refills the same tensors.

Frozen parameters (`frozen`: a LoRA actor's base weights, which never change) are gathered by the
first `to_generation()` only; their buffers stay filled across `release()`, and every later
reshard gathers the other parameters alone (the adapters' lora_A / lora_B). Each reshard reports
the bytes its gathers filled on this rank, and the frozen parameters' share of them
(`ReshardStats`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrl.hybrid.gather import (
    Bucket,
    GenSlot,
    Group,
    Unit,
    all_gather_coalesced,
    all_gather_single,
    coalesced_units,
    plan_buckets,
    reorder,
    unpack,
)
from agentrl.hybrid.layout import HybridLayout, box_numel
from agentrl.hybrid.tp import fsdp_shard_placement, specs_of, tensor_parallelize, tp_dim

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from agentrl.learner.backend import LocalShard

BUCKET_BYTES = 4 << 20
MAX_STAGING = 2  # bucket stagings alive at once: one being filled by gloo, one being copied out


@dataclass
class HybridMeshes:
    """`train`: the FSDP mesh (the d ranks of one TP index); `train_tp`: the training TP mesh
    (None at t = 1); `gen`: ("dg", "tg") mesh; `tp`: this rank's generation TP submesh."""

    train: DeviceMesh
    gen: DeviceMesh
    tp: DeviceMesh
    train_tp: DeviceMesh | None = None


@dataclass
class ReshardStats:
    seconds: float
    collectives: int
    bytes_out: int  # bytes of this rank's generation shards, views of the training shards included
    gathered_bytes: int = 0  # bytes this reshard's gathers filled on this rank, its own blocks included
    frozen_bytes: int = 0  # the frozen parameters' part of `gathered_bytes` (the first reshard's only)


@dataclass
class GatherPlan:
    """The slots one reshard gathers: large ones in place, the others in buckets (and, for the
    coalesced transport, its units)."""

    in_place: list[GenSlot]
    buckets: list[Bucket]
    units: list[Unit]

    def slots(self) -> list[GenSlot]:
        return self.in_place + [slot for bucket in self.buckets for slot in bucket.slots]


def build_meshes(layout: HybridLayout, device_type: str = "cpu") -> HybridMeshes:
    """The training and generation meshes; every rank must call this (each dim creates groups)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    _check_supported(layout)
    tr = layout.train
    if tr.t > 1:
        full = init_device_mesh(device_type, (tr.d, tr.t), mesh_dim_names=("dp", "tp"))
        train, train_tp = full["dp"], full["tp"]
    else:
        train, train_tp = init_device_mesh(device_type, (tr.d,), mesh_dim_names=("fsdp",)), None
    gen = DeviceMesh(device_type, torch.tensor(layout.gen_mesh()), mesh_dim_names=("dg", "tg"))
    return HybridMeshes(train, gen, gen["tg"], train_tp)


def shard_training_model(model: nn.Module, mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None) -> nn.Module:
    """The training layout: tensor parallel over `tp_mesh` (tp.py's plan) when given, then FSDP2
    (`fully_shard` over `mesh`) per decoder layer and at the root, each parameter sharded on its TP
    dim. A PEFT-wrapped model (a LoRA actor) is sharded the same way, its adapters inside their
    decoder layers' units; tensor parallel does not take one (the plan names the plain model's modules)."""
    from torch.distributed.fsdp import fully_shard

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if tp_mesh is not None and tp_mesh.size() > 1:
        if inner is not model:
            raise NotImplementedError("tensor-parallel training of a LoRA (PEFT) actor: use colocated.t 1")
        tensor_parallelize(model, tp_mesh)
    placement = fsdp_shard_placement(model)
    for layer in inner.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model


class HybridEngine:
    """Switches one actor between its training layout and its TP generation layout.

    `shards` gives the actor's training shards in place through the learner-backend seam
    (`backend.local_shards(actor)`, or `fsdp.local_shards(model)`: a `LocalShard` per parameter,
    the model put back in its sharded state), laid out by
    `shard_training_model(model, meshes.train, meshes.train_tp)`; `gen_model` comes from
    `tp.parallelize_generation_model(config, meshes.tp)`. The constructor
    binds a generation buffer (storage released) or a view of the training shard to every
    parameter of `gen_model`; `to_generation()` fills the buffers, `release()` frees them. Both are
    collective: every rank calls them in step. `frozen(name)` is True for parameters that never
    change (a LoRA actor's base): the first `to_generation()` gathers them, `release()` keeps them,
    later reshards skip them."""

    def __init__(
        self,
        shards: Callable[[], Iterable[LocalShard]],
        gen_model: nn.Module,
        layout: HybridLayout,
        meshes: HybridMeshes,
        bucket_bytes: int = BUCKET_BYTES,
        transport: str = "auto",
        frozen: Callable[[str], bool] | None = None,
    ):
        import torch.distributed as dist

        _check_supported(layout)
        self.layout, self.meshes = layout, meshes
        self.shards, self.gen_model = shards, gen_model
        self.rank = dist.get_rank()
        if meshes.gen.mesh.tolist() != layout.gen_mesh():
            raise ValueError(
                f"meshes.gen {meshes.gen.mesh.tolist()} does not follow the layout's grouping "
                f"{layout.gen_mesh()}; build it with build_meshes"
            )
        # the micro-DP groups (generation blocks in micro-DP order j) and the FSDP groups (norm
        # blocks in FSDP order d_idx); `new_group` orders a group's ranks by global rank
        self.groups = {
            "micro": Group.of(meshes.gen.get_group("dg"), lambda r: layout.gen_coords(r).micro_dp),
            "fsdp": Group.of(meshes.train.get_group(), lambda r: layout.train_coords(r).d),
        }
        self._read_shards()
        shapes = [(name, tuple(s.global_shape)) for name, s in self._train.items()]
        self.slots = [self._bind(spec) for spec in specs_of(shapes, gen_model.config.num_hidden_layers)]
        if getattr(gen_model.config, "tie_word_embeddings", False):
            gen_model.lm_head.weight = gen_model.model.embed_tokens.weight
        self.training_bytes = sum(self._train[s.name].local.nbytes for s in self.slots)
        self.generation_bytes = sum(s.nbytes for s in self.slots)
        self.added_bytes = sum(s.nbytes for s in self.slots if not s.view)
        sizes = {name: group.size for name, group in self.groups.items()}
        gathered = [s for s in self.slots if not s.view]
        self.frozen = {s.name for s in gathered if frozen is not None and frozen(s.name)}
        self.in_place, self.buckets = plan_buckets(gathered, sizes, bucket_bytes)
        self.transport = _transport(transport, self.groups)
        self.peak_param_bytes = self.training_bytes  # of this engine's own accounting
        self._allocated = False
        self._frozen_filled = False  # the frozen parameters' buffers hold their values
        self._plan_staging()
        self.first = GatherPlan(self.in_place, self.buckets, self.units)
        self.later = self._later_plan(gathered, sizes, bucket_bytes) if self.frozen else self.first

    def _later_plan(self, gathered: list, sizes: dict[str, int], bucket_bytes: int) -> GatherPlan:
        """The reshards after the first: the unfrozen parameters alone, planned the same way."""
        plan = GatherPlan(*plan_buckets([s for s in gathered if s.name not in self.frozen], sizes,
                                        bucket_bytes), [])  # fmt: skip
        if self.transport == "coalesced":
            self.allocate()
            plan.units = coalesced_units([[s] for s in plan.in_place] + [b.slots for b in plan.buckets],
                                         self.groups)  # fmt: skip
            self.release()
        return plan

    def _plan_staging(self) -> None:
        """The transport's units and the staging memory it holds at most (`staging_bytes`)."""
        if self.transport == "coalesced":
            # one allgather_coalesced per bucket and per large parameter; gloo's flat input and
            # output of at most MAX_STAGING calls are alive at once (inside gloo)
            self.allocate()
            self.units = coalesced_units([[s] for s in self.in_place] + [b.slots for b in self.buckets],
                                         self.groups)  # fmt: skip
            self.release()
            temps = sorted((u.temp_bytes for u in self.units), reverse=True)
            self.bucket_staging_bytes = self.reorder_bytes = 0
            self.staging_bytes = sum(temps[:MAX_STAGING])
            return
        self.units = []
        stagings = sorted((self.groups[b.group].size * b.numel * b.slots[0].buffer.element_size()
                           for b in self.buckets), reverse=True)  # fmt: skip
        # a group whose rank order is not its block order (tg < t) reorders an in-place buffer
        # through a one-block temporary
        blocks = [
            s.nbytes // self.groups[s.group].size for s in self.in_place if self.groups[s.group].permuted
        ]
        self.bucket_staging_bytes = sum(stagings[:MAX_STAGING])
        self.reorder_bytes = max(blocks, default=0)
        self.staging_bytes = max(self.bucket_staging_bytes, self.reorder_bytes)  # never both alive

    # public --------------------------------------------------------------------------------
    def to_generation(self, probe: Callable[[], None] | None = None) -> ReshardStats:
        """Fill the generation buffers from the current training shards (the frozen parameters'
        at the first call only). `probe`, if given, is called after each collective is issued and
        each bucket copied out (tests measure live memory there)."""
        import torch

        self._read_shards()
        plan = self.later if self._frozen_filled else self.first
        start = time.perf_counter()
        with torch.no_grad():
            self._refresh_views()
            self.allocate()
            if self.transport == "coalesced":
                collectives = self._gather_coalesced(plan, probe)
            else:
                collectives = self._gather_staged(plan, probe)
        self._allocated = True
        self._frozen_filled = bool(self.frozen)
        self.peak_param_bytes = max(
            self.peak_param_bytes, self.training_bytes + self.added_bytes + self.staging_bytes
        )
        slots = plan.slots()
        return ReshardStats(time.perf_counter() - start, collectives, self.generation_bytes,
                            gathered_bytes=sum(s.nbytes for s in slots),
                            frozen_bytes=sum(s.nbytes for s in slots if s.name in self.frozen))  # fmt: skip

    def _gather_coalesced(self, plan: GatherPlan, probe: Callable[[], None] | None) -> int:
        """gloo: each unit in one call, at most MAX_STAGING in flight."""
        inflight: deque = deque()
        for unit in plan.units:
            inflight.append(all_gather_coalesced(unit, [self._block(slot) for slot in unit.slots]))
            if probe is not None:
                probe()
            if len(inflight) == MAX_STAGING:
                inflight.popleft().wait()
        while inflight:
            inflight.popleft().wait()
        return len(plan.units)

    def _gather_staged(self, plan: GatherPlan, probe: Callable[[], None] | None) -> int:
        """Any backend: large parameters in place, small ones in buckets through a staging buffer."""
        import torch

        collectives, pending = 0, []
        # large parameters: in place in their own buffers, issued async and waited for
        # together (no Python round trip between collectives, nothing extra held)
        for slot in plan.in_place:
            group = self.groups[slot.group]
            local = self._block(slot)
            own = slot.buffer.narrow(0, group.index * local.shape[0], local.shape[0])
            own.copy_(local)
            work = all_gather_single(slot.buffer, own, group=group.pg, async_op=True)
            pending.append((slot, group, work))
            collectives += 1
            if probe is not None:
                probe()
        inflight: deque = deque()
        for bucket in plan.buckets:
            group = self.groups[bucket.group]
            first = bucket.slots[0].buffer
            staging = torch.empty(group.size * bucket.numel, dtype=first.dtype, device=first.device)
            own = staging.narrow(0, group.index * bucket.numel, bucket.numel)
            for slot, offset in zip(bucket.slots, bucket.offsets, strict=True):
                local = self._block(slot)
                own.narrow(0, offset, local.numel()).view(local.shape).copy_(local)
            work = all_gather_single(staging, own, group=group.pg, async_op=True)
            inflight.append((bucket, staging, work, group))
            del staging, own, work
            collectives += 1
            if probe is not None:
                probe()
            if len(inflight) == MAX_STAGING:
                unpack(*inflight.popleft())
                if probe is not None:
                    probe()
        while inflight:
            unpack(*inflight.popleft())
        for slot, group, work in pending:
            work.wait()
            if group.permuted:
                reorder(slot.buffer, group.order)
                if probe is not None:
                    probe()
        return collectives

    def _refresh_views(self) -> None:
        """A gather over one rank binds the training block itself; where the backend's block is a
        re-arranged copy (Megatron's q/k/v with several key/value groups per TP rank) rather than
        the parameter in place, the bound copy is refreshed from the current one."""
        for slot in self.slots:
            local = self._train[slot.name].local
            if slot.view and local.data_ptr() != slot.buffer.data_ptr():
                slot.buffer.copy_(local)

    def allocate(self) -> None:
        """Give every generation buffer its storage again (contents undefined until filled)."""
        for slot in self.slots:
            if not slot.view:
                _alloc(slot)

    def release(self) -> None:
        """Free the generation buffers (the training shards, the views of them and the filled
        buffers of frozen parameters stay)."""
        for slot in self.slots:
            if not slot.view and not (self._frozen_filled and slot.name in self.frozen):
                slot.buffer.untyped_storage().resize_(0)
        self._allocated = False

    @property
    def allocated(self) -> bool:
        return self._allocated

    # internals -----------------------------------------------------------------------------
    def _block(self, slot: GenSlot) -> torch.Tensor:
        """This rank's training block of `slot`, in the buffer's orientation."""
        local = self._train[slot.name].local
        return local.t() if slot.kind == "row" else local

    def _read_shards(self) -> None:
        """The training shards as they are now, by name (the backend puts the model back in its
        sharded state first: a forward that kept full parameters registered leaves none behind)."""
        self._train: dict[str, LocalShard] = {s.name: s for s in self.shards()}

    def _bind(self, spec) -> GenSlot:
        import torch
        from torch import nn
        from torch.distributed.tensor import DTensor, Replicate, Shard

        name = spec.name
        shard = self._train[name]
        if not shard.placements:
            raise TypeError(f"{name}: the training model is not sharded by FSDP2 (shard_training_model)")
        dim = tp_dim(name)
        local = shard.local
        want = tuple(b - a for a, b in self.layout.train_box(self.rank, spec))
        # FSDP shards every parameter on its TP dim (a norm on dim 0); Megatron's TP only the TP ones
        want_dim = (dim or 0) if self.layout.train.fsdp else dim
        if getattr(shard.placements[0], "dim", None) != want_dim or tuple(local.shape) != want:
            raise ValueError(
                f"{name}: training placement {shard.placements}, local shape {tuple(local.shape)}; the "
                f"layout wants it sharded on dim {want_dim} and a local block of {want} (shard_training_model)"
            )
        box = self.layout.gen_box(self.rank, spec)
        shape = tuple(b - a for a, b in box)
        kind = "rep" if dim is None else ("row" if dim == 1 else "col")
        group = "fsdp" if kind == "rep" else "micro"
        view = self.groups[group].size == 1
        if view:  # the generation shard is this rank's training block: bind it, copy nothing
            buffer = local.detach()
        else:
            buffer = torch.empty(
                shape[::-1] if kind == "row" else shape, dtype=local.dtype, device=local.device
            )
        value = buffer.t() if kind == "row" and not view else buffer
        module, leaf = _owner(self.gen_model, name)
        # replicated parameters (norms) sit in modules the plan leaves alone, and at tg = 1 the
        # generation model is not parallelized: plain tensors
        if kind != "rep" and self.meshes.tp.size() > 1:
            value = DTensor.from_local(value, self.meshes.tp, [Shard(dim) if dim is not None else Replicate()],
                                       run_check=False)  # fmt: skip
        setattr(module, leaf, nn.Parameter(value, requires_grad=False))
        nbytes = box_numel(box) * buffer.element_size()
        if not view:
            buffer.untyped_storage().resize_(0)
        return GenSlot(name, kind, buffer, nbytes, box, view, group)


def _transport(transport: str, groups: dict[str, Group]) -> str:
    """`auto`: gloo's coalesced all-gather when every gather group is gloo, else staging."""
    import torch.distributed as dist

    if transport == "auto":
        gloo = all(dist.get_backend(g.pg) == "gloo" for g in groups.values())
        transport = "coalesced" if gloo else "staging"
    if transport not in ("coalesced", "staging"):
        raise ValueError(f"transport={transport!r}: 'auto', 'coalesced' (gloo) or 'staging'")
    return transport


def _alloc(slot: GenSlot) -> None:
    storage = slot.buffer.untyped_storage()
    if storage.nbytes() != slot.nbytes:
        storage.resize_(slot.nbytes)


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def _check_supported(layout: HybridLayout) -> None:
    tr, ge = layout.train, layout.gen
    megatron_tp = not tr.fsdp and tr.d == 1  # Megatron TP over every rank, one replica
    if tr.p != 1 or ge.pg != 1 or not (tr.fsdp or megatron_tp):
        raise NotImplementedError(
            f"the reshard runs FSDP2 (+ TP) training layouts and Megatron TP over every rank (d = 1), "
            f"p = 1, to pg = 1 generation layouts; got {tr} -> {ge} (the rank maps in layout.py cover "
            "the others: pipeline stages and replicated data parallel are not resharded here)"
        )
    if tr.t > 1 and ge.tg > tr.t:
        raise NotImplementedError(
            f"generation tg={ge.tg} above the training t={tr.t}: the generation TP groups would be "
            "strided across the (dp, tp) training mesh out of rank order, and torch orders a process "
            "group's ranks by global rank, so the lm_head's logits all-gather would come out permuted; "
            f"use tg <= t ({tr.t}), or t = 1"
        )
    if tr.t > 1 and tr.t % ge.tg:
        raise NotImplementedError(
            f"generation tg={ge.tg} does not divide the training t={tr.t}: a generation TP group would "
            "then hold its shards out of rank order (the same permuted logits gather as tg > t); use a "
            f"tg that divides t ({tr.t})"
        )
