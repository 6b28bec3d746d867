"""The lock-step channel of one tensor-parallel engine replica.

A replica is `tg` ranks that decode together: each holds one tensor-parallel shard of the model
(agentrl/hybrid/tp.py's plan: torch-native TP, so every attention and MLP block ends in one
all-reduce and every rank sees the full logits).
The replica's rank 0 — the leader — runs the engine's scheduler (`agentrl.inference.engine`); it
broadcasts each change of the running batch over `Lockstep` and the followers replay it
(`Engine.follow()`), so all ranks run the same forward on their shards and the TP collectives
meet. The channel is a gloo group even on GPUs (small pickled messages between decode steps),
while the forward's own collectives run on the TP mesh (NCCL on GPUs).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class Lockstep:
    """The leader → followers broadcast of one replica (`ranks` are global ranks; the first leads)."""

    def __init__(self, ranks: list[int], group: Any) -> None:
        self.ranks = list(ranks)
        self.group = group
        self.leader = self.ranks[0]

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_leader(self) -> bool:
        return dist.get_rank() == self.leader

    def publish(self, op: tuple) -> None:
        dist.broadcast_object_list([op], src=self.leader, group=self.group)

    def receive(self) -> tuple:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]
