"""The engine as one rank of a tensor-parallel replica (colocated mode, agentrl/colocated/lockstep.py).

`ReplicaFollowing` is a part of `agentrl.inference.engine.Engine`: the replica's leader publishes
every change of its running batch (prefill inputs, each decode step's sampled tokens, the rows
kept); a follower rank runs `follow()` in its own thread and replays them on its shard, so every
TP collective inside the forward meets its peers. Only the leader samples.
"""

from __future__ import annotations

import torch

from agentrl.inference.batch import select as _select


class ReplicaFollowing:
    """The lock-step half of `Engine` (it drives the engine's own prefill / decode rows)."""

    def _publish(self, op: tuple) -> None:
        if self.replica is not None and self.replica.size > 1:
            self.replica.publish(op)

    def end_phase(self) -> None:
        """(any thread, leader) Release the followers' `follow()` after what is queued before it."""
        self.call(lambda: self._publish(("end",))).result()

    def follow(self) -> int:
        """(a follower rank of a replica, its own thread) Mirror the leader's running batch — the
        same prefill inputs, the leader's sampled tokens, the same rows kept — so every TP collective
        inside the forward meets its peers; returns the decode steps run when the leader ends the
        phase. Followers never sample and never see requests."""
        steps = 0
        with torch.no_grad():
            while True:
                op = self.replica.receive()
                if op[0] == "prefill":
                    self._prefill_rows(op[1], op[2], [None] * len(op[1]))
                elif op[0] == "decode":
                    self._batch.last = op[1].to(self.device)
                    self._decode_rows()
                    steps += 1
                elif op[0] == "keep":
                    self._batch = _select(self._batch, op[1])
                elif op[0] == "end":
                    self._batch = None
                    return steps
                else:
                    raise RuntimeError(f"unknown lock-step op {op[0]!r} from the replica's leader")
