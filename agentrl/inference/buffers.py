"""Between phases, the engine's KV cache and parameter storage go and come back (colocated mode).

`BufferPhases` is a part of `agentrl.inference.engine.Engine`: `release()` drops the KV cache and
(with `params`) frees the parameters' storage (offloaded to pinned CPU memory first on CUDA),
`rebuild()` re-allocates and refills it. The HybridEngine (agentrl/hybrid/reshard.py) frees and
fills its own generation buffers and calls `release(params=False)`, so the CUDA offload below is
reached only by a direct `release()` (scripts/gpu_check.py runs it); it has not run on a GPU yet.
"""

from __future__ import annotations

import torch

from agentrl.inference.batch import local as _local


def storage_bytes(local: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage behind `local`: every view that shares it (tied
    or packed parameters at other offsets), not only `local`'s own elements."""
    storage = local.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=local.device).set_(storage, 0, (storage.nbytes(),))


def offload_storage(local: torch.Tensor) -> torch.Tensor:
    """A host copy of `local`'s whole storage (pinned when it is on CUDA, so the copy can overlap);
    the caller synchronises before the storage is freed."""
    whole = storage_bytes(local)
    copy = torch.empty(whole.shape, dtype=torch.uint8, pin_memory=whole.is_cuda)
    copy.copy_(whole, non_blocking=whole.is_cuda)
    return copy


def restore_storage(local: torch.Tensor, copy: torch.Tensor) -> None:
    """Re-allocate `local`'s freed storage and fill it from `offload_storage`'s copy."""
    local.untyped_storage().resize_(copy.numel())
    storage_bytes(local).copy_(copy, non_blocking=local.is_cuda)


class BufferPhases:
    """The release / rebuild half of `Engine` (it reads the engine's model, batch and queues)."""

    def _param_storages(self) -> list[torch.Tensor]:
        """The local tensor of each parameter, one per storage (tied weights appear once)."""
        seen, out = set(), []
        for param in self.model.parameters():
            if not hasattr(param, "to_local") and not param.untyped_storage().resizable():
                param.data = param.data.clone()  # from_pretrained's mmapped storage cannot be freed in place
            local = _local(param.data)
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(local)
        return out

    @property
    def released(self) -> bool:
        return self._offloaded is not None

    def release(self, params: bool = True) -> int:
        """Drop the KV cache and (with `params`) give the parameters' memory back; returns the
        parameter bytes released. `params=False` suits buffers someone else frees and refills (the
        HybridEngine's generation buffers, agentrl/hybrid/reshard.py). On
        CUDA each storage is first copied to pinned CPU memory (`rebuild()` copies it back); on CPU
        the storage is freed (`UntypedStorage.resize_(0)`, as FSDP2 frees unsharded parameters) and
        `rebuild(weights)` must refill it. Only between phases: nothing may be running or held."""
        if self.num_running or self._held or not self._waiting.empty():
            raise RuntimeError("release() with requests in flight: finish or abort them first")
        if self._offloaded is not None:
            return 0
        self._batch = None
        if not params:
            return 0
        self._offloaded = []
        for local in self._param_storages():
            self._offloaded.append((local, offload_storage(local) if local.is_cuda else None))
        if any(copy is not None for _, copy in self._offloaded):
            torch.cuda.current_stream().synchronize()  # the copies land before the storage goes
        self._offloaded_bytes = [local.untyped_storage().nbytes() for local, _ in self._offloaded]
        for local, _ in self._offloaded:
            local.untyped_storage().resize_(0)
        total = sum(self._offloaded_bytes)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return total

    def rebuild(
        self, weights: dict[str, torch.Tensor] | None = None, weight_version: str | None = None
    ) -> None:
        """Re-allocate the parameters released by `release()`: restored from the CPU copies (CUDA),
        then overwritten by `weights` if given; on CPU, where nothing was kept, `weights` must
        cover every parameter."""
        if self._offloaded is None:
            if weights is not None:
                self.load_weights(weights, weight_version)
            return
        kept = all(copy is not None for _, copy in self._offloaded)
        if weights is None and not kept:
            raise ValueError("rebuild() after a CPU release needs the weights (the storage was freed)")
        if not kept:
            missing = [n for n, _ in self.model.named_parameters() if n not in weights]
            if missing:
                raise ValueError(f"rebuild() weights lack parameters {missing[:5]}")
        for (local, copy), nbytes in zip(self._offloaded, self._offloaded_bytes, strict=True):
            if copy is not None:
                restore_storage(local, copy)
            else:
                local.untyped_storage().resize_(nbytes)
        self._offloaded = None
        if weights is not None:
            self.load_weights(weights, weight_version)
        elif weight_version is not None:
            self.weight_version = str(weight_version)
