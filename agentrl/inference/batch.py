"""The engine's running batch: left-padded per-layer K/V caches, and how rows join and leave.

Running sequences share one left-padded cache: new requests are prefilled together and
concatenated in (`merge`, each side left-padded to the longer length), finished rows are dropped
and the leading columns no kept row uses are trimmed (`select`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Batch:
    """Running rows: per-layer K/V `[B, H, L, D]`, padding mask `[B, L]`, next position, last token."""

    reqs: list[Any]  # the engine's `Request`s (None on a follower rank)
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor

    @property
    def length(self) -> int:
        return self.mask.shape[1]


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def left_pad(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([torch.zeros(shape, dtype=t.dtype, device=t.device), t], dim=dim)


def merge(a: Batch | None, b: Batch) -> Batch:
    if a is None or not a.reqs:
        return b
    length = max(a.length, b.length)
    return Batch(
        reqs=a.reqs + b.reqs,
        keys=[
            torch.cat([left_pad(x, length, 2), left_pad(y, length, 2)])
            for x, y in zip(a.keys, b.keys, strict=True)
        ],
        values=[
            torch.cat([left_pad(x, length, 2), left_pad(y, length, 2)])
            for x, y in zip(a.values, b.values, strict=True)
        ],
        mask=torch.cat([left_pad(a.mask, length, 1), left_pad(b.mask, length, 1)]),
        positions=torch.cat([a.positions, b.positions]),
        last=torch.cat([a.last, b.last]),
    )


def select(batch: Batch, keep: list[int]) -> Batch | None:
    if not keep:
        return None
    idx = torch.tensor(keep, device=batch.mask.device)
    mask = batch.mask.index_select(0, idx)
    start = int(mask.any(0).int().argmax())  # first column any kept row uses
    return Batch(
        reqs=[batch.reqs[i] for i in keep],
        keys=[k.index_select(0, idx)[:, :, start:] for k in batch.keys],
        values=[v.index_select(0, idx)[:, :, start:] for v in batch.values],
        mask=mask[:, start:],
        positions=batch.positions.index_select(0, idx),
        last=batch.last.index_select(0, idx),
    )
