"""Turn prepared episodes into model-ready micro-batches: packed (default) or padded.

Packing concatenates sequences into one row of at most `budget` tokens, with position ids
that restart at 0 for each sequence. transformers (≥ 4.5x/5.x) detects the restarts when no
attention mask is given and builds a block-diagonal causal mask, so sequences in a row never
attend to each other (tests check packed == padded loss and gradients). Rows are padded only
to a multiple of `pad_multiple`; the padding forms its own dummy sequence with mask 0.

One row suits flash attention's varlen kernels, which attend within each sequence only. Under
SDPA or eager attention the block-diagonal mask is dense: one row of N sequences of length L
costs N² L² attention against N L² for N rows. So a micro-batch can also be packed in several
rows (`row_tokens`: each row at most that many real tokens or the longest sequence, first fit
decreasing, padded to the widest row); `learner.pack_row_tokens` chooses (learner/loop.py).

Per-position tensors are aligned to the *predicting* position: position p of a sequence
carries the target token p+1 with its loss mask, behaviour log-prob, version, advantage,
aggregation weight and token reward. The last position of each sequence predicts nothing (mask 0).
Routed experts (MoE router replay) are the exception: they belong to the *input* token, so position
p carries token p's experts, [rows·T, layers·top_k], -1 where there is no record (and on padding).

Across data-parallel ranks, sequences are balanced by token count (longest first, to the
least-loaded rank) and every rank runs the same number of micro-batches (empty ones are
added), because FSDP's collectives must be entered by every rank in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Sample:
    """One episode ready for training."""

    tokens: np.ndarray
    loss_mask: np.ndarray
    behav_logp: np.ndarray
    versions: np.ndarray
    advantage: float
    weight: float  # per-token aggregation weight (see losses.token_weights)
    token_rewards: np.ndarray | None = None  # float[T], each turn's reward on its last generated token
    routed_experts: np.ndarray | None = None  # int32[T, layers·top_k] (`Episode.routed_experts`), to replay

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class MicroBatch:
    """One forward/backward unit. `input_ids` is [rows, T]; per-position tensors are flat [rows·T]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    targets: torch.Tensor
    mask: torch.Tensor
    behav_logp: torch.Tensor
    versions: torch.Tensor
    adv: torch.Tensor
    weight: torch.Tensor
    seq_idx: torch.Tensor
    num_seqs: int
    real_tokens: int
    rewards: torch.Tensor | None = None  # token rewards at the predicting position (GAE's r_t)
    routed_experts: torch.Tensor | None = None  # [rows·T, layers·top_k] of the input token, -1: none
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # old_logp, ref_logp, old_values, returns

    @property
    def total_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.__dict__.items()}
        moved["extra"] = {k: v.to(device) for k, v in self.extra.items()}
        return MicroBatch(**moved)


def _aligned(sample: Sample) -> dict[str, np.ndarray]:
    """Per-position arrays of one sequence, shifted so position p carries token p+1."""
    n = len(sample)
    targets = np.zeros(n, dtype=np.int64)
    targets[:-1] = sample.tokens[1:]
    mask = np.zeros(n, dtype=np.float32)
    mask[:-1] = sample.loss_mask[1:]
    behav = np.zeros(n, dtype=np.float32)
    behav[:-1] = sample.behav_logp[1:]
    versions = np.full(n, -1, dtype=np.int64)
    versions[:-1] = sample.versions[1:]
    rewards = np.zeros(n, dtype=np.float32)
    if sample.token_rewards is not None:
        rewards[:-1] = sample.token_rewards[1:]
    return {
        "input_ids": sample.tokens.astype(np.int64),
        "position_ids": np.arange(n, dtype=np.int64),
        "targets": targets,
        "mask": mask,
        "behav_logp": behav,
        "versions": versions,
        "adv": np.full(n, sample.advantage, dtype=np.float32),
        "weight": np.full(n, sample.weight, dtype=np.float32),
        "rewards": rewards,
    }


def _padding(n: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.full(n, pad_id, dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64),
        "targets": np.zeros(n, dtype=np.int64),
        "mask": np.zeros(n, dtype=np.float32),
        "behav_logp": np.zeros(n, dtype=np.float32),
        "versions": np.full(n, -1, dtype=np.int64),
        "adv": np.zeros(n, dtype=np.float32),
        "weight": np.zeros(n, dtype=np.float32),
        "rewards": np.zeros(n, dtype=np.float32),
    }


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def packed_microbatch(
    samples: list[Sample], pad_multiple: int = 8, pad_id: int = 0, row_tokens: int | None = None
) -> MicroBatch:
    """`samples` packed with per-sequence position ids: in one row, or with `row_tokens` in rows
    of at most max(row_tokens, longest sample) real tokens (first fit decreasing), every row
    padded to the widest. Padding is its own sequence (index len(samples), mask 0); sequence
    `i` keeps index `i` whichever row it lands in."""
    if row_tokens is None or len(samples) <= 1:
        rows = [list(range(len(samples)))]
    else:
        rows = first_fit_decreasing([len(s) for s in samples], max(row_tokens, *(len(s) for s in samples)))
    filled = [sum(len(samples[i]) for i in row) for row in rows]
    real = sum(filled)
    width = _round_up(max(1, *filled), pad_multiple)
    parts, seq_idx = [], []
    for row, used in zip(rows, filled, strict=True):
        for i in row:
            parts.append(_aligned(samples[i]))
            seq_idx.append(np.full(len(samples[i]), i, dtype=np.int64))
        pad = width - used
        if pad:
            parts.append(_padding(pad, pad_id))
            seq_idx.append(np.full(pad, len(samples), dtype=np.int64))
    cat = {k: torch.from_numpy(np.concatenate([p[k] for p in parts])) for k in parts[0]}
    order = [samples[i] for row in rows for i in row]
    return MicroBatch(
        routed_experts=_routing(order, [width - used for used in filled], [len(row) for row in rows]),
        input_ids=cat.pop("input_ids").view(len(rows), width),
        position_ids=cat.pop("position_ids").view(len(rows), width),
        attention_mask=None,
        seq_idx=torch.from_numpy(np.concatenate(seq_idx)),
        num_seqs=len(samples) + (1 if real < len(rows) * width else 0),
        real_tokens=real,
        **cat,
    )


def padded_microbatch(samples: list[Sample], pad_id: int = 0) -> MicroBatch:
    """The classic layout: one row per sequence, right-padded to the longest, with an attention mask."""
    width = max(len(s) for s in samples)
    rows, attn = [], []
    for s in samples:
        part = _aligned(s)
        pad = _padding(width - len(s), pad_id)
        rows.append({k: np.concatenate([part[k], pad[k]]) for k in part})
        attn.append(
            np.concatenate([np.ones(len(s), dtype=np.int64), np.zeros(width - len(s), dtype=np.int64)])
        )
    stacked = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
    for k in stacked:
        if k not in ("input_ids", "position_ids"):
            stacked[k] = stacked[k].reshape(-1)
    stacked["routed_experts"] = _routing(samples, [width - len(s) for s in samples], [1] * len(samples))
    return MicroBatch(
        attention_mask=torch.from_numpy(np.stack(attn)),
        seq_idx=torch.arange(len(samples)).repeat_interleave(width),
        num_seqs=len(samples),
        real_tokens=sum(len(s) for s in samples),
        **stacked,
    )


def _routing(samples: list[Sample], pads: list[int], per_row: list[int]) -> torch.Tensor | None:
    """The micro-batch's routed experts in row order: `samples` in layout order, each row of
    `per_row[r]` samples followed by `pads[r]` padding positions (-1); None when no sample has any."""
    widths = {s.routed_experts.shape[1] for s in samples if s.routed_experts is not None}
    if not widths:
        return None
    if len(widths) > 1:
        raise ValueError(f"routed experts of different widths in one batch: {sorted(widths)} (one model?)")
    (width,) = widths
    parts, taken = [], 0
    for pad, count in zip(pads, per_row, strict=True):
        for s in samples[taken : taken + count]:
            parts.append(
                s.routed_experts if s.routed_experts is not None else np.full((len(s), width), -1, np.int32)
            )
        taken += count
        parts.append(np.full((pad, width), -1, np.int32))
    return torch.from_numpy(np.concatenate(parts).astype(np.int32, copy=False))


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to ≤ budget; a longer-than-budget item gets its own bin."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def balance_across_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Longest-processing-time assignment of sequences to ranks by token count."""
    loads = [0] * world_size
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += lengths[i]
    return [sorted(r) for r in ranks]


def plan_microbatches(
    samples: list[Sample],
    budget: int,
    world_size: int = 1,
    rank: int = 0,
    pad_multiple: int = 8,
    pad_id: int = 0,
    row_tokens: int | None = None,
) -> list[MicroBatch]:
    """This rank's packed micro-batches (each of at most `budget` real tokens, in rows as
    `packed_microbatch`'s `row_tokens`); every rank gets the same count (empty ones pad it)."""
    per_rank = balance_across_ranks([len(s) for s in samples], world_size)
    bins_per_rank = [first_fit_decreasing([len(samples[i]) for i in idx], budget) for idx in per_rank]
    count = max(1, *(len(b) for b in bins_per_rank))
    mine = per_rank[rank]
    mbs = [
        packed_microbatch([samples[mine[j]] for j in b], pad_multiple, pad_id, row_tokens)
        for b in bins_per_rank[rank]
    ]
    while len(mbs) < count:
        mbs.append(packed_microbatch([], pad_multiple, pad_id))
    return mbs


def padded_plan(samples: list[Sample], budget: int, pad_id: int = 0) -> list[MicroBatch]:
    """Baseline layout: sequences in arrival order, as many per micro-batch as fit when padded."""
    mbs, current, width = [], [], 0
    for s in samples:
        new_width = max(width, len(s))
        if current and new_width * (len(current) + 1) > budget:
            mbs.append(padded_microbatch(current, pad_id))
            current, new_width = [], len(s)
        current.append(s)
        width = new_width
    if current:
        mbs.append(padded_microbatch(current, pad_id))
    return mbs


def non_padding_fraction(mbs: list[MicroBatch]) -> float:
    total = sum(mb.total_tokens for mb in mbs)
    return sum(mb.real_tokens for mb in mbs) / total if total else 0.0
