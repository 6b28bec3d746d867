"""`agentrl bench fanin`: one queue and many rollers, the fan-in of a large run, on loopback.

    agentrl bench fanin                                  # 100 and 1000 rollers, 64 servers, 20 s each
    agentrl bench fanin --rollers 20,60 --procs 2 --servers 8 --seconds 4   # what CI runs

Each roller is what a roller process holds: its own producer (its own lease, admission credits,
heartbeats) and episodes that each take `--turns` generation requests through a router to the
stand-in servers with a tool wait between them, then put a group. The rollers of this bench are
spread over `--procs` processes (one router per process, as one per roller process in a run);
the servers are `ScriptedServer`s (a real aiohttp server speaking SGLang's `/generate`, answering
at once), `--servers` of them in one process. The queue is hosted in this process as the learner
hosts it, and a learner thread takes `groups_per_step` groups, acks them and publishes the next
version at once (no training: the learner never holds the pipeline back, so what is measured is
the queue and admission). Every `--list-every-s` the live server list is rewritten with a new epoch
(alternately all servers and all but the last), as the launcher does when it scales.

Measured per run: admissions, puts and acks per second; the queue thread's CPU seconds per group
(from `/proc/self/task/<tid>/stat`) and its share of one core; the admission round trip (median
and p99, at the rollers); how long each list epoch took to reach every roller process; the
learner's wait for a full batch; and the queue's group account at the end (every admitted credit
spent, released, reclaimed or still leased; every group put trained or still queued).

The baseline is the smallest roller count in the same invocation: `ratios.cpu_per_group_<n>_vs_<n0>`
says how the queue's work per group grows with fan-in (1.0 is linear scaling of total work); the
admission p99 at each size is in the metrics. Rates are capped by this machine's cores, which the
rollers, servers and queue share: the JSON carries the raw counts and seconds of each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.bench.common import emit, print_table, stop_child
from agentrl.launch.procs import die_with_parent

CLK = os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime


def _group(version: int, turns: int) -> Any:
    import numpy as np

    from agentrl.types import Episode, Group

    n = 8 * turns
    ep = Episode(
        tokens=np.arange(n, dtype=np.int32),
        loss_mask=np.ones(n, np.uint8),
        logprobs=np.zeros(n, np.float32),
        versions=np.full(n, version, np.int32),
    )
    return Group([ep, ep])


# ------------------------------------------------------------------ the stand-in servers' process


def _serve(count: int, url_file: Path) -> None:
    from agentrl.bench.scripted_server import Reply, ScriptedServer

    async def run() -> None:
        servers = [
            ScriptedServer(lambda ids, params: Reply([5], finish="stop"), record=False) for _ in range(count)
        ]
        urls = [await s.start() for s in servers]
        tmp = url_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(urls))
        tmp.rename(url_file)
        await asyncio.Event().wait()

    asyncio.run(run())


# ------------------------------------------------------------------ a roller process


def _worker(
    address: str, rollers: int, seconds: float, turns: int, tool_s: float, servers_json: str, go: Path
) -> None:
    from agentrl.config import InferenceConfig, ZmqQueueConfig
    from agentrl.inference.router import from_config
    from agentrl.queue import create

    urls = json.loads(servers_json)
    stats: dict[str, Any] = {
        "admit_s": [],
        "puts": 0,
        "admissions": 0,
        "requests": 0,
        "errors": [],
        "epochs": {},
    }

    async def run() -> None:
        router = from_config(InferenceConfig(servers=urls), max_staleness=1000)
        backend = create(ZmqQueueConfig(address=address, auth=os.environ.get("AGENTRL_QUEUE_AUTH", "mac")))
        epochs: dict[int, float] = stats["epochs"]

        def on_servers(epoch: int, live: list[str]) -> None:
            if epoch not in epochs:
                epochs[epoch] = time.time()
            router.set_servers(epoch, live)

        print("READY", flush=True)  # imports done: the host opens the window once every process is
        while not go.exists():
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + seconds
        rng = random.Random(os.getpid())

        async def roller(i: int) -> None:
            producer = backend.producer(address=address, name=f"fanin-{os.getpid()}-{i}")
            producer.on_servers = on_servers
            try:
                while time.monotonic() < deadline:
                    t0 = time.perf_counter()
                    try:  # credits come back as the learner trains; none left to wait for at the end
                        admission = await asyncio.wait_for(
                            producer.acquire_start(1), deadline - time.monotonic()
                        )
                    except TimeoutError:
                        break
                    stats["admit_s"].append(time.perf_counter() - t0)
                    stats["admissions"] += 1
                    for _ in range(turns):
                        await router.generate(
                            [1, 2, 3], {"max_new_tokens": 1}, session_id=f"{os.getpid()}-{i}"
                        )
                        stats["requests"] += 1
                        await asyncio.sleep(rng.expovariate(1 / tool_s) if tool_s > 0 else 0)
                    if time.monotonic() >= deadline:
                        await producer.release_start(1)
                        break
                    await producer.put(_group(admission.version, turns))
                    stats["puts"] += 1
            except Exception as exc:  # reported: the bench fails on any
                stats["errors"].append(f"{type(exc).__name__}: {exc}")
            finally:
                producer.close()

        await asyncio.gather(*(roller(i) for i in range(rollers)))
        await router.close()

    asyncio.run(run())
    admit = sorted(stats.pop("admit_s"))
    stats["admit_p50_s"] = admit[len(admit) // 2] if admit else None
    stats["admit_p99_s"] = admit[int(len(admit) * 0.99)] if admit else None
    print(json.dumps(stats), flush=True)


# ------------------------------------------------------------------ the host: queue, learner, list


class _Learner(threading.Thread):
    """Takes `g` groups, acks them, publishes the next version; records how long it waited."""

    def __init__(self, consumer: Any, g: int, k: int) -> None:
        super().__init__(daemon=True)
        self.consumer, self.g, self.k = consumer, g, k
        self.dropped = 0
        self.version = 0
        self.acked = 0
        self.waited_s = 0.0
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            t0 = time.perf_counter()
            try:
                batch = self.consumer.get_batch(self.g, self.version, self.k, timeout_s=0.5)
            except TimeoutError:
                self.waited_s += time.perf_counter() - t0
                continue
            self.waited_s += time.perf_counter() - t0
            self.consumer.ack(batch.group_ids)
            self.acked += len(batch)
            self.dropped += batch.dropped_stale
            self.version += 1
            self.consumer.publish_version(self.version)


def _tail(logs: list[Path]) -> str:
    return "\n".join(f"{log.name}: {log.read_text()[-1500:]}" for log in logs if log.exists())


class _LiveList:
    """The launcher's side of the live list: the file, rewritten with a new epoch on demand
    (alternately every server and all but the last), and when each epoch was written."""

    def __init__(self, path: Path, urls: list[str]) -> None:
        from agentrl.inference import server_list

        self.path, self.urls, self._write = path, urls, server_list.write
        self.epoch = 0
        self.written: dict[int, float] = {}
        self.bump()

    def bump(self) -> None:
        self.epoch += 1
        self._write(self.path, self.epoch, self.urls if self.epoch % 2 else self.urls[:-1])
        self.written[self.epoch] = time.time()

    def reached(self, reports: list[dict]) -> tuple[float | None, list[int]]:
        """The slowest epoch's time to reach every roller process, and the epochs some never saw."""
        lags, missed = [], []
        for epoch, at in self.written.items():
            if epoch == 1:
                continue
            seen = [r["epochs"].get(str(epoch)) for r in reports]
            if any(x is None for x in seen):
                missed.append(epoch)
            else:
                lags.append(max(seen) - at)
        return (max(lags) if lags else None), missed


def _spawn_rollers(opts: argparse.Namespace, rollers: int, endpoint: str, urls: list[str], tmp: Path):
    """The roller processes, started and past their imports (each printed READY); their logs."""
    per = [rollers // opts.procs + (1 if i < rollers % opts.procs else 0) for i in range(opts.procs)]
    go = tmp / f"go-{rollers}"
    logs = [tmp / f"worker-{rollers}-{i}.log" for i in range(len(per))]
    procs = []
    for n, log in zip(per, logs, strict=True):
        if n:
            cmd = [sys.executable, "-m", "agentrl.bench.fanin", "--worker", endpoint, str(n),
                   str(opts.seconds), str(opts.turns), str(opts.tool_s), json.dumps(urls), str(go)]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                          start_new_session=True, preexec_fn=die_with_parent))  # fmt: skip
    for p in procs:
        if p.stdout.readline().strip() != "READY":
            p.wait()
            raise RuntimeError(f"a roller process did not start: {_tail(logs)}")
    return procs, logs, go


def _reports(procs: list[subprocess.Popen], logs: list[Path]) -> list[dict]:
    reports = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0 or not out.strip():
            raise RuntimeError(f"a roller process failed ({p.returncode}): {_tail(logs)}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _one_run(opts: argparse.Namespace, rollers: int, urls: list[str], tmp: Path) -> dict[str, Any]:
    from agentrl.config import ZmqQueueConfig
    from agentrl.queue import create
    from agentrl.queue.account import invariant_residuals

    live = _LiveList(tmp / f"servers-{rollers}.json", urls)
    config = ZmqQueueConfig(address="tcp://127.0.0.1:*", capacity_groups=1 << 16,
                            auth=os.environ.get("AGENTRL_QUEUE_AUTH", "mac"))  # fmt: skip
    backend = create(config)
    g = opts.groups_per_step or max(8, -(-rollers // (opts.k + 1)))  # auto: a credit for every roller
    server = backend.server(groups_per_step=g, max_staleness=opts.k, servers_file=live.path).start()
    consumer = backend.consumer("fanin", server=server)
    learner = _Learner(consumer, g, opts.k)
    learner.start()
    procs, logs, go = _spawn_rollers(opts, rollers, server.endpoint, urls, tmp)
    queue_tid = server._thread.native_id
    go.touch()
    cpu0, t0 = _thread_cpu_s(queue_tid), time.monotonic()
    acked0, waited0 = learner.acked, learner.waited_s
    next_list = t0 + opts.list_every_s
    while any(p.poll() is None for p in procs):
        if not learner.is_alive() or time.monotonic() > t0 + opts.seconds + 120:
            for p in procs:
                stop_child(p, 5)
            raise RuntimeError("the learner thread died or the rollers did not stop: " + _tail(logs))
        if time.monotonic() >= next_list and time.monotonic() - t0 < opts.seconds - 1:
            live.bump()
            next_list += opts.list_every_s
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    cpu = _thread_cpu_s(queue_tid) - cpu0
    waited = learner.waited_s - waited0
    reports = _reports(procs, logs)
    time.sleep(0.5)  # the learner takes the last full batches
    learner.stop_flag.set()
    learner.join(5)
    metrics = server.metrics()
    credits, groups = invariant_residuals(metrics)
    consumer.close()
    server.stop()
    lag, missed = live.reached(reports)
    puts = sum(r["puts"] for r in reports)
    return {
        "rollers": rollers,
        "groups_per_step": g,
        "seconds": elapsed,
        "admissions": sum(r["admissions"] for r in reports),
        "puts": puts,
        "requests": sum(r["requests"] for r in reports),
        "acked": learner.acked - acked0,
        "dropped_stale": learner.dropped,
        "learner_steps": learner.version,
        "learner_wait_share": min(1.0, waited / max(elapsed, 1e-9)),
        "queue_cpu_s": cpu,
        "queue_cpu_per_group_ms": 1e3 * cpu / max(puts, 1),
        "queue_core_share": cpu / max(elapsed, 1e-9),
        "admit_p50_s": statistics.median(r["admit_p50_s"] or 0 for r in reports),
        "admit_p99_s": max(r["admit_p99_s"] or 0 for r in reports),
        "list_epochs": live.epoch - 1,
        "list_lag_max_s": lag,
        "list_epochs_missed": missed,
        "errors": [e for r in reports for e in r["errors"]],
        "account_residuals": {"credits": credits, "groups": groups, "leased_at_end": metrics.get("leased")},
        "queue": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
    }


def main(args: list[str]) -> int:
    if args and args[0] == "--worker":
        address, rollers, seconds, turns, tool_s, urls, go = args[1:8]
        _worker(address, int(rollers), float(seconds), int(turns), float(tool_s), urls, Path(go))
        return 0
    if args and args[0] == "--serve":
        _serve(int(args[1]), Path(args[2]))
        return 0
    p = argparse.ArgumentParser(prog="agentrl bench fanin", description=__doc__.splitlines()[0])
    p.add_argument(
        "--rollers", default="100,1000", help="roller counts, comma-separated; the first is the baseline"
    )
    p.add_argument("--procs", type=int, default=4, help="processes the rollers are spread over")
    p.add_argument("--servers", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--turns", type=int, default=2, help="generation requests per episode")
    p.add_argument("--tool-s", type=float, default=0.2, help="mean tool wait between turns (exponential)")
    p.add_argument(
        "--groups-per-step", type=int, default=0,
        help="the learner's batch; 0: enough that (k+1) steps' admission gives every roller a credit",
    )  # fmt: skip
    p.add_argument("--k", type=int, default=2, help="max_staleness of the queue's admission")
    p.add_argument("--list-every-s", type=float, default=2.0)
    opts = p.parse_args(args)
    counts = [int(x) for x in opts.rollers.split(",")]
    os.environ.setdefault("AGENTRL_QUEUE_SECRET", os.urandom(16).hex())  # MAC on, as in a run
    runs = []
    with tempfile.TemporaryDirectory(prefix="agentrl-bench-fanin-") as tmp:
        url_file = Path(tmp) / "urls.json"
        serve = subprocess.Popen(
            [sys.executable, "-m", "agentrl.bench.fanin", "--serve", str(opts.servers), str(url_file)],
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        try:
            deadline = time.monotonic() + 120
            while not url_file.exists():
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stand-in servers did not start")
                time.sleep(0.1)
            urls = json.loads(url_file.read_text())
            runs = [_one_run(opts, n, urls, Path(tmp)) for n in counts]
        finally:
            stop_child(serve, 10)
    rows = [
        [r["rollers"], r["admissions"] / r["seconds"], r["puts"] / r["seconds"], r["acked"] / r["seconds"],
         r["queue_cpu_per_group_ms"], r["queue_core_share"], r["admit_p50_s"] * 1e3, r["admit_p99_s"] * 1e3,
         r["list_lag_max_s"], r["learner_wait_share"], len(r["errors"])]
        for r in runs
    ]  # fmt: skip
    print_table(
        f"fan-in: {opts.servers} stand-in servers, {opts.procs} roller processes, {opts.seconds:.0f} s per size",
        ["rollers", "admits/s", "puts/s", "acks/s", "queue CPU ms/group", "queue core", "admit p50 ms",
         "admit p99 ms", "list lag s", "learner wait", "errors"],
        rows,
    )  # fmt: skip
    base = runs[0]
    ratios = {
        f"cpu_per_group_{r['rollers']}_vs_{base['rollers']}": r["queue_cpu_per_group_ms"]
        / max(base["queue_cpu_per_group_ms"], 1e-9)
        for r in runs[1:]
    }
    emit("fanin", {"runs": runs, "servers": opts.servers, "procs": opts.procs}, ratios)
    bad = [r["rollers"] for r in runs if r["errors"] or any(r["account_residuals"].values())]
    if bad:
        print(f"errors or an unbalanced group account at {bad} rollers (see the JSON)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
