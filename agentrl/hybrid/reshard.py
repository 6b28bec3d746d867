"""The HybridEngine reshard: the actor's FSDP2 training shards become the generation layout's
tensor-parallel shards in preallocated buffers, with one all-gather per parameter inside each
micro-DP group, and the buffers are released again before training.

Layouts and rank maps are in layout.py, the TP plan in tp.py. The training layout supported
here is FSDP2 over all `S` ranks (`p = t = 1`, `d = S`); the generation layout is `tg`-way TP
with `dg = S/tg` micro-DP replicas, on a DeviceMesh ("dg", "tg") built from `layout.gen_mesh()`.

Per parameter (FSDP shards it on its TP dim, tp.fsdp_shard_placement):

- column-wise and vocab-parallel (`Shard(0)` in both layouts): rank `r`'s FSDP chunk is chunk
  `j` of its generation chunk `g` (r = g·dg + j). It copies its chunk into slot `j` of the
  generation buffer and runs `all_gather_into_tensor` in place over its micro-DP group.
- row-wise (`Shard(1)` in both layouts, FSDP's `shard_placement_fn` picks dim 1): the generation
  buffer is stored transposed, `(in/tg, out)`, and the module's weight is its `.t()` view, so the
  gathered column blocks are contiguous rows and the same in-place all-gather applies. (With
  FSDP's default `Shard(0)` a row-wise target needs data from every rank: two gathers across
  groups; sharding on the TP dim removes them.)
- replicated (RMSNorms): one in-place all-gather over the whole shard group (a few KB).

No staging buffer is allocated: peak parameter bytes per rank are the training shard plus the
generation shard. `release()` frees the generation storages (`untyped_storage().resize_(0)`);
the generation model keeps its parameter objects, so an engine built on it stays valid and the
next `to_generation()` refills the same tensors.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrl.hybrid.layout import HybridLayout, box_numel
from agentrl.hybrid.tp import fsdp_shard_placement, param_specs, tp_dim

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class HybridMeshes:
    """`train`: 1D FSDP mesh over the S ranks; `gen`: ("dg", "tg") mesh; `tp`: this rank's TP submesh."""

    train: DeviceMesh
    gen: DeviceMesh
    tp: DeviceMesh


@dataclass
class GenSlot:
    """One parameter's generation buffer and where it comes from."""

    name: str
    kind: str  # "col" (Shard(0)), "row" (Shard(1), stored transposed) or "rep"
    buffer: torch.Tensor  # owns the storage; for "row" the transpose of the module's weight
    nbytes: int
    box: tuple[tuple[int, int], ...]  # the slice of the full parameter it holds (layout.gen_box)


@dataclass
class ReshardStats:
    seconds: float
    collectives: int
    bytes_out: int  # bytes this rank's buffers received, its own chunk included


def build_meshes(layout: HybridLayout, device_type: str = "cpu") -> HybridMeshes:
    """Both meshes; every rank must call this (each mesh dim creates process groups)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    _check_supported(layout)
    train = init_device_mesh(device_type, (layout.world_size,), mesh_dim_names=("fsdp",))
    gen = DeviceMesh(device_type, torch.tensor(layout.gen_mesh()), mesh_dim_names=("dg", "tg"))
    return HybridMeshes(train, gen, gen["tg"])


def shard_training_model(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """FSDP2 (`fully_shard`) per decoder layer and at the root, each parameter sharded on its TP dim."""
    from torch.distributed.fsdp import fully_shard

    placement = fsdp_shard_placement(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    return model


class HybridEngine:
    """Switches one actor between its FSDP2 training layout and its TP generation layout.

    `train_model` is sharded by `shard_training_model` on `meshes.train`; `gen_model` comes from
    `tp.parallelize_generation_model(config, meshes.tp)`. The constructor binds a generation buffer
    (storage released) to every parameter of `gen_model`; `to_generation()` fills them, `release()`
    frees them. Both are collective: every rank calls them in step."""

    def __init__(
        self, train_model: nn.Module, gen_model: nn.Module, layout: HybridLayout, meshes: HybridMeshes
    ):
        import torch.distributed as dist

        _check_supported(layout)
        self.layout, self.meshes = layout, meshes
        self.train_model, self.gen_model = train_model, gen_model
        self.rank = dist.get_rank()
        coords = layout.gen_coords(self.rank)
        if meshes.gen.get_local_rank("dg") != coords.micro_dp or meshes.gen.get_local_rank("tg") != coords.tp:
            raise ValueError("meshes.gen does not follow the layout's grouping; build it with build_meshes")
        self.micro_dp_index = coords.micro_dp
        self.shard_index = layout.train_coords(self.rank).shard
        self.micro_group = meshes.gen.get_group("dg")
        self.shard_group = meshes.train.get_group()
        self.slots: list[GenSlot] = []
        self._reshard_training()
        specs = {s.name: s for s in param_specs(train_model)}
        for name, spec in specs.items():
            self.slots.append(self._bind(name, layout.gen_box(self.rank, spec)))
        if getattr(gen_model.config, "tie_word_embeddings", False):
            gen_model.lm_head.weight = gen_model.model.embed_tokens.weight
        self.training_bytes = sum(_local(self._train_param(s.name)).nbytes for s in self.slots)
        self.generation_bytes = sum(s.nbytes for s in self.slots)
        self.peak_param_bytes = self.training_bytes  # of this engine's own accounting
        self._allocated = False

    # public --------------------------------------------------------------------------------
    def to_generation(self, probe: Callable[[], None] | None = None) -> ReshardStats:
        """Fill the generation buffers from the current training shards. `probe`, if given, is
        called after each parameter (tests measure live memory there)."""
        import torch

        self._reshard_training()
        start = time.perf_counter()
        collectives, pending = 0, []
        with torch.no_grad():
            for slot in self.slots:
                _alloc(slot)
                local = _local(self._train_param(slot.name))
                if slot.kind == "rep":
                    index, group, size = self.shard_index, self.shard_group, self.layout.world_size
                else:
                    index, group, size = self.micro_dp_index, self.micro_group, self.layout.gen.dg
                    if slot.kind == "row":
                        local = local.t()
                own = slot.buffer.narrow(0, index * local.shape[0], local.shape[0])
                own.copy_(local)
                if size > 1:
                    # issued async and waited for together: no Python round trip between
                    # collectives; every one writes its own buffer, so nothing extra is held
                    pending.append(all_gather_single(slot.buffer, own, group=group, async_op=True))
                    collectives += 1
                if probe is not None:
                    probe()
            for work in pending:
                work.wait()
        self._allocated = True
        self.peak_param_bytes = max(self.peak_param_bytes, self.training_bytes + self.generation_bytes)
        return ReshardStats(time.perf_counter() - start, collectives, self.generation_bytes)

    def allocate(self) -> None:
        """Give every generation buffer its storage again (contents undefined until filled)."""
        for slot in self.slots:
            _alloc(slot)

    def release(self) -> None:
        """Free the generation buffers (the training shards stay); the model keeps its tensors."""
        for slot in self.slots:
            slot.buffer.untyped_storage().resize_(0)
        self._allocated = False

    @property
    def allocated(self) -> bool:
        return self._allocated

    # internals -----------------------------------------------------------------------------
    def _train_param(self, name: str) -> nn.Parameter:
        module, leaf = _owner(self.train_model, name)
        return getattr(module, leaf)

    def _reshard_training(self) -> None:
        """Put FSDP2 back in its sharded state (a forward with reshard_after_forward=False leaves
        the full parameters registered), so the parameters read below are the shards."""
        from torch.distributed.fsdp import FSDPModule

        for module in self.train_model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def _bind(self, name: str, box) -> GenSlot:
        import torch
        from torch import nn
        from torch.distributed.tensor import DTensor, Replicate, Shard

        train_param = self._train_param(name)
        if not isinstance(train_param, DTensor):
            raise TypeError(f"{name}: the training model is not sharded by FSDP2 (shard_training_model)")
        dim = tp_dim(name)
        placement = Replicate() if dim is None else Shard(dim)
        if train_param.placements != (Shard(dim or 0),):
            raise ValueError(f"{name}: FSDP placement {train_param.placements}; want Shard({dim or 0})")
        shape = tuple(b - a for a, b in box)
        kind = "rep" if dim is None else ("row" if dim == 1 else "col")
        buffer = torch.empty(
            shape[::-1] if kind == "row" else shape,
            dtype=train_param.dtype,
            device=_local(train_param).device,
        )
        view = buffer.t() if kind == "row" else buffer
        module, leaf = _owner(self.gen_model, name)
        # replicated parameters (norms) sit in modules the plan leaves alone: plain tensors
        value = (
            view if kind == "rep" else DTensor.from_local(view, self.meshes.tp, [placement], run_check=False)
        )
        setattr(module, leaf, nn.Parameter(value, requires_grad=False))
        nbytes = box_numel(box) * buffer.element_size()
        buffer.untyped_storage().resize_(0)
        return GenSlot(name, kind, buffer, nbytes, box)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`dist.all_gather_single` (torch 2.13's name for `all_gather_into_tensor`, the deprecated
    alias), or the older name on older torch: one allgather_base collective."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def _alloc(slot: GenSlot) -> None:
    storage = slot.buffer.untyped_storage()
    if storage.nbytes() != slot.nbytes:
        storage.resize_(slot.nbytes)


def _local(param) -> torch.Tensor:
    return param.to_local() if hasattr(param, "to_local") else param


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def _check_supported(layout: HybridLayout) -> None:
    tr, ge = layout.train, layout.gen
    if not tr.fsdp or tr.p != 1 or tr.t != 1 or ge.pg != 1:
        raise NotImplementedError(
            f"the reshard runs FSDP2 training layouts (p = t = 1, fsdp) to pg = 1 generation layouts; got "
            f"{tr} -> {ge} (the rank maps in layout.py cover the others)"
        )


def live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every live tensor the garbage collector can see (DTensors
    counted by their local tensor): an outside view of memory, independent of the engine's own
    accounting."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    is_tensor: dict[type, bool] = {}
    for obj in gc.get_objects():
        kind = type(obj)
        hit = is_tensor.get(kind)
        if hit is None:
            hit = is_tensor[kind] = issubclass(kind, torch.Tensor)
        if not hit or obj.is_meta:
            continue
        t = obj._local_tensor if isinstance(obj, DTensor) else obj
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())
