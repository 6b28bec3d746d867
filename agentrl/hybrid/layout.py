"""The HybridEngine's layouts and rank maps: pure arithmetic, no torch.distributed.

Colocated mode keeps the actor on the same ranks in two layouts (HybridFlow, Sheng et al.,
EuroSys'25, §5 "3D-HybridEngine"; verl's `3D-HybridEngine`):

- training `p-t-d`: `p` pipeline stages, `t`-way tensor parallel, `d`-way data parallel. With
  FSDP (ZeRO-3) the `d` ranks also shard every parameter; with replicated data parallel
  (Megatron's DP) each of the `d` replicas holds a whole copy, spread over its `p·t` ranks.
- generation `pg-tg-dg-R`: `pg` pipeline stages, `tg`-way tensor parallel, `dg` micro-DP
  replicas per weight copy, `R` weight copies (`R = d` for replicated DP, `R = 1` for FSDP).

The constraint is the paper's `p·t·d = pg·tg·dg·d` (replicated DP) or `p·t·d = pg·tg·dg` (FSDP:
the whole world is one shard group). A rank's *shard index* `s` in its stage's shard group is
`t_idx` (replicated DP) or `t_idx·d + d_idx` (FSDP over a TP-local tensor: a chunk of a chunk).
The grouping that makes every training shard a slice of its generation shard is

    g = s // (S/tg)                                   generation TP rank
    j = (p_idx mod p/pg)·(S/tg) + s mod (S/tg)        micro-DP index

with `S` the shard-group size of one stage: ranks with equal `g` form a micro-DP group, whose
all-gather turns training shards into the generation shard; ranks with equal `j` form a
generation TP group (strided). Worked example (the paper's 1-4-2 → 1-2-2-2): ranks 0-3 are one
TP-4 replica, ranks 0,1 gather chunks 0,1 of 4 = generation chunk 0 of 2, ranks 2,3 gather
generation chunk 1; micro-DP groups {0,1} {2,3} {4,5} {6,7}, generation TP groups {0,2} {1,3}
{4,6} {5,7}.

Parameters the plan replicates (norms) but FSDP shards are the exception: their generation shard is
the whole tensor, gathered over the stage's FSDP ranks.

A parameter's slice is a `Box` (one `(start, stop)` per dim). `ParamSpec.tp_dim` is the dim the
TP plan splits (0 column-wise/vocab, 1 row-wise, None replicated); `fsdp_dim` the dim FSDP
splits. Divisions must be exact (a clear error otherwise): the reshard moves whole chunks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TrainLayout:
    """Training layout `p-t-d`; `fsdp` says whether the `d` ranks shard parameters (FSDP2)."""

    p: int = 1
    t: int = 1
    d: int = 1
    fsdp: bool = True

    def __post_init__(self) -> None:
        for name in ("p", "t", "d"):
            if getattr(self, name) < 1:
                raise ValueError(f"training layout: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class GenLayout:
    """Generation layout `pg-tg-dg` (the number of weight copies follows from the training side)."""

    pg: int = 1
    tg: int = 1
    dg: int = 1

    def __post_init__(self) -> None:
        for name in ("pg", "tg", "dg"):
            if getattr(self, name) < 1:
                raise ValueError(f"generation layout: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the maps see it: its shape, the TP and FSDP dims, its pipeline stage."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None = None
    fsdp_dim: int = 0
    stage: int = 0  # training pipeline stage, in [0, p)


@dataclass(frozen=True)
class TrainCoords:
    replica: int  # weight copy (d_idx for replicated DP, 0 for FSDP)
    stage: int
    d: int
    t: int
    shard: int  # index in the stage's shard group


@dataclass(frozen=True)
class GenCoords:
    replica: int
    stage: int
    tp: int  # g
    micro_dp: int  # j


@dataclass(frozen=True)
class HybridLayout:
    """A training and a generation layout over the same ranks, validated together."""

    train: TrainLayout
    gen: GenLayout
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        tr, ge = self.train, self.gen
        if tr.p % ge.pg:
            raise ValueError(
                f"generation pg={ge.pg} must divide training p={tr.p}: a generation stage merges whole "
                "training stages, or a training shard would straddle two generation stages"
            )
        if self.shard_group % ge.tg:
            raise ValueError(
                f"generation tg={ge.tg} must divide the training shard group of one stage "
                f"({self.shard_group} = {'t·d' if tr.fsdp else 't'}); otherwise a training shard does not "
                "lie inside one generation TP shard"
            )
        want = tr.p * self.shard_group
        if ge.pg * ge.tg * ge.dg != want:
            side = "p·t·d" if tr.fsdp else "p·t"
            need = want // (ge.pg * ge.tg) if want % (ge.pg * ge.tg) == 0 else None
            hint = f"; dg={need} fits" if need else ""
            raise ValueError(
                f"layouts disagree: {side} = {want} but pg·tg·dg = {ge.pg}·{ge.tg}·{ge.dg} = "
                f"{ge.pg * ge.tg * ge.dg} (the rule is p·t·d = pg·tg·dg·{'1' if tr.fsdp else 'd'}){hint}"
            )

    # sizes --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.train.p * self.train.t * self.train.d

    @property
    def shard_group(self) -> int:
        """S: ranks that share one stage's copy of the weights (t·d under FSDP, t otherwise)."""
        return self.train.t * (self.train.d if self.train.fsdp else 1)

    @property
    def replicas(self) -> int:
        return 1 if self.train.fsdp else self.train.d

    @property
    def stages_per_gen_stage(self) -> int:
        return self.train.p // self.gen.pg

    @property
    def chunks_per_gen_shard(self) -> int:
        """S/tg: training shards (of one stage) inside one generation TP shard."""
        return self.shard_group // self.gen.tg

    # coordinates ---------------------------------------------------------------------------
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")

    def train_coords(self, rank: int) -> TrainCoords:
        """Rank order: pipeline outermost, tensor parallel innermost (Megatron's and a (pp, dp, tp)
        DeviceMesh's order): rank = p_idx·d·t + d_idx·t + t_idx."""
        self._check_rank(rank)
        tr = self.train
        p_idx, rest = divmod(rank, tr.d * tr.t)
        d_idx, t_idx = divmod(rest, tr.t)
        shard = t_idx * tr.d + d_idx if tr.fsdp else t_idx
        return TrainCoords(0 if tr.fsdp else d_idx, p_idx, d_idx, t_idx, shard)

    def gen_coords(self, rank: int) -> GenCoords:
        c = self.train_coords(rank)
        k = self.chunks_per_gen_shard
        g, low = divmod(c.shard, k)
        j = (c.stage % self.stages_per_gen_stage) * k + low
        return GenCoords(c.replica, c.stage // self.stages_per_gen_stage, g, j)

    def rank_of(self, gen: GenCoords) -> int:
        """The inverse of `gen_coords`."""
        k = self.chunks_per_gen_shard
        q, low = divmod(gen.micro_dp, k)
        stage = gen.stage * self.stages_per_gen_stage + q
        shard = gen.tp * k + low
        tr = self.train
        if tr.fsdp:
            t_idx, d_idx = divmod(shard, tr.d)
        else:
            t_idx, d_idx = shard, gen.replica
        return stage * tr.d * tr.t + d_idx * tr.t + t_idx

    # groups --------------------------------------------------------------------------------
    def micro_dp_groups(self) -> list[list[int]]:
        """The all-gather groups: ranks holding the same generation shard, in micro-DP order."""
        ge = self.gen
        return [
            [self.rank_of(GenCoords(r, s, g, j)) for j in range(ge.dg)]
            for r in range(self.replicas)
            for s in range(ge.pg)
            for g in range(ge.tg)
        ]

    def gen_tp_groups(self) -> list[list[int]]:
        """The generation TP groups (one engine replica stage each), in TP-rank order."""
        ge = self.gen
        return [
            [self.rank_of(GenCoords(r, s, g, j)) for g in range(ge.tg)]
            for r in range(self.replicas)
            for s in range(ge.pg)
            for j in range(ge.dg)
        ]

    def gen_mesh(self) -> list[list[int]]:
        """Ranks as a (dg, tg) array for a DeviceMesh with dims ("dg", "tg"): its "dg" groups are
        the micro-DP groups and its "tg" groups the generation TP groups. Single stage, one copy."""
        if self.gen.pg != 1 or self.train.p != 1 or self.replicas != 1:
            raise ValueError("gen_mesh covers p = pg = 1 with one weight copy (FSDP); use the group lists")
        return [[self.rank_of(GenCoords(0, 0, g, j)) for g in range(self.gen.tg)] for j in range(self.gen.dg)]

    # shard maps ----------------------------------------------------------------------------
    def train_box(self, rank: int, spec: ParamSpec) -> Box | None:
        """The slice of `spec` that `rank` holds while training (None: not on its stage)."""
        c = self.train_coords(rank)
        _check_stage(spec, self.train.p)
        if spec.stage != c.stage:
            return None
        box = _full(spec)
        if spec.tp_dim is not None:
            box = _split(box, spec, spec.tp_dim, self.train.t, c.t)
        if self.train.fsdp:
            box = _split(box, spec, spec.fsdp_dim, self.train.d, c.d)
        return box

    def gen_box(self, rank: int, spec: ParamSpec) -> Box | None:
        """The slice of `spec` that `rank` holds while generating (None: not on its stage)."""
        c = self.gen_coords(rank)
        _check_stage(spec, self.train.p)
        if spec.stage // self.stages_per_gen_stage != c.stage:
            return None
        box = _full(spec)
        if spec.tp_dim is not None:
            box = _split(box, spec, spec.tp_dim, self.gen.tg, c.tp)
        return box

    def sources(self, rank: int, spec: ParamSpec) -> list[int]:
        """Ranks whose training shards of `spec` make up `rank`'s generation shard: those of its
        micro-DP group on the param's stage. One exception: a parameter the plan replicates but
        FSDP shards (RMSNorms) is gathered from the stage's `d` FSDP ranks (with this rank's TP index), a collective across
        micro-DP groups (its bytes are a few KB)."""
        if self.gen_box(rank, spec) is None:
            return []
        c = self.gen_coords(rank)
        if spec.tp_dim is None and self.train.fsdp:
            tr, t_idx = self.train, self.train_coords(rank).t
            return [spec.stage * tr.d * tr.t + i * tr.t + t_idx for i in range(tr.d)]
        group = [self.rank_of(GenCoords(c.replica, c.stage, c.tp, j)) for j in range(self.gen.dg)]
        return [r for r in group if self.train_box(r, spec) is not None]


def contains(outer: Box, inner: Box) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner, strict=True))


def box_numel(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def stage_of(name: str, num_layers: int, p: int) -> int:
    """Pipeline stage of an HF decoder parameter under an even split of the layers: embeddings on
    the first stage, the final norm and an untied lm_head on the last."""
    m = re.search(r"\.layers\.(\d+)\.", name)
    if m:
        return int(m.group(1)) * p // num_layers
    return p - 1 if (name.startswith("lm_head") or name.endswith("model.norm.weight")) else 0


def _check_stage(spec: ParamSpec, p: int) -> None:
    if not 0 <= spec.stage < p:
        raise ValueError(f"{spec.name}: stage {spec.stage} outside the {p} training pipeline stages")


def _full(spec: ParamSpec) -> Box:
    return tuple((0, n) for n in spec.shape)


def _split(box: Box, spec: ParamSpec, dim: int, parts: int, index: int) -> Box:
    if not 0 <= dim < len(box):
        raise ValueError(f"{spec.name}: dim {dim} out of range for shape {spec.shape}")
    start, stop = box[dim]
    if (stop - start) % parts:
        raise ValueError(
            f"{spec.name}: dim {dim} of extent {stop - start} (shape {spec.shape}) does not split "
            f"evenly into {parts}; choose layouts whose TP/FSDP degrees divide it"
        )
    size = (stop - start) // parts
    out = list(box)
    out[dim] = (start + index * size, start + (index + 1) * size)
    return tuple(out)
