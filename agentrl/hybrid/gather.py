"""The collectives of the HybridEngine reshard (reshard.py): a parameter's generation slot, the bucket plan, a bucket's copy-out
from its staging buffer, the reorder of blocks a group gathered out of layout order, the
all-gather itself, and an outside view of live tensor memory for the tests and the bench."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class GenSlot:
    """One parameter's generation buffer and where it comes from."""

    name: str
    kind: str  # "col" (Shard(0)), "row" (Shard(1), stored transposed unless a view) or "rep"
    buffer: torch.Tensor  # owns the storage (for "row" the module weight's transpose), or a view
    nbytes: int  # bytes of the generation shard
    box: tuple[tuple[int, int], ...]  # the slice of the full parameter it holds (layout.gen_box)
    view: bool = False  # the training shard itself (a gather over one rank): nothing to fill or free
    group: str = "micro"  # gathered over the micro-DP group, or "fsdp" (the norms)


@dataclass
class Bucket:
    """Small parameters gathered by one all-gather over one group, through a staging buffer."""

    group: str
    slots: list[GenSlot] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # of each slot's block in one rank's part
    numel: int = 0  # one rank's part


@dataclass
class Group:
    """A gather group: `order[q]` is the layout's block index of the group's rank q."""

    pg: object
    index: int  # this rank's group rank
    order: list[int]

    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def permuted(self) -> bool:
        return self.order != list(range(self.size))

    @classmethod
    def of(cls, pg, block_of: Callable[[int], int]) -> Group:
        import torch.distributed as dist

        ranks = dist.get_process_group_ranks(pg)
        order = [block_of(r) for r in ranks]
        if sorted(order) != list(range(len(order))):
            raise ValueError(f"group {ranks}: blocks {order} are not 0..{len(order) - 1}")
        return cls(pg, ranks.index(dist.get_rank()), order)


def plan_buckets(
    slots: list[GenSlot], sizes: dict[str, int], bucket_bytes: int
) -> tuple[list[GenSlot], list[Bucket]]:
    """The slots gathered in place (generation shard over `bucket_bytes`) and buckets of the
    others, filled in order per group and dtype, each at most `bucket_bytes` gathered."""
    in_place, buckets, open_ = [], [], {}
    for slot in slots:
        if slot.nbytes > bucket_bytes:
            in_place.append(slot)
            continue
        size, itemsize = sizes[slot.group], slot.buffer.element_size()
        part = slot.nbytes // itemsize // size  # this rank's block
        key = (slot.group, slot.buffer.dtype)
        bucket = open_.get(key)
        if bucket is None or (bucket.numel + part) * size * itemsize > bucket_bytes:
            bucket = open_[key] = Bucket(slot.group)
            buckets.append(bucket)
        bucket.slots.append(slot)
        bucket.offsets.append(bucket.numel)
        bucket.numel += part
    return in_place, buckets


def unpack(bucket: Bucket, staging: torch.Tensor, work, group: Group) -> None:
    """Wait for a bucket's all-gather and copy each rank's blocks into the generation buffers
    (group rank q's part holds block `group.order[q]`)."""
    work.wait()
    parts = staging.view(group.size, bucket.numel)
    for slot, offset in zip(bucket.slots, bucket.offsets, strict=True):
        numel = slot.nbytes // slot.buffer.element_size() // group.size
        dest = slot.buffer.view(group.size, numel)
        if not group.permuted:
            dest.copy_(parts.narrow(1, offset, numel))
            continue
        for q, block in enumerate(group.order):
            dest[block].copy_(parts[q].narrow(0, offset, numel))


def reorder(buffer: torch.Tensor, order: list[int]) -> None:
    """Blocks (dim 0) in group-rank order -> blocks in layout order: block q holds the data of
    block `order[q]`. Moves each cycle of the permutation through one block's temporary."""
    n = len(order)
    rows = buffer.shape[0] // n
    source = {dest: q for q, dest in enumerate(order)}  # where block `dest`'s data is now
    done = [False] * n
    for start in range(n):
        if done[start] or source[start] == start:
            done[start] = True
            continue
        temp = buffer.narrow(0, start * rows, rows).clone()
        p = start
        while source[p] != start:
            buffer.narrow(0, p * rows, rows).copy_(buffer.narrow(0, source[p] * rows, rows))
            done[p] = True
            p = source[p]
        buffer.narrow(0, p * rows, rows).copy_(temp)
        done[p] = True
        del temp


@dataclass
class Unit:
    """One `allgather_coalesced` call (gloo): a bucket's slots, or one large slot alone. gloo packs
    the inputs into one flat tensor, gathers into a flat output and copies each rank's part into
    `outputs[q]` (C++; ProcessGroupGloo's AsyncAllgatherCoalescedWork), so the generation buffers
    are filled with no staging or copy-out in Python, blocks in layout order included."""

    group: Group
    slots: list[GenSlot]
    outputs: list[list[torch.Tensor]]  # [group rank q][slot]: the view of block order[q] of its buffer
    temp_bytes: int  # gloo's flat input and flat output while the call runs


def coalesced_units(slot_lists: list[list[GenSlot]], groups: dict[str, Group]) -> list[Unit]:
    """The units of `slot_lists`; the slots' buffers must be allocated (a view cannot be taken of
    a released storage; the views stay valid across release and allocate, which resize it)."""
    units = []
    for slots in slot_lists:
        group = groups[slots[0].group]
        outputs: list[list] = [[] for _ in range(group.size)]
        for slot in slots:
            rows = slot.buffer.shape[0] // group.size
            for q, block in enumerate(group.order):
                outputs[q].append(slot.buffer.narrow(0, block * rows, rows))
        gathered = sum(slot.nbytes for slot in slots)
        # gloo flattens the inputs into a copy, except one contiguous input (a column-wise block;
        # a row-wise block is the transposed view of the training shard)
        packed = len(slots) > 1 or slots[0].kind == "row"
        units.append(Unit(group, slots, outputs, gathered + (gathered // group.size if packed else 0)))
    return units


def all_gather_coalesced(unit: Unit, inputs: list[torch.Tensor]):
    """Start `unit`'s gather of this rank's `inputs` (one per slot, shaped like a block); returns
    the work. `ProcessGroup.allgather_coalesced`, the call under `dist.all_gather_coalesced`
    (whose Python wrapper torch 2.13 marks as to be deprecated)."""
    from torch._C._distributed_c10d import AllgatherOptions

    opts = AllgatherOptions()
    opts.asyncOp = True
    return unit.group.pg.allgather_coalesced(unit.outputs, inputs, opts)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """`dist.all_gather_single` (torch 2.13's name for `all_gather_into_tensor`, the deprecated
    alias), or the older name on older torch: one allgather_base collective."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


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
