"""Entry point of `agentrl learner`: one process, or one rank of a torchrun job.

    agentrl learner --config recipes/quickstart.yaml
    torchrun --nproc_per_node 2 -m agentrl learner --config learner.yaml --resume

Start-up order: process group and FSDP2 model (every rank) → on rank 0 the TransferQueue
(hosted in-process for `queue.type: zmq`, as DESIGN.md's default; Redis needs no server) and
its consumer, the metrics sinks and the resolved config → the loop. Rank 0 alone reads the
queue and broadcasts each batch to the other ranks, which then balance it by tokens; so the
ranks always train on one batch in step. Shutdown: the loop's final checkpoint and export,
then consumer and queue server closed, the process group destroyed, output flushed and the
process ended with os._exit (gloo processes can abort in interpreter teardown after all their
work is done).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger

log = get_logger("learner.main")


def open_queue(cfg: AgentRLConfig) -> tuple[Any, Any]:
    """(consumer, hosted server or None) for rank 0."""
    from agentrl.queue.base import create

    backend = create(cfg.queue)
    server = None
    if cfg.queue.type == "zmq":
        wal_dir = cfg.queue.wal_dir or str(Path(cfg.run_dir) / "queue_wal")
        server = backend.server(
            groups_per_step=cfg.learner.groups_per_step, max_staleness=cfg.max_staleness, wal_dir=wal_dir
        )
        server.start()
        log.info("TransferQueue listening on %s", cfg.queue.address)
    return backend.consumer("rank0", server=server), server


def open_weight_sync(cfg: AgentRLConfig, rank: int) -> Any:
    """The checkpoint engine pushing to `inference.servers` (every rank joins the FSDP gathers)."""
    from agentrl.weight_sync.base import create

    engine = create(cfg.weight_sync, cfg.inference, rank=rank, run_dir=cfg.run_dir)
    engine.init()
    return engine


def main(cfg: AgentRLConfig, resume: bool = False, weight_sync: Any = None) -> int:
    """Train until `learner.max_steps`; returns a process exit code."""
    import torch.distributed as dist

    from agentrl.config import save_resolved
    from agentrl.learner.loop import build_learner, run

    learner = build_learner(cfg.learner, cfg.run_dir)
    consumer = server = metrics = None
    code = 0
    if weight_sync is None and cfg.inference.servers:
        weight_sync = open_weight_sync(cfg, learner.rank)
    try:
        if learner.rank == 0:
            log.info("learner: %d FSDP2 rank(s) on %s, model %s", learner.world_size, learner.device,
                     cfg.learner.model_path)  # fmt: skip
            save_resolved(cfg)
            consumer, server = open_queue(cfg)
            metrics = MetricsLogger(
                cfg.run_dir, "learner", cfg.learner.tensorboard, cfg.learner.wandb_project
            )
        version = run(
            learner, consumer, cfg.max_staleness, weight_sync, metrics, resume_from_checkpoint=resume
        )
        log.info(
            "learner done at version %d; HF checkpoint in %s", version, Path(cfg.run_dir) / "hf" / "latest"
        )
    except KeyboardInterrupt:
        log.warning("interrupted; the latest checkpoint is resumable with --resume")
        code = 130
    finally:
        for closeable in (consumer, metrics, weight_sync):
            if closeable is not None:
                closeable.close()
        if server is not None:
            server.stop()
            # the queue's final account: every group put is trained on, dropped (counted) or left queued
            final = Path(cfg.run_dir) / "queue_final.json"
            final.write_text(json.dumps(server.metrics(), indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def exit_process(code: int) -> None:
    """Flush and leave without interpreter teardown (see the module docstring)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
