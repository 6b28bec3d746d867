"""The side process group that carries a weight push from the trainer to inference servers.

Both ends of a broadcast weight update use this module: the learner (rank 0, which hosts
the rendezvous store) and every inference worker (ranks `rank_offset …`, as SGLang numbers
them: engine i of a fleet with g GPUs per engine gets `rank_offset = 1 + i × g`). The group
is built directly on a `TCPStore` (hosted by rank 0), so independently started processes
can broadcast to each other without touching (or needing) the default `torch.distributed`
process group. The store keys are laid out as SGLang's `init_custom_process_group` lays them
out (`PrefixStore(group_name)`, then torch's `_new_process_group_helper` prefixes
`"{group_name}/"` and `"{device}/"`), so a trainer using this module can also be rank 0 for
real SGLang engines; no collective is issued at set-up, as SGLang issues none. Like torch's
`_new_process_group_helper` under SGLang 0.5.23's `init_custom_process_group`
(`srt/utils/common.py`), "gloo" builds one gloo group per device torch lists for it
(`Backend.backend_capability["gloo"] == ["cpu", "cuda"]`): `cpu/` then `cuda/`. Each connects
its full mesh when built, so every member must build both in that order; a GPU SGLang
receives into CUDA tensors, which go over its `cuda/` group, so rank 0 broadcasts on the
group of the receivers' device (`wire`). Every step has
a timeout that fails loudly instead of hanging: set-up and each collective.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

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
    _pg_cuda: object = None
    """gloo only: the `cuda/` group (see the module docstring)."""
    wire: str = "cpu"
    """gloo only: which of the two groups broadcasts use ("cpu" or "cuda": the receivers' device)."""

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast `tensor` in place from rank `src` (send on src, receive elsewhere); waits with timeout."""
        pg = self._pg_cuda if (self.wire == "cuda" and self._pg_cuda is not None) else self._pg
        work = pg.broadcast(tensor, src, datetime.timedelta(seconds=self.timeout_s))
        if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
            raise TimeoutError(
                f"weight group {self.group_name!r}: broadcast timed out after {self.timeout_s}s"
            )
        return tensor

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
        self._pg_cuda = None
        self._store = None


def join_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = 120.0,
    wire: str = "cpu",
) -> WeightGroup:
    """Join (rank 0: host) a weight-update group; blocks until all `world_size` ranks joined.

    `backend` is "gloo" (CPU tensors; `wire` names the group broadcasts go over, "cuda" when the
    receivers hold CUDA tensors) or "nccl" (CUDA tensors). Raises TimeoutError / RuntimeError
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
    if wire not in ("cpu", "cuda"):
        raise ValueError(f"wire {wire!r}: use 'cpu' or 'cuda'")
    base = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    pg_cuda = None
    if backend == "gloo":
        # Each connects the full mesh in its constructor: returns once every rank joined, or times out.
        pg = torch.distributed.ProcessGroupGloo(PrefixStore("cpu/", base), rank, world_size, timeout)
        pg_cuda = torch.distributed.ProcessGroupGloo(PrefixStore("cuda/", base), rank, world_size, timeout)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # NCCL connects on the first collective; a missing rank fails there, within the timeout.
        pg = torch.distributed.ProcessGroupNCCL(PrefixStore("cuda/", base), rank, world_size, opts)
    group = WeightGroup(group_name, rank, world_size, backend, timeout_s, pg, store, pg_cuda, wire)
    logger.info("joined weight group %s as rank %d/%d (%s)", group_name, rank, world_size, backend)
    return group
