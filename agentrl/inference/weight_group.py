"""The side process group that carries a weight push from the trainer to inference servers.

Both ends of a broadcast weight update use this module: the learner (rank 0, which hosts
the rendezvous store) and every inference worker (ranks `rank_offset …`, as SGLang numbers
them: engine i of a fleet with g GPUs per engine gets `rank_offset = 1 + i × g`). The group
is built directly on a `TCPStore` (hosted by rank 0), so independently started processes
can broadcast to each other without touching (or needing) the default `torch.distributed`
process group. The store keys are laid out as SGLang's `init_custom_process_group` lays them
out (`PrefixStore(group_name)`, then torch's `_new_process_group_helper` prefixes
`"{group_name}/"` and `"{device}/"`), so a trainer using this module can also be rank 0 for
real SGLang engines; no collective is issued at set-up, as SGLang issues none. For "gloo",
torch's `_new_process_group_helper` (called by SGLang 0.5.23's `init_custom_process_group`,
`srt/utils/common.py`) maps both devices gloo serves (cpu, cuda) to one backend, builds one
`ProcessGroupGloo` under the `cpu/` prefix and registers it for both: so this one group also
reaches a GPU SGLang that receives into CUDA tensors (checked against torch's helper in
tests/unit/weight_sync/test_standin_push.py). Every step has
a timeout that fails loudly instead of hanging: set-up and each collective.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch

from agentrl.log import get_logger

logger = get_logger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def parse_dtype(name: str) -> torch.dtype:
    """`"bfloat16"` or `"torch.bfloat16"` → `torch.bfloat16`; ValueError names the accepted spellings."""
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of: {', '.join(sorted(_DTYPES))}")
    return _DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → `"bfloat16"` (the spelling SGLang's `dtypes` field uses)."""
    return str(dtype).removeprefix("torch.")


def unflatten(
    flat: torch.Tensor, specs: list[tuple[str, torch.dtype, tuple[int, ...] | torch.Size]]
) -> dict[str, torch.Tensor]:
    """The tensors of a flattened bucket (`specs`: name, dtype, shape, back to back in `flat`, a
    uint8 tensor in SGLang's `FlattenedTensorBucket` layout), each a view of `flat`."""
    tensors, offset = {}, 0
    for name, dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        tensors[name] = flat[offset : offset + size].view(dtype).reshape(shape)
        offset += size
    return tensors


@dataclass
class WeightGroup:
    """One member's handle on a weight-update group."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    timeout_s: float
    _pg: object
    _store: object

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast `tensor` in place from rank `src` (send on src, receive elsewhere); waits with timeout."""
        self.wait(self.post(tensor, src))
        return tensor

    def post(self, tensor: torch.Tensor, src: int = 0) -> Any:
        """Queue the broadcast of `tensor` from rank `src` and return at once: the backend's work
        handle, for `wait`. Collectives run in the order they are posted, from any thread."""
        return self._pg.broadcast(tensor, src, datetime.timedelta(seconds=self.timeout_s))

    def wait(self, work: Any) -> None:
        """Wait for a posted collective, bounded by the group's timeout."""
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(
                f"weight group {self.group_name!r}: broadcast timed out after {self.timeout_s}s"
            )

    def barrier(self) -> None:
        """All ranks meet; a one-element broadcast keeps it backend-agnostic."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        self.broadcast(torch.zeros(1, device=device))

    def close(self) -> None:
        """Drop the group (gloo/nccl resources are released when the objects go)."""
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown) and self.backend == "nccl":
            try:
                shutdown()
            except Exception as exc:  # best effort: the group is being discarded anyway
                logger.warning("weight group %s: shutdown failed: %s", self.group_name, exc)
        self._pg = None
        self._store = None


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> WeightGroup:
    """Join (rank 0: host) a weight-update group; blocks until all `world_size` ranks joined.

    `backend` is "gloo" (CPU tensors) or "nccl" (CUDA tensors). Raises TimeoutError / RuntimeError
    when the other ranks do not show up within `timeout_s`."""
    from torch.distributed import PrefixStore, TCPStore

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=(rank == 0),
        timeout=timeout,
        wait_for_workers=False,
    )
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
    device = "cpu" if backend == "gloo" else "cuda"
    prefixed = PrefixStore(f"{device}/", PrefixStore(f"{group_name}/", PrefixStore(group_name, store)))
    if backend == "gloo":
        # Connects the full mesh in the constructor: returns once every rank joined, or times out.
        pg = torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # NCCL connects on the first collective; a missing rank fails there, within the timeout.
        pg = torch.distributed.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    group = WeightGroup(group_name, rank, world_size, backend, timeout_s, pg, store)
    logger.info("joined weight group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return group
