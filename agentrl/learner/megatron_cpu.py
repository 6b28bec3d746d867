"""The smallest set of shims megatron-core 0.16.1 needs to run on a machine without CUDA.

Megatron-core is written for GPUs: a few of the code paths the Megatron backend uses ask CUDA
for the current device, allocate on `device="cuda"`, call `Tensor.cuda()` or synchronise the
CUDA stream. With the local (non-Transformer-Engine) layer spec and gloo, everything else runs
on CPU. `apply()` patches torch process-wide, so it is called only when CUDA is absent (the
backend does; on GPUs nothing here runs). Each shim names the Megatron code it serves.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_applied = False

# torch factories Megatron calls with `device="cuda"` on the paths used here (the token counter
# `torch.zeros([], ..., device="cuda")` of pipeline_parallel/schedules.py). Keep this list to what
# is needed: wrapping `torch.tensor` as well was seen to change Hugging Face models' gradients
# (torch 2.13), so each addition needs the equivalence tests.
_FACTORIES = ("zeros",)


def _cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


def apply() -> None:
    """Install the shims (idempotent). Refuses on a machine with CUDA, where none is needed."""
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("megatron_cpu.apply(): CUDA is available; the CPU shims must not be applied")

    # Replaces `torch.cuda.current_device()` (an int index) where Megatron places new tensors:
    # RotaryEmbedding's `inv_freq`, the pipeline's send/receive buffers (p2p_communication.py).
    torch.cuda.current_device = lambda: "cpu"
    # Replaces the stream synchronisation after pipeline send/receive (p2p_communication.py) and
    # in parallel_state's group setup: gloo's CPU ops are complete when they return.
    torch.cuda.synchronize = lambda device=None: None
    # Replaces the copy to the GPU (`tensor.cuda()`) in the pipeline schedule and optimizer
    # setup: the tensor already lives where training runs.
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # Replaces the CUDA generator's state that activation recompute saves with each checkpointed
    # layer (tensor_parallel/random.py `_get_all_rng_states`): on CPU every draw comes from the CPU
    # generator, whose state Megatron saves and restores beside it.
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    # Replaces allocations on `device="cuda"` (schedules.py's token counters, utils.py).
    for name in _FACTORIES:
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    _applied = True
