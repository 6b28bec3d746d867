"""Entry point of `agentrl learner`: one process, or one rank of a torchrun job.

    agentrl learner --config recipes/quickstart.yaml
    agentrl learner --config recipes/quickstart.yaml --queue.standalone true --queue.address tcp://q:5555
    torchrun --nproc_per_node 2 -m agentrl learner --config learner.yaml --resume

Start-up order: process group and FSDP2 model (every rank) → on rank 0 the TransferQueue
(hosted in-process for `queue.type: zmq`, the default; with `queue.standalone` a
consumer of the `agentrl queue` at `queue.address`; Redis needs no server) and its consumer,
the metrics sinks and the resolved config → the loop. Rank 0 alone reads the queue and
broadcasts each batch to the other ranks, which then balance it by tokens; so the ranks
always train on one batch in step.

The run has an id (`<run_dir>/run_id`, made on the first start and kept across `--resume`); a
hosted queue serves it, so a roller left over from another run is refused.

Shutdown: SIGTERM and SIGINT ask the loop to stop at the next step boundary (a second signal
interrupts at once); the loop saves its final checkpoint. A finished run then tells the queue
(`finish`: rollers exit cleanly) and waits a little for the rollers to leave. Then the queue's
final account (`queue_final.json`), consumer and queue server closed, the process group
destroyed, output flushed and the process ended with os._exit (gloo processes can abort in
interpreter teardown after all their work is done).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger

log = get_logger("learner.main")


def run_id(cfg: AgentRLConfig, resume: bool) -> str:
    """`queue.run_id`, else the id kept in `<run_dir>/run_id` (a fresh start makes a new one)."""
    if cfg.queue.type == "zmq" and cfg.queue.run_id:
        return cfg.queue.run_id
    path = Path(cfg.run_dir) / "run_id"
    if resume and path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = os.urandom(6).hex()
    path.write_text(new + "\n")
    return new


def open_queue(cfg: AgentRLConfig, resume: bool = False) -> tuple[Any, Any]:
    """(consumer, hosted server or None) for rank 0."""
    from agentrl.inference import server_list
    from agentrl.queue.registry import create

    backend = create(cfg.queue)
    server = None
    servers_file = server_list.from_env()  # the launcher's live list, handed on to the rollers
    per_token = cfg.learner.staleness == "token"
    hello = {"gps": cfg.learner.groups_per_step, "ms": cfg.max_staleness, "pt": int(per_token)}
    if cfg.queue.type != "zmq" or cfg.queue.standalone:
        if cfg.queue.type != "zmq":
            # the run's admission window in `<stream>:state` (Redis is the server): without it no
            # roller is ever admitted
            backend.server(
                groups_per_step=cfg.learner.groups_per_step, max_staleness=cfg.max_staleness
            ).start().stop()
            consumer = backend.consumer("rank0", ledger=Path(cfg.run_dir) / "queue_ledger.jsonl")
            consumer.per_token_staleness = per_token
        else:
            consumer = backend.consumer("rank0", hello=hello)
            consumer.per_token_staleness = per_token
            log.info("TransferQueue: consuming from the standalone queue at %s (run %s)", cfg.queue.address,
                     consumer.run_id)  # fmt: skip
        if servers_file is not None:  # the queue is not ours: we hand the list on (server_list.Publisher)
            consumer.follow_servers(servers_file)
        return consumer, None
    wal_dir = cfg.queue.wal_dir or str(Path(cfg.run_dir) / "queue_wal")
    server = backend.server(
        groups_per_step=cfg.learner.groups_per_step,
        max_staleness=cfg.max_staleness,
        wal_dir=wal_dir,
        run_id=run_id(cfg, resume),
        ledger=Path(cfg.run_dir) / "queue_ledger.jsonl",
        servers_file=servers_file,
        per_token_staleness=per_token,
    )
    server.start()
    log.info("TransferQueue listening on %s (run %s)", cfg.queue.address, server.run_id)
    consumer = backend.consumer("rank0", server=server, hello=hello)
    consumer.per_token_staleness = per_token
    return consumer, server


def open_prometheus(cfg: AgentRLConfig, server: Any) -> tuple[Any, list]:
    """Rank 0's Prometheus endpoints (`prometheus.learner_port`, and `prometheus.queue_port` for the
    queue it hosts): (the learner's exporter or None, the endpoints to stop at the end)."""
    ports = cfg.prometheus
    if ports.learner_port is None and (server is None or ports.queue_port is None):
        return None, []
    from agentrl.observe.prometheus import LearnerExporter, QueueCollector, serve

    exporter = LearnerExporter() if ports.learner_port is not None else None
    endpoints = [serve(exporter, ports.learner_port, cfg.run_dir, "learner")] if exporter else []
    if server is not None and ports.queue_port is not None:
        endpoints.append(serve(QueueCollector(server), ports.queue_port, cfg.run_dir, "queue"))
    return exporter, endpoints


def open_weight_sync(cfg: AgentRLConfig, rank: int) -> Any:
    """The checkpoint engine pushing to `inference.servers` (every rank joins the FSDP gathers);
    with `learner.lora` and `lora_mode: adapter`, refuses before training an adapter a server cannot
    load (`AdapterLimitError` naming the server and its limit)."""
    from agentrl.inference import server_list
    from agentrl.weight_sync.base import pushed_adapter
    from agentrl.weight_sync.registry import create

    # a LoRA learner pushing adapters: `init` checks every server can load them (rank, modules)
    adapter = pushed_adapter(cfg.learner.lora, cfg.weight_sync.lora_mode, cfg.learner.model_path)
    engine = create(cfg.weight_sync, cfg.inference, rank=rank, run_dir=cfg.run_dir,
                    servers_file=server_list.from_env(), adapter=adapter)  # fmt: skip
    engine.init()
    return engine


def push_buckets(cfg: AgentRLConfig) -> int | None:
    """The broadcast weight push's bucket size in bytes, when the actor's full weights are pushed
    that way (the learner then lays its weights out in those buckets); else None."""
    sync = cfg.weight_sync
    if sync.type != "broadcast" or (cfg.learner.lora is not None and sync.lora_mode == "adapter"):
        return None
    return int(sync.bucket_mb * (1 << 20))


def _stop_on_signals() -> tuple[threading.Event, list[int]]:
    """SIGTERM / SIGINT set the returned event (the loop stops at a step boundary); a second one
    raises KeyboardInterrupt. The list receives the signal numbers."""
    stop, received = threading.Event(), []

    def handler(signum: int, frame: object) -> None:
        received.append(signum)
        if stop.is_set():
            raise KeyboardInterrupt
        log.warning("%s: stopping after the current step (again to interrupt at once)",
                    signal.Signals(signum).name)  # fmt: skip
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop, received


def _finish_run(cfg: AgentRLConfig, consumer: Any, server: Any) -> None:
    """Tell the queue the run is over, and give the rollers a moment to hear it and leave."""
    consumer.finish()
    q = cfg.queue

    def leases() -> int:
        return server.live_leases() if server is not None else int(consumer.metrics().get("leases", 0))

    deadline = time.monotonic() + q.roller_lease_s + 2 * q.heartbeat_s
    while leases() and time.monotonic() < deadline:
        time.sleep(0.2)
    if leases():
        log.warning("%d roller(s) did not leave within %.0fs of the run's end", leases(),
                    q.roller_lease_s + 2 * q.heartbeat_s)  # fmt: skip


def write_final(run_dir: Path, final: dict[str, Any]) -> None:
    (run_dir / "queue_final.json").write_text(json.dumps(final, indent=1, default=str))


def _quietly(what: str, fn: Any, *args: Any) -> None:
    """`fn(*args)` in the shutdown path: an exception is logged (naming `what`), not raised."""
    try:
        fn(*args)
    except Exception as exc:
        log.error("%s failed: %s: %s", what, type(exc).__name__, exc)


def main(cfg: AgentRLConfig, resume: bool = False, weight_sync: Any = None) -> int:
    """Train until `learner.max_steps`; returns a process exit code."""
    import torch.distributed as dist

    from agentrl.config import save_resolved
    from agentrl.learner.backend import NonFiniteError
    from agentrl.learner.checkpoint import CheckpointError
    from agentrl.learner.loop import build_learner, run
    from agentrl.queue.base import QueueError

    stop, received = _stop_on_signals()
    learner = build_learner(cfg.learner, cfg.run_dir, push_buckets=push_buckets(cfg))
    consumer = server = metrics = exporter = None
    endpoints: list = []
    code, final = 0, None
    if weight_sync is None and cfg.inference.servers:
        weight_sync = open_weight_sync(cfg, learner.rank)
    try:
        if learner.rank == 0:
            log.info("learner: %d FSDP2 rank(s) on %s, model %s", learner.world_size, learner.device,
                     cfg.learner.model_path)  # fmt: skip
            save_resolved(cfg)
            consumer, server = open_queue(cfg, resume)
            metrics = MetricsLogger.from_config(cfg.run_dir, "learner", cfg.learner.logging)
            exporter, endpoints = open_prometheus(cfg, server)
        version = run(
            learner,
            consumer,
            cfg.max_staleness,
            weight_sync,
            metrics,
            resume_from_checkpoint=resume,
            stop=stop,
            exporter=exporter,
        )
        if stop.is_set():
            log.warning("stopped at version %d by %s; resumable with --resume", version,
                        signal.Signals(received[0]).name)  # fmt: skip
            code = 128 + received[0]
        else:
            log.info("learner done at version %d; HF checkpoint in %s", version,
                     Path(cfg.run_dir) / "hf" / "latest")  # fmt: skip
            if consumer is not None:
                _finish_run(cfg, consumer, server)
        if consumer is not None:
            final = server.metrics() if server is not None else consumer.metrics()
    except (QueueError, CheckpointError, NonFiniteError) as exc:
        log.error("%s", exc)
        code = 1
    except KeyboardInterrupt:
        log.warning("interrupted; the latest checkpoint is resumable with --resume")
        code = 130
    finally:
        # each step on its own: a failure here (the disk that filled up during a checkpoint is still
        # full) is logged after the error that ended the run, never instead of it
        for closeable in (consumer, metrics, weight_sync):
            if closeable is not None:
                _quietly(f"closing the {type(closeable).__name__}", closeable.close)
        for endpoint in endpoints:
            _quietly("stopping a Prometheus endpoint", endpoint.stop)
        if server is not None:
            _quietly("stopping the queue server", server.stop)
            final = server.metrics()
        if final is not None:
            # the queue's final account: every group put is trained on, dropped (counted) or left queued
            _quietly("writing queue_final.json", write_final, Path(cfg.run_dir), final)
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def exit_process(code: int) -> None:
    """Flush and leave without interpreter teardown (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
