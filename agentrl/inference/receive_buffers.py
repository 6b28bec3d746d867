"""The embedded server's receive buffers for weight pushes, kept from one push to the next.

A push arrives bucket by bucket over the weight group; the server stages every bucket and applies
them all at `/end_weight_update` (agentrl/inference/admin.py). Each bucket is received into a flat
uint8 buffer taken from `ReceiveBuffers`, and its tensors are views of that buffer. At the commit
the engine makes those views its parameters where it can (`Engine.load_weights(adopt=True)`:
no second pass over the weights), so the buffers the model used before the push are no longer
used; `settle` then takes back every buffer the model does not use (an aborted push's, the
previous weights') as free buffers for the next push. A push of the same model in the same
buckets therefore receives into memory that is already mapped (no page faults, no allocation):
in steady state the server holds its weights and one free set of receive buffers.

Memory: between pushes, free buffers of at most `cap` bytes (the model's parameter bytes: one
copy of its weights) stay allocated on the device the server receives on; during a push the
staged buckets take that memory, as a fresh staging copy would. A buffer is handed out only if
no parameter of the model uses its storage (checked at every `settle`, from the model itself),
so a reused buffer never aliases the served weights: an aborted push cannot change them.
"""

from __future__ import annotations

import torch


def storages_in_use(model: torch.nn.Module) -> set[int]:
    """The storage addresses behind every parameter and buffer of `model` (a DTensor's local shard)."""
    return _in_use(model)[0]


def _in_use(model: torch.nn.Module) -> tuple[set[int], int]:
    """(`storages_in_use`, the bytes of the model's parameters), in one walk of its modules: a
    model with LoRA layers injected has thousands, and each of `parameters()`, `buffers()` walks
    them all (~1.5 ms apiece on the 100M preset, at every commit)."""
    used, param_bytes, seen = set(), 0, set()
    for module in model.modules():
        for kind, tensors in ((0, module._parameters), (1, module._buffers)):
            for tensor in tensors.values():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                used.add(local.untyped_storage().data_ptr())
                if kind == 0:
                    param_bytes += tensor.numel() * tensor.element_size()
    return used, param_bytes


class ReceiveBuffers:
    """Flat uint8 buffers by size and device: `take` one for a bucket, `settle` after a session."""

    def __init__(self) -> None:
        self.owned: list[torch.Tensor] = []
        """Every buffer handed out and not yet let go: used by the model, staged, or free."""
        self.free: list[torch.Tensor] = []
        self.receiving: set[int] = set()
        """Storage addresses of buffers a receive may still write into: never handed out again
        until it ended (`received`), even if their session was closed meanwhile."""

    def take(self, nbytes: int, device: torch.device, receiving: bool = False) -> torch.Tensor:
        """A uint8 buffer of exactly `nbytes` on `device`: a free one of that size, else a new one;
        `receiving`: a receive is posted into it, until `received(buffer)`."""
        for i, buffer in enumerate(self.free):
            if buffer.numel() == nbytes and buffer.device == device:
                buffer = self.free.pop(i)
                break
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.owned.append(buffer)
        if receiving:
            self.receiving.add(buffer.untyped_storage().data_ptr())
        return buffer

    def received(self, buffer: torch.Tensor) -> None:
        """The receive into `buffer` (taken with `take(..., receiving=True)`) has ended."""
        self.receiving.discard(buffer.untyped_storage().data_ptr())

    def settle(self, model: torch.nn.Module, cap: int | None = None) -> None:
        """After a session ends (committed or aborted): every owned buffer the model does not use and
        no receive may still write into is free again, up to `cap` bytes (default: the model's
        parameter bytes; newest first, so the buffers of the push just received stay); the rest are
        let go."""
        used, param_bytes = _in_use(model)
        cap = param_bytes if cap is None else cap
        kept, free, free_bytes = [], [], 0
        for buffer in reversed(self.owned):
            if (ptr := buffer.untyped_storage().data_ptr()) in used or ptr in self.receiving:
                kept.append(buffer)
            elif free_bytes + buffer.numel() <= cap:
                free.append(buffer)
                free_bytes += buffer.numel()
        self.owned = kept[::-1] + free[::-1]
        self.free = free[::-1]

    @property
    def free_bytes(self) -> int:
        return sum(b.numel() for b in self.free)
