"""`agentrl bench reshard`: the HybridEngine reshard (FSDP2 shards -> TP generation shards) against
its lower bound and against the naive path, on real gloo processes.

For each preset and world size it starts `world` ranks, shards a random-weight Qwen2 of the
preset with FSDP2 (meta init, so no rank ever holds a full copy), and for each generation layout
(tg, dg) times, median of `--repeats`, the slowest rank each time:

- reshard: `HybridEngine.to_generation()`: all-gathers in the micro-DP group (the norms over the
  FSDP group); on gloo one `allgather_coalesced` per bucket of parameters up to `--bucket-bytes`
  and per larger parameter, straight into the generation buffers (gloo packs and unpacks in its
  own flat buffers); at dg = 1 the generation shard is a view of the training shard (only norms
  move);
- raw: one `all_gather_into_tensor` of the same bytes (the generation shard) in the same micro-DP
  group, into one flat buffer: the like-for-like baseline, what a bare collective does with the
  bytes the reshard moves. It is not a lower bound, and the reshard can beat it: on gloo one
  all-gather of the whole shard goes through a flat temporary as large as its output, fresh
  memory every time, while the reshard's bucketed gathers each touch a bucket's worth;
- naive: every parameter gathered whole on every rank (`DTensor.full_tensor()`, the FSDP group),
  then the generation shard sliced out of it.

The three take turns within each repeat (the machine's load falls on all alike).

`ratios.vs_raw_allgather` = raw / reshard and `ratios.vs_naive` = naive / reshard, taken on the
layouts with tg > 1 and dg > 1 (where the reshard both gathers and shards; the worst of them).
`metrics.peak_param_bytes_per_rank` is the training shard plus the growth of the rank process's
resident set over one untimed reshard, from the kernel's high-water mark (`VmHWM`, reset before
it; `common.PeakResident`, the heap trimmed first and glibc mapping every large allocation afresh
during it, so freed pages leave and new or reused ones show): gloo's internal flat buffers count,
not only tensors Python can see. The timed passes run with glibc reusing its heap (its defaults
for the first layout, then the threshold at the top of its dynamic range): mapping afresh would
fault in every page of gloo's per-operation flat buffers on every reshard, a cost the raw
baseline's one reused buffer does not pay (with it, the small 2-rank reshard took 2.2× longer).
Beside
it: the bound training + generation shard and the staging the engine sizes
(`staging_bytes_per_rank`; `within_bound`: peak <= bound + staging) — a bound the measurement
can exceed.

With `--backends fsdp2,megatron` the same rows are measured from the Megatron backend's training
shards too (TP over every rank, `fsdp=False`; its colocated layout): at tg = world every
generation parameter is bound to the training shard, at tg < world the micro-DP all-gather runs.
The ratios stay the FSDP2 rows'.

    agentrl bench reshard [--presets small,base100m] [--worlds 2,4] [--repeats 5] [--bucket-bytes N]
                          [--backends fsdp2,megatron]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from agentrl.bench.common import (
    REUSE_THRESHOLD,
    PeakResident,
    emit,
    fix_mmap_threshold,
    print_table,
    trim_heap,
)

LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}


def _timed(fns: dict, repeats: int) -> dict[str, float]:
    """Per name, the median over `repeats` of the slowest rank's seconds for its `fn()` (one
    warm-up each first). The functions take turns within every repeat, so a load that comes and
    goes on a shared machine falls on all of them alike."""
    import torch
    import torch.distributed as dist

    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {name: statistics.median(t) for name, t in times.items()}


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"bench reshard: {message}", file=sys.stderr, flush=True)


def _naive(engine) -> None:
    """Full weights on every rank, then the generation shard copied out of them (into the
    generation buffer, or into a scratch copy where the generation shard is a view)."""
    import torch
    from torch.distributed.tensor import DTensor

    engine.allocate()
    shards = {s.name: s for s in engine.shards()}  # the training shards, through the backend seam
    with torch.no_grad():
        for slot in engine.slots:
            shard = shards[slot.name]
            full = shard.local
            if shard.mesh is not None:
                stride = torch.empty(shard.global_shape, device="meta").stride()
                full = DTensor.from_local(shard.local, shard.mesh, shard.placements, run_check=False,
                                          shape=shard.global_shape, stride=stride).full_tensor()  # fmt: skip
            piece = full[tuple(slice(a, b) for a, b in slot.box)]
            if slot.view:
                piece = piece.clone()
            else:
                (slot.buffer.t() if slot.kind == "row" else slot.buffer).copy_(piece)
            del full, piece


def _megatron_shards(config, rank: int, world: int, workdir: str):
    """`--backends megatron`: the preset with random weights saved once (rank 0; the only full copy,
    before any timing), loaded by the Megatron backend at TP over every rank (its colocated
    layout); the shards are `MegatronBackend.local_shards` (HF layout, in place)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.learner.megatron import MegatronBackend

    path = Path(workdir) / "megatron-model"
    if rank == 0:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        model.save_pretrained(path, safe_serialization=True)
        del model
    dist.barrier()
    backend = MegatronBackend(tp=world)
    actor = backend.build("policy", path)
    return functools.partial(backend.local_shards, actor)


def _worker(rank: int, world: int, port: int, preset: str, repeats: int, bucket_bytes: int, out: str,
            backend: str = "fsdp2") -> None:  # fmt: skip
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.hybrid.gather import all_gather_single
    from agentrl.hybrid.layout import GenLayout, HybridLayout, TrainLayout, box_numel
    from agentrl.hybrid.procs import init_gloo, preset_config
    from agentrl.hybrid.reshard import HybridEngine, build_meshes, shard_training_model
    from agentrl.hybrid.tp import check_tp_degree, parallelize_generation_model, param_specs
    from agentrl.learner.fsdp import local_shards

    fix_mmap_threshold()  # before any large allocation: the first layout's memory pass sees all
    init_gloo(rank, world, port)
    config = preset_config(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    specs = param_specs(model)
    full_bytes = 4 * sum(box_numel(tuple((0, n) for n in sp.shape)) for sp in specs)
    rows, shards = [], None
    megatron = backend == "megatron"
    for tg, dg in LAYOUTS[world]:
        try:
            check_tp_degree(config, tg)
            if megatron:  # TP over every rank: the model's key/value heads must split `world` ways
                check_tp_degree(config, world)
        except ValueError as exc:
            rows.append({"tg": tg, "dg": dg, "skipped": str(exc)})
            continue
        train = TrainLayout(t=world, d=1, fsdp=False) if megatron else TrainLayout(d=world)
        layout = HybridLayout(train, GenLayout(tg=tg, dg=dg))
        meshes = build_meshes(layout)
        if shards is None and megatron:
            shards = _megatron_shards(config, rank, world, str(Path(out).parent))
        elif shards is None:
            shard_training_model(model, meshes.train)
            model.to_empty(device="cpu")
            torch.manual_seed(rank)
            with torch.no_grad():
                for p in model.parameters():
                    p.to_local().normal_(0, 0.02)
            shards = functools.partial(local_shards, model)
        gen_model = parallelize_generation_model(config, meshes.tp)
        engine = HybridEngine(shards, gen_model, layout, meshes, bucket_bytes=bucket_bytes)
        gen_numel = engine.generation_bytes // 4
        micro = meshes.gen.get_group("dg")
        raw_out = torch.empty(gen_numel)
        raw_in = raw_out.narrow(0, dist.get_group_rank(micro, rank) * (gen_numel // dg), gen_numel // dg)

        def raw(raw_out=raw_out, raw_in=raw_in, micro=micro, dg=dg) -> None:
            if dg > 1:
                all_gather_single(raw_out, raw_in, group=micro)
            else:
                raw_out.copy_(raw_in)

        # first, one untimed pass that measures the process's resident-set growth, whatever
        # allocated it: every large allocation mapped afresh (and, after an earlier layout's
        # timing, the heap trimmed), so freed pages leave and new or reused ones show; timing then
        # goes back to heap reuse (mapping afresh faults in every page of gloo's per-operation flat
        # buffers on every reshard, a cost the raw baseline's one buffer does not pay)
        exact = fix_mmap_threshold() and (not rows or trim_heap())
        with PeakResident() as resident:
            stats = engine.to_generation()
        engine.release()
        fix_mmap_threshold(REUSE_THRESHOLD)
        _say(rank, f"{preset} world={world} tg={tg} dg={dg}: timing ({engine.transport})")
        timed = _timed({"raw": raw, "reshard": lambda engine=engine: (engine.release(), engine.to_generation()),
                        "naive": lambda engine=engine: (engine.release(), _naive(engine))}, repeats)  # fmt: skip
        raw_s, reshard_s, naive_s = timed["raw"], timed["reshard"], timed["naive"]
        del raw_out, raw_in
        engine.release()
        _say(
            rank,
            f"{preset} world={world} tg={tg} dg={dg}: reshard {reshard_s:.3f}s raw {raw_s:.3f}s naive {naive_s:.3f}s",
        )
        train_map = 4 * sum(box_numel(layout.train_box(rank, sp)) for sp in specs)
        gen_map = 4 * sum(box_numel(layout.gen_box(rank, sp)) for sp in specs)
        rows.append(
            {
                "tg": tg,
                "dg": dg,
                "reshard_s": reshard_s,
                "raw_allgather_s": raw_s,
                "naive_s": naive_s,
                "collectives": stats.collectives,
                "transport": engine.transport,
                "peak_param_bytes": engine.training_bytes + resident.extra,
                "peak_rss_added_bytes": resident.extra,
                "peak_exact": exact,
                "bound_bytes": train_map + gen_map,
                "staging_bytes": engine.staging_bytes,
                "generation_bytes": engine.generation_bytes,
                "added_bytes": engine.added_bytes,
                "full_bytes": full_bytes,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _spawn(
    preset: str, world: int, repeats: int, bucket_bytes: int, timeout_s: float, backend: str
) -> list[dict]:
    from agentrl.hybrid.procs import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        run_ranks(_worker, world, (preset, repeats, bucket_bytes, out, backend), timeout_s,
                  f"bench reshard {preset} ({backend})")  # fmt: skip
        return json.loads(Path(out).read_text())


def _table(rows: list[dict]) -> list[list]:
    """The printed rows (and each measured row's two ratios, added to it)."""
    table = []
    for r in rows:
        if "skipped" in r:
            table.append([r["backend"], r["preset"], r["world"], r["tg"], r["dg"], "skipped"] + [""] * 8)
            continue
        r["vs_raw_allgather"] = r["raw_allgather_s"] / r["reshard_s"]
        r["vs_naive"] = r["naive_s"] / r["reshard_s"]
        table.append(
            [r["backend"], r["preset"], r["world"], r["tg"], r["dg"], 1e3 * r["reshard_s"], 1e3 * r["raw_allgather_s"],
             1e3 * r["naive_s"], r["vs_raw_allgather"], r["vs_naive"], r["collectives"],
             r["peak_param_bytes"] / 2**20, r["bound_bytes"] / 2**20, r["staging_bytes"] / 2**20]
        )  # fmt: skip
    return table


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="small,base100m", help="model presets (agentrl/tiny_model.py)")
    parser.add_argument("--worlds", default="2,4", help="world sizes (ranks), each of 2 or 4")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median)")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="limit per preset and world size")
    parser.add_argument("--backends", default="fsdp2",
                        help="training backends to reshard from: fsdp2 (FSDP over every rank) and/or megatron "
                             "(Megatron TP over every rank; needs agentrl[megatron])")  # fmt: skip
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="gather parameters up to this size in buckets (default: the engine's; 0: none)")  # fmt: skip
    ns = parser.parse_args(args)
    worlds = [int(w) for w in ns.worlds.split(",")]
    if bad := [w for w in worlds if w not in LAYOUTS]:
        parser.error(f"--worlds: {bad} not among {sorted(LAYOUTS)}")
    from agentrl.hybrid.reshard import BUCKET_BYTES

    bucket_bytes = BUCKET_BYTES if ns.bucket_bytes is None else ns.bucket_bytes
    rows = []
    for backend in ns.backends.split(","):
        for preset in ns.presets.split(","):
            for world in worlds:
                for row in _spawn(preset, world, ns.repeats, bucket_bytes, ns.timeout_s, backend):
                    rows.append({"backend": backend, "preset": preset, "world": world, **row})
    _print_rows(rows)
    emit("reshard", *_summary(rows, bucket_bytes))
    return 0


def _print_rows(rows: list[dict]) -> None:
    """The table of every measured layout (`_table`)."""
    table = _table(rows)
    print_table(
        "HybridEngine reshard (gloo, CPU)",
        ["backend", "preset", "ranks", "tg", "dg", "reshard ms", "raw AG ms", "naive ms", "vs raw", "vs naive",
         "collectives", "peak MiB/rank", "bound MiB", "staging MiB"],
        table,
    )  # fmt: skip


def _summary(rows: list[dict], bucket_bytes: int) -> tuple[dict, dict]:
    """Metrics (the peaks per rank against their bound, every row) and ratios (the lowest over the
    FSDP2 layouts with both tg and dg above 1)."""
    head = [r for r in rows if "skipped" not in r and r["tg"] > 1 and r["dg"] > 1 and r["backend"] == "fsdp2"]
    ratios = {}
    if head:
        ratios = {
            "vs_raw_allgather": min(r["vs_raw_allgather"] for r in head),
            "vs_naive": min(r["vs_naive"] for r in head),
        }
    measured = [r for r in rows if "skipped" not in r]
    metrics = {
        "peak_param_bytes_per_rank": max((r["peak_param_bytes"] for r in measured), default=0),
        "bound_bytes_per_rank": max((r["bound_bytes"] for r in measured), default=0),
        "staging_bytes_per_rank": max((r["staging_bytes"] for r in measured), default=0),
        "bucket_bytes": bucket_bytes,
        "peak_exact": all(r["peak_exact"] for r in measured),  # False: mallopt missing, a lower bound
        "within_bound": all(r["peak_param_bytes"] <= r["bound_bytes"] + r["staging_bytes"] for r in measured),
        "rows": rows,
    }
    return metrics, ratios
