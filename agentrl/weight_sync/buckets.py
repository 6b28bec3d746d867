"""How the broadcast engine streams a push: tensors packed into buckets, gathered on a thread at
most one bucket ahead of the broadcast, each phase of the push timed into `PushStats.phases`, and
rank 0's decisions shared with the other learner ranks (which repeat the gathers in step).

The gather (`weights()`, layer by layer from FSDP2) and the packing of each bucket into one flat
buffer (`Packer`; a view where the tensors already lie back to back: `adjacent`) run on their own
thread (`prefetch`), so bucket i+1 is gathered and packed while bucket i is broadcast; extra
memory is about three buckets (on CPU, the packing buffers, kept from push to push). Buckets of
the learner's own weights sent as they lie (a `Resident` source, laid out back to back) hold no
memory, and the gather runs ahead through all of them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from agentrl.weight_sync.base import PushStats


@dataclass
class Bucket:
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    last: bool = False
    """The last bucket of the stream (known at no cost: the tensors ran out)."""
    flat: torch.Tensor | None = None
    """The bucket packed as one uint8 tensor (packed on the gather thread), when it travels as one."""
    flattened: bool = False
    """It travels as one uint8 tensor (decided when gathered, before it is packed)."""
    index: int | None = None
    """Its place in the push, for servers that receive buckets in index order."""
    futures: dict | None = None
    """The members' replies to its announcement, when it was announced from the gather thread."""
    announced: float = 0.0
    sent: bool = False
    covered: bool = False
    """Announced with later buckets in one request whose reply, awaited at the last of them,
    covers it (`bucket_batches`)."""
    copied: bool = False
    """A tensor of it was copied to make it contiguous."""
    held: bool = True
    """It holds memory of its own (gathered copies, a packing buffer), which bounds how far the
    gather runs ahead; False for the learner's own weights sent as they lie (`Resident`)."""


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors into buckets of about `bucket_bytes`; a larger tensor travels alone."""
    bucket = Bucket()
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if bucket.tensors and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket()
        bucket.names.append(name)
        bucket.tensors.append(whole := tensor.contiguous())
        bucket.copied |= whole is not tensor
        bucket.nbytes += size
    if bucket.tensors:
        bucket.last = True
        yield bucket


class Packer:
    """Packs a bucket's tensors into one flat uint8 tensor. On CPU it packs into `slots` buffers
    taken round robin and kept from push to push (grown to the largest bucket), so a push does not
    map and fault in fresh memory for every bucket; slot k is written again only for bucket k +
    `slots`, and with the gather thread one bucket ahead (`prefetch`) at most three buckets are in
    use at once: the one broadcast, the one queued, the one packed. On a GPU, where the caching
    allocator already reuses memory, each bucket is a fresh `torch.cat`."""

    def __init__(self, slots: int = 3) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.packed = 0
        self.viewed = 0
        """Buckets handed out as views of tensors already back to back (no copy)."""
        self.largest = 0

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """`tensors` back to back as one uint8 tensor: a view, without a copy, where they already
        lie back to back in one storage (a learner that keeps its weights in the push's buckets:
        `learner.fsdp.home_for_push`); else packed into a buffer."""
        if (whole := adjacent(tensors)) is not None:
            self.viewed += 1
            return whole
        parts = [t.reshape(-1).view(torch.uint8) for t in tensors]
        if parts[0].device.type != "cpu":
            return torch.cat(parts)
        nbytes = sum(p.numel() for p in parts)
        slot = self.packed % len(self.buffers)
        self.packed += 1
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() < nbytes:  # sized for the largest bucket yet: grows rarely
            self.largest = max(self.largest, nbytes)
            buffer = self.buffers[slot] = torch.empty(self.largest, dtype=torch.uint8)
        # one thread: a copy gains little from a second one, and an OpenMP team waits for its
        # slowest member: with the other cores busy (gloo's threads, a server on the same host)
        # packing a 5 MB adapter took 5.6-10 ms instead of 1.4 (base100m, 2 cores). The setting
        # is the calling thread's own (OpenMP's per-thread ICV): the learner's threads keep theirs.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return torch.cat(parts, out=buffer[:nbytes])
        finally:
            torch.set_num_threads(threads)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)


def flat_layout(tensors: list[torch.Tensor]) -> bool:
    """A bucket of `tensors` can travel as one uint8 tensor in `FlattenedTensorBucket` layout
    (SGLang 0.5.23 `srt/weight_sync/tensor_bucket.py`): two tensors or more, each starting at an
    offset its dtype divides (SGLang's `FlattenedTensorBucket.empty` refuses others); a one-tensor
    bucket travels as it is."""
    if len(tensors) < 2:
        return False
    offset = 0
    for tensor in tensors:
        if offset % tensor.element_size():
            return False
        offset += tensor.numel() * tensor.element_size()
    return True


def adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of `tensors` as one uint8 view, if they are contiguous and lie back to back, in
    order, in one storage; else None."""
    first = tensors[0]
    storage = first.untyped_storage()
    start = end = first.storage_offset() * first.element_size()
    for tensor in tensors:
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.storage_offset() * tensor.element_size() != end
        ):
            return None
        end += tensor.numel() * tensor.element_size()
    whole = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
    return whole[start:end]


def prefetch(buckets: Iterator[Bucket] | Callable[[], Iterator[Bucket]], depth: int = 1) -> Iterator[Bucket]:
    """Run `buckets` (or the iterator `buckets()` returns, made on the thread too) on a thread, at
    most `depth` buckets that hold memory of their own (`Bucket.held`) ahead of the consumer; the
    others (the learner's own weights, sent as they lie) run ahead freely, so all of a resident
    push is gathered and announced before its first broadcast ends."""
    box: queue.Queue = queue.Queue()
    slots = threading.Semaphore(depth)
    done = object()

    def produce() -> None:
        try:
            for bucket in buckets() if callable(buckets) else buckets:
                if bucket.held:
                    slots.acquire()
                box.put(bucket)
        except BaseException as exc:  # surface gather errors in the consumer
            box.put(exc)
        box.put(done)

    def consume() -> Iterator[Bucket]:
        while (item := box.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            if item.held:
                slots.release()
            yield item
        thread.join()

    thread = threading.Thread(target=produce, name="weight-sync-gather", daemon=True)
    thread.start()  # now, not at the first bucket asked for: the gather starts before it is awaited
    return consume()


def timed_iter(items: Iterator[Bucket], stats: PushStats | None, phase: str) -> Iterator[Bucket]:
    """`items`, adding the time spent waiting for each to `stats.phases[phase]` (when stats)."""
    while True:
        start = time.perf_counter()
        item = next(items, None)
        if stats is not None:
            stats.add_phase(phase, time.perf_counter() - start)
        if item is None:
            return
        yield item


class Phase:
    """Adds the seconds of a `with` block to `stats.phases[name]` (nothing when stats is None)."""

    def __init__(self, stats: PushStats | None, name: str) -> None:
        self.stats, self.name = stats, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.stats is not None:
            self.stats.add_phase(self.name, time.perf_counter() - self.start)


def agree(value: bool) -> bool:
    """Rank 0's decision, shared with every learner rank (no-op without a training group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    flag = torch.tensor([int(value)])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.broadcast(flag, 0)
    return bool(flag.item())
