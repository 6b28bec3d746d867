"""`agentrl bench sync`: weight push time of our broadcast engine, side by side with
a raw gloo broadcast of the same tensors and with the disk engine, in one run.

    agentrl bench sync [--preset base100m] [--repeats 3] [--bucket-mb 64]
    agentrl bench sync --preset mini --repeats 1 --bucket-mb 1   # seconds: several buckets, ~4 MB
    agentrl bench sync --lora-rank 8     # (the default) adds the LoRA adapter push row; 0 leaves it out

An embedded server (`agentrl serve`, a child process) holds a ~100M-parameter model.
- ours: `BroadcastEngine.push` of the learner's own actor, built as `agentrl learner` builds it
  (`FSDP2Backend.build` on one rank, its weights laid out in the push's buckets:
  `learner.fsdp.home_for_push`), its full tensors read as the learner reads them (`full_tensors`)
  — pause, bucketed broadcast (the gather thread starts during pause and begin; each bucket is
  announced from it as soon as it is gathered, and since the actor's tensors are its parameters
  in place the gather takes them all at once and announces every bucket in one request
  (`bucket_batches`), so the server has posted every receive before the broadcasts reach it,
  waiting for each off its engine thread; a bucket whose
  tensors lie back to back is sent as a view of the weights, any other is packed on the gather
  thread while the one before is broadcast; bucket i+1 broadcast before bucket i's replies are
  awaited) with the server receiving each bucket into buffers it keeps between pushes and, at
  the commit, taking the received tensors as its parameters (no copy), continue (what the
  learner does after every step);
- raw: the like-for-like baseline, the best a bare `ProcessGroupGloo` broadcast of the same bytes
  does: the model packed once, before timing, into one flat uint8 buffer per bucket (the buckets
  ours sends, same `--bucket-mb`), each broadcast from this process to one receiver process that
  only receives into buffers it allocated once (no HTTP, no gather, no load), with the server
  alive; raw and ours take turns within every repeat, so the machine's load falls on both alike,
  after `WARMUP` rounds of each that are not counted: the transport's limit here;
- disk: `DiskEngine.push` of the same actor — safetensors written, then `/update_weights_from_disk`;
- vllm (`--vllm`, needs `make vllm`): `BroadcastEngine.push` into a real vLLM server started
  after the embedded one has stopped: the same broadcast into agentrl's worker extension, which
  stages every bucket and loads the whole set with vLLM's in-place reload at the end.
- LoRA (`--lora-rank`, default 8; needs `peft` in the server): `BroadcastEngine.push` of a rank-r
  adapter on every attention and MLP projection of the same model (`lora_mode: adapter`: only the
  adapter's tensors travel, the server applies them on the base it holds), on a server of its own
  (the LoRA layers an adapter injects stay in its server and would weigh on the full pushes, which
  raw does not pay for); `lora_vs_full_push` = adapter / full push seconds (lower is better).
Ratios (higher is better): `vs_raw_broadcast` = raw / ours (target ≥ 0.9), `vs_disk` =
disk / ours (target ≥ 3); the JSON carries both sides' seconds (`push_s`, `raw_broadcast_s`,
`disk_s`, medians, and every repeat's). A phase table splits our push (median per phase over
the repeats, from the engine's `PushStats.phases`): regroup, pause, begin, waiting for the
gather thread, announcing a bucket from the push's own thread (servers that take buckets in any
order only), broadcast, the servers' replies after each broadcast (their receive and checks),
commit, version read-back, continue (the embedded server says `session_control`, so from the
second push on it pauses in begin's round trip and continues and answers its version in the
commit's: those three rows are then near zero); then, not summed, what the gather thread does while the
bucket before is broadcast (announcing each bucket ahead, packing those that are not laid out
back to back), and each bucket's round trip (announce to last reply). The peak extra memory of
a push is shown as the learner's resident-set growth during one more push after the timed ones
(sampled every 5 ms by a thread, which the timed pushes do not carry), next to the bucket size and the packing buffers the engine
keeps from push to push (so a warm push maps no fresh memory; at most three buckets); the
server's resident set after the pushes holds its weights and the free receive buffers it keeps
for the next push (at most one copy of the weights). glibc's dynamic mmap threshold
would serve a freed bucket's memory again from the heap and hide even a full copy of the model
after the first push, so the bench fixes the threshold at 64 KiB (`mallopt`): every large
allocation maps fresh pages and shows in the resident set while it lives.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agentrl.bench.common import emit, fix_mmap_threshold, print_table

RECEIVER = """
import sys, time, torch
from agentrl.inference.weight_group import join_group
port, sizes = int(sys.argv[1]), [int(n) for n in sys.argv[3].split(",")]
group = join_group("127.0.0.1", port, 1, 2, "raw", "gloo", 300)
buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]  # allocated once: the transport alone
for _ in range(int(sys.argv[2])):
    for buffer in buffers:
        group.broadcast(buffer, 0)
    group.barrier()
import os; os._exit(0)
"""
PHASES = ["regroup", "pause", "begin", "gather_wait", "announce", "broadcast", "replies", "commit",
          "read_back", "continue"]  # fmt: skip
OVERLAPPED = ["announce_ahead", "flatten"]  # on the gather thread, during the broadcast before: not summed


def _rss(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's resident set while a block runs."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def extra(self) -> int:
        return self.peak - self.base


class RawBroadcast:
    """The raw baseline: the model's bytes packed once into one flat uint8 buffer per bucket (the
    buckets `iter_buckets` makes at the engine's bucket size), broadcast to a receiver process
    that allocated its buffers once. `once()` times one pass; `rounds` passes in all."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int, rounds: int) -> None:
        from agentrl.inference.weight_group import join_group
        from agentrl.net import free_port
        from agentrl.weight_sync.buckets import iter_buckets

        with torch.no_grad():
            self.buffers = [
                torch.cat([t.reshape(-1).view(torch.uint8) for t in bucket.tensors])
                for bucket in iter_buckets(model.named_parameters(), bucket_bytes)
            ]
        port = free_port()
        sizes = ",".join(str(b.numel()) for b in self.buffers)
        self.receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(rounds), sizes])
        self.group = join_group("127.0.0.1", port, 0, 2, "raw", "gloo", 300)

    def once(self) -> float:
        start = time.perf_counter()
        for buffer in self.buffers:
            self.group.broadcast(buffer, 0)
        self.group.barrier()
        return time.perf_counter() - start

    def close(self) -> None:
        try:
            self.receiver.wait(60)
        finally:
            if self.receiver.poll() is None:
                self.receiver.kill()


def _vllm_pushes(weights: Any, model_dir: str, opts: argparse.Namespace) -> list[float]:
    """Seconds of each broadcast push into a real vLLM server (the first, warm-up, not counted)."""
    from agentrl.inference.config import InferenceConfig
    from agentrl.inference.vllm_launch import VLLMServer
    from agentrl.net import free_port
    from agentrl.weight_sync.config import BroadcastSyncConfig
    from agentrl.weight_sync.registry import create

    inference = InferenceConfig(type="vllm")
    with VLLMServer(model_dir, free_port(), inference) as server:
        config = BroadcastSyncConfig(bucket_mb=opts.bucket_mb, timeout_s=300)
        engine = create(config, inference.model_copy(update={"servers": [server.url]}))
        engine.init()
        try:
            pushes = [engine.push(weights, v) for v in range(1, opts.repeats + 2)]
            served = engine._bridge.run(engine.clients[server.url].get_weight_version(), timeout_s=30)
        finally:
            engine.close()
    if served != len(pushes) or any(p.servers_updated != 1 for p in pushes):
        raise RuntimeError(f"vLLM did not take every push (serving version {served} of {len(pushes)})")
    return [p.seconds for p in pushes[1:]]


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_for(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """A rank-`rank` LoRA adapter on every attention and MLP projection of `model`, named as PEFT
    saves one (`base_model.model.<module>.lora_A.weight`): what a LoRA learner of this model pushes."""
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
            prefix = f"base_model.model.{name}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=gen) * 0.01
    return tensors


def _lora_pushes(model: torch.nn.Module, inference: Any, opts: argparse.Namespace) -> dict[str, Any]:
    """Adapter pushes (`lora_mode: adapter`) of a rank-`--lora-rank` adapter of `model` into the
    server, through the same broadcast engine as the full pushes, the first one a warm-up."""
    from agentrl.config import BroadcastSyncConfig
    from agentrl.weight_sync.base import AdapterSpec, AdapterWeights
    from agentrl.weight_sync.registry import create

    tensors = adapter_for(model, opts.lora_rank)
    spec = AdapterSpec(opts.lora_rank, 2.0 * opts.lora_rank, LORA_TARGETS)
    weights = AdapterWeights(adapter=lambda: tensors.items(), merged=model.named_parameters, spec=spec)
    engine = create(BroadcastSyncConfig(bucket_mb=opts.bucket_mb, timeout_s=300), inference)
    engine.init()
    seconds, pushed = [], 0
    try:
        for version in range(1, opts.repeats + 2):
            stats = engine.push(weights, version)
            if stats.servers_updated != 1:
                raise RuntimeError(f"adapter push {version} did not commit on the server: {stats.outcomes}")
            if version > 1:
                seconds.append(stats.seconds)
            pushed = stats.bytes
    finally:
        engine.close()
    return {"seconds": seconds, "bytes": pushed}


WARMUP = 2
"""Rounds of ours and raw not counted: connections, allocations, and the server's receive buffers,
which reach their steady state at the second push (the first push's buffers become the weights,
the weights it replaced were not receive buffers, so the second push maps a fresh set)."""


def _interleaved(
    model: Any, weights: Any, inference: Any, opts: argparse.Namespace, server_pid: int
) -> dict[str, Any]:
    """Ours (pushing `weights`, the learner's) and raw (`model`'s bytes), taking turns within every
    repeat while the server stays alive, after `WARMUP` rounds of both that are not counted. The
    timed pushes run bare; the learner's memory is sampled in one more push after them (the
    sampling thread would otherwise weigh on ours and not on raw)."""
    from agentrl.weight_sync.config import BroadcastSyncConfig
    from agentrl.weight_sync.registry import create

    ours, raw, phases, round_trips = [], [], [], []
    engine = create(BroadcastSyncConfig(bucket_mb=opts.bucket_mb, timeout_s=300), inference)
    engine.init()
    baseline = RawBroadcast(model, int(opts.bucket_mb * (1 << 20)), opts.repeats + WARMUP)
    pushes = opts.repeats + WARMUP + 1
    try:
        for version in range(1, pushes + 1):
            if version == pushes:  # the memory sample, not timed
                with PeakRSS() as rss:
                    stats = engine.push(weights, version)
            else:
                stats = engine.push(weights, version)
                raw_s = baseline.once()
            if stats.servers_updated != 1:
                raise RuntimeError(f"push {version} did not commit on the server: {stats.outcomes}")
            if WARMUP < version < pushes:
                ours.append(stats.seconds)
                raw.append(raw_s)
                phases.append(stats.phases)
                round_trips.extend(stats.bucket_round_trips)
        return {
            "ours": ours, "raw": raw, "peaks": [rss.extra], "phases": phases, "round_trips": round_trips,
            "bucket": stats.peak_bucket_bytes, "pushed": stats.bytes, "buckets": stats.buckets, "raw_buckets": len(baseline.buffers),
            "packing": engine.packer.nbytes,  # the learner's packing buffers, kept between pushes
            "viewed": engine.packer.viewed // pushes, "packed": engine.packer.packed // pushes,
            "server_rss": _rss(server_pid),  # weights + the free receive buffers kept for the next push
        }  # fmt: skip
    finally:
        baseline.close()
        engine.close()


@contextlib.contextmanager
def _served(model_dir: Path) -> Iterator[tuple[Any, int]]:
    """An embedded server (`agentrl serve`, a child process) of `model_dir`, healthy: (its
    `InferenceConfig`, its pid); killed on the way out."""
    from agentrl.inference.config import InferenceConfig
    from agentrl.net import free_port, wait_healthy

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "serve", "--model", str(model_dir), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_healthy([url], [server])
        yield InferenceConfig(servers=[url]), server.pid
    finally:
        os.killpg(server.pid, 9)
        server.wait()


def main(args: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench sync")
    parser.add_argument("--preset", default="base100m", help="model size to push (tiny, small, base100m)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--vllm", action="store_true", help="also push into a real vLLM server (make vllm)")
    parser.add_argument(
        "--lora-rank", type=int, default=8, help="rank of the LoRA adapter push rows (0: none)"
    )
    opts = parser.parse_args(args)
    if opts.repeats < 1 or opts.bucket_mb < 1:
        parser.error("--repeats and --bucket-mb must be at least 1")
    exact_rss = fix_mmap_threshold()

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from agentrl.config import OptimConfig
    from agentrl.learner.registry import create as create_backend
    from agentrl.tiny_model import init_model
    from agentrl.weight_sync.config import DiskSyncConfig
    from agentrl.weight_sync.registry import create

    signal.signal(
        signal.SIGTERM, signal.default_int_handler
    )  # SIGTERM runs the finally that stops the server
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-sync-") as tmp:
        workdir = Path(tmp)
        model_dir = init_model(opts.preset, workdir / "model")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # the learner's actor, as `agentrl learner` builds it for a broadcast push (one rank)
        backend = create_backend("fsdp2")
        actor = backend.build("policy", model_dir, optim=OptimConfig(),
                              push_buckets=int(opts.bucket_mb * (1 << 20)))  # fmt: skip
        weights = functools.partial(backend.full_tensors, actor)
        # on a server of its own: the adapter's LoRA layers stay injected in the server that took
        # it, and would run in the full pushes' checks and loads, which raw never pays for
        lora = None
        if opts.lora_rank:
            with _served(model_dir) as (inference, _):
                lora = _lora_pushes(model, inference, opts)
        with _served(model_dir) as (inference, server_pid):
            side = _interleaved(model, weights, inference, opts, server_pid)
            ours, raw, peaks, phases, round_trips = (
                side[k] for k in ("ours", "raw", "peaks", "phases", "round_trips")
            )
            bucket, pushed, buckets, raw_buckets = (
                side[k] for k in ("bucket", "pushed", "buckets", "raw_buckets")
            )
            packing, server_rss = side["packing"], side["server_rss"]
            disk_engine = create(DiskSyncConfig(keep_last=1), inference, run_dir=workdir)
            disk_engine.init()
            try:
                # warmed up like the other two paths: the first push is not counted
                disk = [disk_engine.push(weights, 100 + i).seconds for i in range(opts.repeats + 1)][1:]
            finally:
                disk_engine.close()
        vllm = _vllm_pushes(weights, str(model_dir), opts) if opts.vllm else []
    dist.destroy_process_group()

    ours_s, raw_s, disk_s = statistics.median(ours), statistics.median(raw), statistics.median(disk)
    rows = [
        [
            "ours: the learner's actor, broadcast engine (pause, buckets, load, continue)",
            ours_s,
            nbytes / ours_s / 1e9,
        ],
        ["raw gloo broadcast, same bytes, one flat buffer per bucket", raw_s, nbytes / raw_s / 1e9],
        [
            "the learner's actor, disk engine (safetensors + /update_weights_from_disk)",
            disk_s,
            nbytes / disk_s / 1e9,
        ],
    ]
    if vllm:
        vllm_s = statistics.median(vllm)
        rows.append(["vLLM: broadcast engine into the worker extension", vllm_s, nbytes / vllm_s / 1e9])
    if lora:
        lora_s = statistics.median(lora["seconds"])
        rows.append([f"LoRA adapter push, rank {opts.lora_rank} ({lora['bytes'] / 1e6:.1f} MB)", lora_s,
                     lora["bytes"] / lora_s / 1e9])  # fmt: skip
    print_table(
        f"weight push of {nbytes / 1e6:.0f} MB ({opts.preset}), median of {opts.repeats}",
        ["path", "seconds", "GB/s"],
        rows,
    )
    phase_s = {name: statistics.median(p.get(name, 0.0) for p in phases) for name in PHASES + OVERLAPPED}
    phase_rows = [[name, 1e3 * phase_s[name], f"{100 * phase_s[name] / ours_s:.1f}%"] for name in PHASES]
    rest = ours_s - sum(phase_s[name] for name in PHASES)
    phase_rows.append(["(unaccounted)", 1e3 * rest, f"{100 * rest / ours_s:.1f}%"])
    phase_rows += [[f"{name} (gather thread, overlapped)", 1e3 * phase_s[name], "-"] for name in OVERLAPPED]
    phase_rows.append(["each bucket's round trip (median)", 1e3 * statistics.median(round_trips), "-"])
    print_table(f"our push by phase (median of {opts.repeats})", ["phase", "ms", "share"], phase_rows)
    print(
        f"buckets of a push sent as views of the weights (laid out back to back, no packing): "
        f"{side['viewed']}; packed: {side['packed']}; one tensor, sent as it is: "
        f"{buckets - side['viewed'] - side['packed']}"
    )
    print(
        f"peak extra resident memory during our push: {max(peaks) / 1e6:.1f} MB "
        f"(bucket {bucket / 1e6:.1f} MB; model {nbytes / 1e6:.0f} MB); packing buffers kept between pushes: "
        f"{packing / 1e6:.1f} MB (bound 3 buckets)"
        + ("" if exact_rss else " — a lower bound: mallopt is unavailable, freed memory may be reused")
    )
    print(
        f"server resident memory after the pushes: {server_rss / 1e6:.0f} MB (its weights and, kept for "
        f"the next push, free receive buffers of at most the model's {nbytes / 1e6:.0f} MB)"
    )
    emit(
        "sync",
        {
            "model_bytes": nbytes,
            "pushed_bytes": pushed,  # what our engine sent: the same tensors as the raw baseline's
            "push_s": ours_s,
            "raw_broadcast_s": raw_s,
            "disk_s": disk_s,
            "push_s_each": ours,
            "raw_broadcast_s_each": raw,
            "buckets": buckets,
            "raw_buckets": raw_buckets,
            "phase_s": phase_s,
            "bucket_round_trip_s": statistics.median(round_trips),
            "gb_per_s": nbytes / ours_s / 1e9,
            "peak_extra_rss_bytes": max(peaks),
            "peak_extra_rss_exact": exact_rss,
            "bucket_bytes": bucket,
            "pack_buffer_bytes": packing,
            "buckets_viewed": side["viewed"],  # per push: sent as views of the laid-out weights
            "buckets_packed": side["packed"],
            "server_rss_bytes": server_rss,
            **(
                {
                    "lora_rank": opts.lora_rank,
                    "lora_bytes": lora["bytes"],
                    "lora_push_s": statistics.median(lora["seconds"]),
                    "lora_push_s_each": lora["seconds"],
                }
                if lora
                else {}
            ),
        },
        {
            "vs_raw_broadcast": raw_s / ours_s,
            "vs_disk": disk_s / ours_s,
            **({"lora_vs_full_push": statistics.median(lora["seconds"]) / ours_s} if lora else {}),
            **(
                {
                    "vllm_push_s": statistics.median(vllm),
                    "vllm_vs_raw_broadcast": raw_s / statistics.median(vllm),
                }
                if vllm
                else {}
            ),
        },
    )
    return 0
