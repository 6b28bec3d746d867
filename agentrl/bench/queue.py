"""`agentrl bench queue`: the TransferQueue against raw ZeroMQ, Redis Streams and Ray, same bytes.

    agentrl bench queue [--total-mib 256] [--small-groups 20000] [--repeat 3] [--auth mac|none]
                        [--no-redis] [--no-ray] [--no-nixl]

For each payload size (4 KiB .. 16 MiB per group) a producer *process* sends groups and
this process receives them:
- ours: `ZmqProducer.put` (MAC on) -> `QueueServer` hosted here -> in-process consumer
  `get_batch` + `ack` (the learner's deployment);
- raw ZeroMQ: PUSH -> PULL of exactly the frames `encode_group` makes, `copy=False`;
- Redis: plain `redis-py` against a local redis-server, the same frames as one stream entry per
  group: the producer `XADD`s them (pipelined, flushed every `_batch(size)` groups, the receiver's
  batch), this process `XREADGROUP`s batches and `XACK`s (+ `XDEL`, so the stream stays bounded as
  our queue's does). That is what a team using Redis Streams directly would write, so it is the
  baseline our queue must beat to be worth its code;
- Ray: the group's arrays put into Ray's object store by a task (a streaming generator), `ray.get` here;
- NIXL: the array payloads over NIXL (UCX), ZeroMQ as control plane.
Throughput is counted from the producer's first send (once connected) to the last group
received, in MB/s (both ends are on this host, so they share a clock); raw, ours and Redis
run alternately `--repeat` times with the same group counts and each keeps its best (other jobs
share this machine); Ray also keeps the best of `--repeat` runs.
Ratios are
ours / baseline (higher is better); `vs_raw_zmq`, `vs_redis`, `vs_ray` and `nixl_vs_zmq`
are the lowest over payloads >= 1 MiB.

Each raw and ours run also records the CPU both processes spent per MiB (the receiver from
the producer's start to the last group, the producer over its sends, imports not counted):
`metrics.cpu_bound_vs_raw_zmq` = raw's CPU / ours (lowest over >= 1 MiB) is the ratio a
host whose cores are all busy allows, which is what a 2-core machine running both ends is.

One module past 500 lines on purpose: every contender's sender, receiver and timing sit side by
side, so a reader can check that the comparison is like for like.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from agentrl.bench.common import emit, print_table
from agentrl.types import Episode, Group
from agentrl.wire import encode_group

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20]
BYTES_PER_TOKEN = 13  # int32 token + uint8 mask + float32 logprob + int32 version
PRODUCER_MARK = "agentrl-bench-producer "


def _label(size: int) -> str:
    return f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB"


def _shape(size: int) -> tuple[int, int]:
    """(episodes, tokens per episode) of a group of ~`size` payload bytes."""
    n_eps = 1 if size < 64 << 10 else 8
    return n_eps, max(1, size // (BYTES_PER_TOKEN * n_eps))


def make_groups(size: int, count: int) -> list[Group]:
    """`count` groups of ~`size` payload bytes sharing one set of arrays (distinct ids)."""
    n_eps, tokens = _shape(size)
    episodes = [
        Episode(
            tokens=np.arange(tokens, dtype=np.int32) % 1000,
            loss_mask=np.ones(tokens, np.uint8),
            logprobs=np.zeros(tokens, np.float32),
            versions=np.zeros(tokens, np.int32),
        )
        for _ in range(n_eps)
    ]
    return [Group(episodes, group_id=f"{size}-{i}") for i in range(count)]


def payload_bytes(size: int) -> int:
    """The array bytes of one group from `make_groups(size, ...)` (a little under `size`)."""
    n_eps, tokens = _shape(size)
    return n_eps * tokens * BYTES_PER_TOKEN


def _count(size: int, total_mib: int, small_groups: int) -> int:
    """Groups sent at `size`: at least 32, so the 16 MiB row times more than a handful."""
    return small_groups if size <= 4 << 10 else max(32, (total_mib << 20) // size)


# ------------------------------------------------------------------ producer processes


def _worker(kind: str, address: str, size: int, count: int) -> None:
    """A producer process: connects, then sends `count` groups and reports (on stdout) when it
    started sending and the CPU it spent from then on."""
    groups = make_groups(size, count)
    if kind == "redis":
        _redis_worker(address, groups, size)
        return
    if kind == "raw":
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(address)
        recv_monitor_message(monitor)  # connected: the clock starts with the first send, as for ours
        sock.disable_monitor()
        monitor.close()
        started, cpu = time.time(), time.process_time()
        for group in groups:
            sock.send_multipart(encode_group(group), copy=False)
        sock.close(linger=-1)
        ctx.term()
        _report(started, time.process_time() - cpu)
        return

    async def run() -> None:
        from agentrl.queue import create
        from agentrl.queue.config import ZmqQueueConfig

        config = ZmqQueueConfig(address=address, nixl=kind == "nixl", auth=_auth())
        producer = create(config).producer()
        await producer.current_version()  # connected and answered once before the clock starts
        todo = iter(groups)

        async def roller() -> None:  # like a roller's episode loops: each puts its groups in turn
            for group in todo:
                await producer.put(group)

        started, cpu = time.time(), time.process_time()
        await asyncio.gather(*(roller() for _ in range(256)))
        producer.close()
        _report(started, time.process_time() - cpu)

    asyncio.run(run())


def _redis_worker(address: str, groups: list[Group], size: int) -> None:
    """The Redis baseline's producer: plain redis-py, one `XADD` per group (its frames as one
    field), pipelined and flushed every `_batch(size)` groups. `address` is `URL STREAM`."""
    import redis

    url, stream = address.split(" ")
    client = redis.Redis.from_url(url)
    client.ping()  # connected and answered once before the clock starts, as for ours
    started, cpu = time.time(), time.process_time()
    pipe, batch = client.pipeline(transaction=False), _batch(size)
    for i, group in enumerate(groups, 1):
        pipe.xadd(stream, {"data": b"".join(bytes(frame) for frame in encode_group(group))})
        if i % batch == 0 or i == len(groups):
            pipe.execute()
    client.close()
    _report(started, time.process_time() - cpu)


def _report(started: float, cpu_s: float) -> None:
    print(PRODUCER_MARK + json.dumps({"started": started, "cpu_s": cpu_s}), flush=True)


def _auth() -> str:
    """`--auth` of the run (the producer processes inherit it through the environment)."""
    return os.environ.get("AGENTRL_BENCH_QUEUE_AUTH", "mac")


def _spawn(kind: str, address: str, size: int, count: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "agentrl.bench.queue", "--worker", kind, address, str(size), str(count)]
    return subprocess.Popen(args, env=os.environ.copy(), stdout=subprocess.PIPE, text=True)


def _producer_report(proc: subprocess.Popen) -> dict[str, float]:
    """When the producer process started sending (wall clock) and its CPU seconds since."""
    out, _ = proc.communicate()
    marks = [line[len(PRODUCER_MARK) :] for line in out.splitlines() if line.startswith(PRODUCER_MARK)]
    if proc.returncode != 0 or not marks:
        raise RuntimeError(f"the producer process failed (exit {proc.returncode})")
    return json.loads(marks[-1])


class Run(NamedTuple):
    """One timed run, from the producer's first send (after it connected) to the last group
    received: MB/s, groups/s, and the CPU both processes spent per MiB over it."""

    mbps: float
    groups_per_s: float
    cpu_us_per_mib: float | None = None


def _run(started: float, last: float, count: int, size: int, cpu_s: float | None) -> Run:
    seconds, nbytes = max(last - started, 1e-9), count * payload_bytes(size)
    cpu = None if cpu_s is None else cpu_s / (nbytes / (1 << 20)) * 1e6
    return Run(nbytes / seconds / 1e6, count / seconds, cpu)


def _finish(proc: subprocess.Popen, cpu_start: float, count: int, size: int) -> Run:
    """The run, once this process has received its last group: clock stopped now, CPU of both
    processes (this one since `cpu_start`, the producer's as it reports)."""
    last, cpu = time.time(), time.process_time() - cpu_start
    report = _producer_report(proc)
    return _run(report["started"], last, count, size, cpu + report["cpu_s"])


# ------------------------------------------------------------------ receivers


def bench_raw(size: int, count: int) -> Run:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    cpu = time.process_time()
    proc = _spawn("raw", sock.getsockopt_string(zmq.LAST_ENDPOINT), size, count)
    for _ in range(count):
        sock.recv_multipart(copy=False)
    run = _finish(proc, cpu, count, size)
    sock.close()
    ctx.term()
    return run


def _batch(size: int) -> int:
    """Groups per `get_batch`: up to 8 MiB or 512 groups."""
    return max(1, min(512, (8 << 20) // size))


def _drain(consumer: Any, count: int, batch: int, proc: subprocess.Popen, size: int) -> Run:
    got, cpu = 0, time.process_time()
    while got < count:
        try:
            b = consumer.get_batch(
                min(batch, count - got), learner_version=0, max_staleness=1 << 30, timeout_s=5
            )
        except TimeoutError:
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"the producer process failed (exit {proc.returncode})") from None
            continue
        got += len(b)
        consumer.ack(b.group_ids)
    return _finish(proc, cpu, count, size)


def bench_ours(size: int, count: int, nixl: bool = False) -> Run:
    """Our queue (array payloads over NIXL with `nixl`), hosted in this process like the learner's."""
    from agentrl.queue import create
    from agentrl.queue.config import ZmqQueueConfig

    config = ZmqQueueConfig(address="tcp://127.0.0.1:*", capacity_groups=8192, auth=_auth(), nixl=nixl)
    backend = create(config)
    server = backend.server(groups_per_step=1, max_staleness=0).start()
    consumer = backend.consumer("bench", server=server)
    proc = _spawn("nixl" if nixl else "ours", server.endpoint, size, count)
    try:
        return _drain(consumer, count, _batch(size), proc, size)
    finally:
        proc.wait()
        consumer.close()
        server.stop()


def bench_redis(size: int, count: int, url: str) -> Run:
    """The Redis baseline's receiver: `XREADGROUP` up to `_batch(size)` entries at a time, then
    `XACK` + `XDEL` them in one pipelined round trip; a fresh stream per run."""
    import redis

    client = redis.Redis.from_url(url)
    stream = f"bench-{os.urandom(4).hex()}"
    client.xgroup_create(stream, "learner", id="0", mkstream=True)
    cpu = time.process_time()
    proc = _spawn("redis", f"{url} {stream}", size, count)
    got, batch = 0, _batch(size)
    try:
        while got < count:
            reply = client.xreadgroup(
                "learner", "rank0", {stream: ">"}, count=min(batch, count - got), block=5000
            )
            if not reply:
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"the producer process failed (exit {proc.returncode})")
                continue
            ids = [entry_id for entry_id, _fields in reply[0][1]]
            got += len(ids)
            pipe = client.pipeline(transaction=False)
            pipe.xack(stream, "learner", *ids)
            pipe.xdel(stream, *ids)
            pipe.execute()
        return _finish(proc, cpu, count, size)
    finally:
        proc.wait()
        client.delete(stream)
        client.close()


def bench_ray(size: int, count: int) -> Run:
    """Ray's object store with the same arrays: a task (another process) `put`s each group's
    arrays as it is made (a streaming generator: every yielded value goes into the object store),
    this process `ray.get`s each as soon as it exists (zero-copy from shared memory). Pipelined
    like the others and timed the same way, from the task's first put to the last group here."""
    import ray

    @ray.remote(num_returns="streaming")
    def produce(size: int, count: int) -> Iterator[tuple[float, list]]:
        arrays = [[e.tokens, e.loss_mask, e.logprobs, e.versions] for e in make_groups(size, 1)[0].episodes]
        started = time.time()
        for _ in range(count):
            yield started, arrays

    for ref in produce.remote(4096, 2):  # a warm worker, as the other baselines have
        ray.get(ref)
    started = 0.0
    for i, ref in enumerate(produce.remote(size, count)):
        started_there, _arrays = ray.get(ref)  # zero-copy views of the arrays in shared memory
        if i == 0:
            started = started_there
    return _run(started, time.time(), count, size, None)


def _start_redis() -> tuple[subprocess.Popen | None, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, "redis-server not installed"
    try:
        import redis
    except ImportError:
        return None, "the redis package is not installed (pip install 'agentrl[redis]')"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:  # answering before the first run
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.terminate()
                proc.wait()
                return (
                    None,
                    f"redis-server on port {port} did not answer within 10 s (exit {proc.returncode})",
                )
            time.sleep(0.1)


def _best(fn: Any, size: int, count: int, repeat: int) -> Run:
    return max((fn(size, count) for _ in range(max(1, repeat))), key=lambda r: r[0])


def _cpu_row(raw: Run, ours: Run) -> list[Any]:
    if not raw.cpu_us_per_mib or not ours.cpu_us_per_mib:
        return ["-", "-", "-"]
    return [
        round(raw.cpu_us_per_mib),
        round(ours.cpu_us_per_mib),
        round(raw.cpu_us_per_mib / ours.cpu_us_per_mib, 3),
    ]


def _min_ratio(ours: dict[int, float], base: dict[int, float]) -> float | None:
    ratios = [ours[s] / base[s] for s in base if s >= 1 << 20 and base[s] > 0]
    return round(min(ratios), 3) if ratios else None


def main(args: list[str]) -> int:
    if args[:1] == ["--worker"]:
        _worker(args[1], args[2], int(args[3]), int(args[4]))
        return 0
    opts = _parser().parse_args(args)
    os.environ.setdefault("AGENTRL_QUEUE_SECRET", os.urandom(16).hex())  # MAC on, as in production
    os.environ["AGENTRL_BENCH_QUEUE_AUTH"] = opts.auth
    sizes = [int(s) for s in opts.sizes.split(",")]
    results: dict[str, dict[int, Run]] = {"raw": {}, "ours": {}}
    skipped: dict[str, str] = {}
    _race(opts, sizes, results, skipped)
    baselines = (["redis"] if "redis" in results else []) + _run_baselines(opts, sizes, results, skipped)
    _print_tables(opts, sizes, results, baselines)
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    emit("queue", *_metrics(opts, sizes, results, skipped))
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrl bench queue", description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=256, help="Bytes sent per payload size (MiB).")
    parser.add_argument("--small-groups", type=int, default=20000, help="Groups sent at 4 KiB.")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="Payload bytes per group.")
    parser.add_argument(
        "--repeat", type=int, default=3, help="Runs of raw, ours, redis and ray per size (best kept)."
    )
    parser.add_argument(
        "--auth",
        choices=["mac", "none"],
        default="mac",
        help="queue.auth of ours (none: measure the MAC's cost).",
    )
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--no-nixl", action="store_true")
    return parser


def _race(opts: Any, sizes: list[int], results: dict[str, dict[int, Run]], skipped: dict[str, str]) -> None:
    """Raw, ours and (with a redis-server here) Redis, alternated `--repeat` times per size, each
    keeping its best into `results`: the machine is shared and noisy."""
    redis_proc, redis_url = (None, "--no-redis") if opts.no_redis else _start_redis()
    contenders: list[tuple[str, Any]] = [("raw", bench_raw), ("ours", bench_ours)]
    if redis_proc is None:
        skipped["redis"] = redis_url
    else:
        results["redis"] = {}
        contenders.append(("redis", lambda size, count: bench_redis(size, count, redis_url)))
    try:
        for size in sizes:
            count = _count(size, opts.total_mib, opts.small_groups)
            for _ in range(opts.repeat):
                for name, fn in contenders:
                    result = fn(size, count)
                    if size not in results[name] or result.mbps > results[name][size].mbps:
                        results[name][size] = result
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait()


def _print_tables(
    opts: Any, sizes: list[int], results: dict[str, dict[int, Run]], baselines: list[str]
) -> None:
    rows = []
    for size in sizes:
        row = [_label(size), _count(size, opts.total_mib, opts.small_groups)]
        for name in ("raw", "ours", *baselines):
            value = results.get(name, {}).get(size)
            row.append(round(value[0], 1) if value else "-")
        row.append(round(results["ours"][size].mbps / results["raw"][size].mbps, 3))
        rows.append(row)
    print_table(
        "TransferQueue throughput (MB/s of payload)",
        ["payload", "groups", "raw zmq", "ours", *baselines, "ours/raw"],
        rows,
    )
    print_table(
        "CPU per MiB moved, both processes (µs)",
        ["payload", "raw zmq", "ours", "raw/ours"],
        [[_label(size), *_cpu_row(results["raw"][size], results["ours"][size])] for size in sizes],
    )


def _metrics(
    opts: Any, sizes: list[int], results: dict[str, dict[int, Run]], skipped: dict[str, str]
) -> tuple[dict[str, Any], dict[str, float]]:
    """The JSON's raw figures of every contender, and the ratios (ours / baseline, lowest over
    payloads >= 1 MiB)."""
    mbps = {name: {s: v.mbps for s, v in per.items()} for name, per in results.items()}
    cpu = {name: {s: results[name][s].cpu_us_per_mib for s in sizes} for name in ("raw", "ours")}
    small = min(sizes)
    metrics: dict[str, Any] = {
        "small_groups_per_s": round(results["ours"][small].groups_per_s),
        "raw_zmq_small_groups_per_s": round(results["raw"][small].groups_per_s),
        "small_group_bytes": small,
        "groups_per_run": {_label(s): _count(s, opts.total_mib, opts.small_groups) for s in sizes},
        "repeat": opts.repeat,
        "auth": opts.auth,
        **{f"{name}_MBps_{_label(s)}": round(v, 1) for name, per in mbps.items() for s, v in per.items()},
        **{
            f"cpu_us_per_mib_{n}_{_label(s)}": round(v) for n, per in cpu.items() for s, v in per.items() if v
        },
        "cpu_bound_vs_raw_zmq": _min_ratio(
            {s: 1 / v for s, v in cpu["ours"].items() if v}, {s: 1 / v for s, v in cpu["raw"].items() if v}
        ),
        "skipped": skipped,
    }
    ratios = {"vs_raw_zmq": _min_ratio(mbps["ours"], mbps["raw"])}
    for name, key in (("redis", "vs_redis"), ("ray", "vs_ray")):
        if name in mbps:
            ratios[key] = _min_ratio(mbps["ours"], mbps[name])
    if "nixl" in mbps:
        ratios["nixl_vs_zmq"] = _min_ratio(mbps["nixl"], mbps["ours"])
    return metrics, {k: v for k, v in ratios.items() if v is not None}


def _run_baselines(opts: Any, sizes: list[int], results: dict, skipped: dict[str, str]) -> list[str]:
    big = [s for s in sizes if s >= 1 << 20] or sizes[-1:]
    names = []
    if opts.no_ray:
        skipped["ray"] = "--no-ray"
    else:
        try:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            try:
                results["ray"] = {  # best of --repeat, as raw and ours get
                    s: _best(bench_ray, s, _count(s, opts.total_mib, opts.small_groups), opts.repeat)
                    for s in big
                }
                names.append("ray")
            finally:
                ray.shutdown()
        except Exception as exc:  # ray missing or unable to start here: say so, don't fail the bench
            skipped["ray"] = f"{type(exc).__name__}: {exc}"
    if opts.no_nixl:
        skipped["nixl"] = "--no-nixl"
    else:
        try:
            results["nixl"] = {
                s: bench_ours(s, _count(s, opts.total_mib, opts.small_groups), nixl=True) for s in big
            }
            names.append("nixl")
        except Exception as exc:
            skipped["nixl"] = f"{type(exc).__name__}: {exc}"
    return names


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
