"""The HybridEngine's rank maps: groups, shard boxes and the zero-redundancy property, as pure
arithmetic (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from agentrl.hybrid.layout import (
    GenCoords,
    GenLayout,
    HybridLayout,
    ParamSpec,
    TrainLayout,
    box_numel,
    contains,
    stage_of,
)

# A little model: two stages' worth of params, column-wise, row-wise, vocab and replicated.
SPECS = [
    ParamSpec("embed", (16, 8), tp_dim=0, fsdp_dim=0, stage=0),
    ParamSpec("q0", (16, 8), tp_dim=0, fsdp_dim=0, stage=0),
    ParamSpec("o0", (8, 16), tp_dim=1, fsdp_dim=1, stage=0),
    ParamSpec("norm0", (16,), tp_dim=None, fsdp_dim=0, stage=0),
]


def specs_for(p: int) -> list[ParamSpec]:
    out = []
    for stage in range(p):
        out += [ParamSpec(f"{s.name}@{stage}", s.shape, s.tp_dim, s.fsdp_dim, stage) for s in SPECS]
    return out


LAYOUTS = [
    # (train, gen): the paper's example, FSDP cases, p > 1 and pg > 1, t > 1 under FSDP
    (TrainLayout(p=1, t=4, d=2, fsdp=False), GenLayout(pg=1, tg=2, dg=2)),
    (TrainLayout(p=1, t=4, d=2, fsdp=False), GenLayout(pg=1, tg=4, dg=1)),
    (TrainLayout(p=1, t=4, d=2, fsdp=False), GenLayout(pg=1, tg=1, dg=4)),
    (TrainLayout(p=2, t=2, d=2, fsdp=False), GenLayout(pg=1, tg=2, dg=2)),
    (TrainLayout(p=2, t=4, d=1, fsdp=False), GenLayout(pg=2, tg=2, dg=2)),
    (TrainLayout(p=4, t=2, d=1, fsdp=False), GenLayout(pg=2, tg=1, dg=4)),
    (TrainLayout(d=4), GenLayout(tg=2, dg=2)),
    (TrainLayout(d=4), GenLayout(tg=4, dg=1)),
    (TrainLayout(d=4), GenLayout(tg=1, dg=4)),
    (TrainLayout(d=2), GenLayout(tg=2, dg=1)),
    (TrainLayout(t=2, d=2), GenLayout(tg=2, dg=2)),
    (TrainLayout(t=2, d=2), GenLayout(tg=4, dg=1)),
    (TrainLayout(p=2, t=2, d=2), GenLayout(pg=1, tg=4, dg=2)),
    (TrainLayout(p=2, t=2, d=2), GenLayout(pg=2, tg=2, dg=2)),
]


def test_paper_example_1_4_2_to_1_2_2_2():
    """HybridFlow's worked example: 8 ranks, training TP 4 x DP 2, generation TP 2 x micro-DP 2."""
    lay = HybridLayout(TrainLayout(p=1, t=4, d=2, fsdp=False), GenLayout(pg=1, tg=2, dg=2))
    assert lay.world_size == 8 and lay.replicas == 2
    assert lay.micro_dp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.gen_tp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    w = ParamSpec("w", (8, 4), tp_dim=0)
    # training: rank r of a replica holds rows [2 t_idx, 2 t_idx + 2) of 8
    assert [lay.train_box(r, w) for r in range(4)] == [((2 * i, 2 * i + 2), (0, 4)) for i in range(4)]
    # generation: ranks 0,1 hold rows [0, 4), ranks 2,3 rows [4, 8): each the union of their two chunks
    assert [lay.gen_box(r, w) for r in range(4)] == [((0, 4), (0, 4))] * 2 + [((4, 8), (0, 4))] * 2
    assert lay.gen_box(5, w) == lay.gen_box(1, w)  # the second replica mirrors the first


def test_fsdp_four_ranks_to_tg2_dg2():
    lay = HybridLayout(TrainLayout(d=4), GenLayout(tg=2, dg=2))
    assert lay.micro_dp_groups() == [[0, 1], [2, 3]]
    assert lay.gen_tp_groups() == [[0, 2], [1, 3]]
    assert lay.gen_mesh() == [[0, 2], [1, 3]]
    o = ParamSpec("o", (4, 8), tp_dim=1, fsdp_dim=1)
    assert lay.train_box(3, o) == ((0, 4), (6, 8))
    assert lay.gen_box(3, o) == ((0, 4), (4, 8))
    norm = ParamSpec("norm", (8,))
    assert lay.train_box(2, norm) == ((4, 6),) and lay.gen_box(2, norm) == ((0, 8),)


@pytest.mark.parametrize(("train", "gen"), LAYOUTS)
def test_zero_redundancy_and_coverage(train, gen):
    """Every training shard lies inside the same rank's generation shard, and the training shards
    of a rank's micro-DP sources tile its generation shard exactly."""
    lay = HybridLayout(train, gen)
    for spec in specs_for(train.p):
        for rank in range(lay.world_size):
            tbox, gbox = lay.train_box(rank, spec), lay.gen_box(rank, spec)
            if tbox is not None:
                assert gbox is not None and contains(gbox, tbox), (spec.name, rank, tbox, gbox)
            if gbox is None:
                assert lay.sources(rank, spec) == []
                continue
            covered = np.zeros(spec.shape, dtype=int)
            for src in lay.sources(rank, spec):
                covered[tuple(slice(a, b) for a, b in lay.train_box(src, spec))] += 1
            inside = covered[tuple(slice(a, b) for a, b in gbox)]
            assert inside.min() >= 1 and covered.sum() == inside.sum(), (spec.name, rank)
            if spec.tp_dim is not None or train.fsdp:
                # no element arrives twice: the all-gather moves exactly the generation shard
                assert inside.max() == 1 and inside.sum() == box_numel(gbox)


@pytest.mark.parametrize(("train", "gen"), LAYOUTS)
def test_groups_partition_the_world(train, gen):
    lay = HybridLayout(train, gen)
    for groups, size in ((lay.micro_dp_groups(), gen.dg), (lay.gen_tp_groups(), gen.tg)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(lay.world_size)) and all(len(g) == size for g in groups)
    for rank in range(lay.world_size):
        c = lay.gen_coords(rank)
        assert lay.rank_of(c) == rank
        assert lay.micro_dp_groups()[(c.replica * gen.pg + c.stage) * gen.tg + c.tp][c.micro_dp] == rank
    # ranks of one micro-DP group hold the same generation shard of every param
    for group in lay.micro_dp_groups():
        for spec in specs_for(train.p):
            assert len({lay.gen_box(r, spec) for r in group}) == 1


def test_pipeline_generation_stage_gathers_from_its_training_stages():
    lay = HybridLayout(TrainLayout(p=2, t=2, d=1, fsdp=False), GenLayout(pg=1, tg=2, dg=2))
    late = ParamSpec("late", (4, 4), tp_dim=0, stage=1)
    # ranks 2, 3 hold stage 1; rank 0 (stage 0) still needs its generation shard of `late`
    assert lay.train_box(0, late) is None
    assert lay.gen_box(0, late) == ((0, 2), (0, 4))
    assert lay.sources(0, late) == [2]
    assert lay.gen_coords(2) == GenCoords(replica=0, stage=0, tp=0, micro_dp=1)


@pytest.mark.parametrize(
    ("train", "gen", "message"),
    [
        (TrainLayout(d=4), GenLayout(tg=2, dg=1), r"pg·tg·dg = 1·2·1 = 2.*dg=2 fits"),
        (TrainLayout(t=4, d=2, fsdp=False), GenLayout(tg=2, dg=4), r"p·t = 4 but pg·tg·dg"),
        (TrainLayout(t=2, d=1, fsdp=False), GenLayout(tg=4, dg=1), r"tg=4 must divide the training shard"),
        (TrainLayout(p=2, t=2, fsdp=False), GenLayout(pg=4, tg=1, dg=1), r"pg=4 must divide training p=2"),
    ],
)
def test_bad_layouts_are_refused(train, gen, message):
    with pytest.raises(ValueError, match=message):
        HybridLayout(train, gen)
    with pytest.raises(ValueError, match=r"d must be >= 1"):
        TrainLayout(d=0)


def test_uneven_split_and_bad_rank_are_clear_errors():
    lay = HybridLayout(TrainLayout(d=4), GenLayout(tg=2, dg=2))
    with pytest.raises(ValueError, match=r"odd: dim 0 of extent 5 .* does not split evenly into 2"):
        lay.gen_box(0, ParamSpec("odd", (5, 4), tp_dim=0))
    with pytest.raises(ValueError, match="rank 4 is outside"):
        lay.train_coords(4)
    with pytest.raises(ValueError, match="use the group lists"):
        HybridLayout(TrainLayout(t=4, d=2, fsdp=False), GenLayout(tg=2, dg=2)).gen_mesh()


def test_stage_of_splits_layers_evenly():
    assert stage_of("model.embed_tokens.weight", 8, 4) == 0
    assert [stage_of(f"model.layers.{i}.mlp.up_proj.weight", 8, 4) for i in range(8)] == [
        0,
        0,
        1,
        1,
        2,
        2,
        3,
        3,
    ]
    assert stage_of("model.norm.weight", 8, 4) == 3 and stage_of("lm_head.weight", 8, 4) == 3
