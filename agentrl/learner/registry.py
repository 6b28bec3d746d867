"""The learner backends by name (`learner.backend`): `create` builds one, importing only the
backend it builds (`backend.py`, the seam, imports none of them).
"""

from __future__ import annotations

from typing import Any

from agentrl.learner.backend import LearnerBackend

BACKENDS = ("fsdp2", "megatron")


def create(backend: str, megatron: Any = None, seed: int = 0) -> LearnerBackend:
    """The backend named by `learner.backend` (initialising the process group); `megatron` is
    `learner.megatron` (tp, pp) for the Megatron-core backend."""
    if backend == "fsdp2":
        from agentrl.learner.fsdp import FSDP2Backend

        return FSDP2Backend()
    if backend == "megatron":
        from agentrl.learner.megatron import MegatronBackend

        tp, pp = (megatron.tp, megatron.pp) if megatron is not None else (1, 1)
        return MegatronBackend(tp=tp, pp=pp, seed=seed)
    raise ValueError(f"learner.backend: unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
