"""The FSDP2 learner backend on the HybridEngine's (dp, tp) training mesh.

`FSDP2Backend` counts every rank as a data-parallel rank. With tensor parallel training
(`colocated.t > 1`, reshard.py's `shard_training_model` on a `(d, t)` mesh) only the `d` ranks of
the dp dim see different data: the `t` ranks of one TP group hold pieces of the same model and
must run the same micro-batches (the TP collectives inside each layer pair their activations). So
here, against the backend contract (backend.py):

- `forward_backward`: each micro-batch's loss is already normalised over the whole mini-batch; FSDP2
  averages gradients over the `d` dp ranks only, so the loss is scaled by `d` (not by the world).
- `all_reduce` (the step's metric sums and maxima): over the dp group only; the `t` ranks of a TP
  group computed the same sums, and summing them too would count every token `t` times.
- `optimizer_step`: the gradient norm over parameters on two meshes (torch's `clip_grad_norm_`
  stacks per-parameter norms and refuses operands on different meshes): the TP-planned
  parameters are DTensors on the 2-D (dp, tp) mesh, the norms (replicated by the TP plan, then
  FSDP-sharded) on the dp mesh, held by each of the `t` TP ranks. One all-reduce over the world
  sums every rank's local squares, each divided by the number of ranks holding that piece, so
  the TP replicas of the norms count once.

The batch itself is split by dp index (`dp_rank`, `dp_size`) by the caller (colocated/loop.py);
`rank` and `world_size` stay the global ones (rank 0 writes exports and metrics).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from agentrl.learner.fsdp import FSDP2Backend

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from agentrl.learner.backend import ModelPart
    from agentrl.learner.packing import MicroBatch


class HybridFSDP2Backend(FSDP2Backend):
    """`FSDP2Backend` whose data parallel is the `dp_mesh` (the HybridEngine's `meshes.train`)."""

    def __init__(self, dp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.dp_mesh = dp_mesh
        self.dp_size = dp_mesh.size()
        self.dp_rank = dp_mesh.get_local_rank()
        if self.world_size % self.dp_size:
            raise ValueError(
                f"the dp mesh ({self.dp_size} ranks) does not divide the {self.world_size} ranks"
            )
        self.tp_size = self.world_size // self.dp_size

    def forward_backward(
        self, part: ModelPart, mbs: list[MicroBatch], loss_fn: Callable[[MicroBatch], torch.Tensor]
    ) -> None:
        # FSDP2Backend scales each loss by world_size = dp·tp; FSDP averages over dp only
        tp = self.tp_size
        super().forward_backward(part, mbs, loss_fn if tp == 1 else (lambda mb: loss_fn(mb) / tp))

    def all_reduce(self, values: dict[str, float], op: Literal["sum", "max"]) -> dict[str, float]:
        if not values:
            return values
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                            group=self.dp_mesh.get_group())  # fmt: skip
        return dict(zip(values, t.tolist(), strict=True))

    def optimizer_step(self, part: ModelPart, max_grad_norm: float, skip: bool = False) -> tuple[float, bool]:
        if self.tp_size == 1:
            return super().optimizer_step(part, max_grad_norm, skip)
        from torch.nn.utils import clip_grads_with_norm_

        by_mesh: dict[object, list[torch.nn.Parameter]] = {}
        for param in part.module.parameters():
            if param.grad is not None:
                by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
        total = torch.sqrt(self._squared_norm(by_mesh))
        norm = float(total)
        applied = math.isfinite(norm) and not skip
        if applied:
            for params in by_mesh.values():
                clip_grads_with_norm_(params, max_grad_norm, total.to(torch.float32))
            self._checked_step(part)
        part.optimizer.zero_grad(set_to_none=True)
        return norm, applied

    def _squared_norm(self, by_mesh: dict[object, list[torch.nn.Parameter]]) -> torch.Tensor:
        """Σ ‖grad‖² over all parameters, one all-reduce over the world: each rank adds its local
        squares divided by the number of ranks that hold the same piece (a DTensor sharded over
        every dim of its mesh is held once per `world / mesh.size()` ranks; a plain tensor by all)."""
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        for mesh, params in by_mesh.items():
            copies = self.world_size // (mesh.size() if mesh is not None else 1)
            for param in params:
                grad = param.grad
                if mesh is not None:
                    if any(p.is_replicate() or p.is_partial() for p in grad.placements):
                        raise ValueError(
                            f"gradient placements {grad.placements}: expected a shard on every mesh dim"
                        )
                    grad = grad.to_local()
                local += grad.detach().double().square().sum() / copies
        dist.all_reduce(local)
        return local
