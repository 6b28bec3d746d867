"""The colocated loop: every rank generates, reshards and trains in turn, on the same devices.

    torchrun --nproc_per_node=2 -m agentrl.colocated.loop --config recipes/quickstart_colocated.yaml
    (what `agentrl run` starts for `mode: colocated`; see agentrl/colocated/launch.py)

Start-up (every rank, in this order, because each creates process groups): the hybrid layout
(FSDP2 over all S ranks for training; `colocated.tg`-way TP replicas, S/tg of them, for
generation), the meshes, the learner (the actor sharded by the HybridEngine's FSDP2 placement,
AdamW, LR schedule), the TP generation model whose parameters the HybridEngine binds to its
buffers, the replica's lock-step channel, and the engine on that module (no second copy of the
weights is ever loaded). Each replica's leader starts the engine thread.

One step, a short script:

    1. reshard: training shards -> generation buffers (all-gather inside each micro-DP group)
    2. generate: each replica's leader runs its share of the step's groups with the roller's agent
       loop (`run_episode`, the same envs, tools and rewards) on its engine; followers replay
    3. release: KV cache and generation buffers go (the training shards stay)
    4. share: every rank gets every group (all_gather_object); the tokens carry version v
    5. train: advantages, packing over the S ranks, recompute, forward/backward, AdamW
       (the learner's own functions); version v+1
    6. log: generation / reshard / training seconds, peak memory per rank, reward, staleness

Generation runs on the weights of version v and training consumes them at version v: the loop is
on-policy, every group has staleness 0, and TIS / decoupled PPO see ratios of ~1.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.config import AgentRLConfig
from agentrl.log import MetricsLogger, get_logger
from agentrl.types import Group

log = get_logger("colocated")


def build_learner(cfg: AgentRLConfig, meshes: Any) -> Any:
    """The learner's `Learner` through its backend seam, the actor sharded with the HybridEngine's
    FSDP2 placement (each parameter on its TP dim, so every training shard lies inside a
    generation shard)."""
    import functools

    from agentrl.hybrid.reshard import shard_training_model
    from agentrl.learner import backend as backends
    from agentrl.learner.loop import Learner, lr_lambda

    lc = cfg.learner
    if lc.loss.kl_coef > 0:
        raise ValueError(
            "learner.loss.kl_coef > 0 is not supported in mode: colocated (no reference model yet)"
        )
    if lc.loss.advantage == "gae":
        raise ValueError("learner.loss.advantage: gae is not supported in mode: colocated (no critic yet)")
    backend = backends.create(lc.backend)
    torch.manual_seed(lc.seed)
    schedule = lr_lambda(lc.schedule, lc.max_steps * lc.mini_batches)
    actor = backend.build("policy", lc.model_path, name="actor", optim=lc.optim, lr_lambda=schedule,
                          shard=functools.partial(shard_training_model, mesh=meshes.train))  # fmt: skip
    config = actor.module.config
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return Learner(lc, Path(cfg.run_dir), backend, actor, None, config.vocab_size, pad)


def _lockstep(meshes: Any) -> Any:
    """This rank's replica channel: a gloo group over its TP ranks (every rank creates all of them)."""
    from agentrl.colocated.lockstep import Lockstep

    mine = None
    for row in meshes.gen.mesh.tolist():
        group = dist.new_group(row, backend="gloo")
        if dist.get_rank() in row:
            mine = Lockstep(row, group)
    return mine


async def _generate_groups(
    cfg: AgentRLConfig, tasks: list[dict], engine: Any, make_env, renderer
) -> list[Group]:
    """The replica's groups: `group_size` episodes per task, all at once (the engine batches them)."""
    from agentrl.colocated.client import EngineClient
    from agentrl.rollers.agent_loop import run_episode

    client = EngineClient(engine)
    limit = asyncio.Semaphore(cfg.roller.max_concurrent_episodes)

    async def one(task: dict) -> Any:
        async with limit:
            return await run_episode(make_env(), task, client, renderer, cfg.roller)

    async def group(task: dict) -> Group:
        episodes = await asyncio.gather(*(one(task) for _ in range(cfg.roller.group_size)))
        return Group(list(episodes), prompt_id=str(task.get("id", "")))

    return list(await asyncio.gather(*(group(t) for t in tasks)))


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def run(cfg: AgentRLConfig) -> int:
    """Every rank: train `learner.max_steps` colocated steps; returns the final version."""
    from transformers import AutoTokenizer

    from agentrl.envs.registry import env_factory, load_env_class
    from agentrl.hybrid.layout import GenLayout, HybridLayout, TrainLayout
    from agentrl.hybrid.reshard import HybridEngine, build_meshes
    from agentrl.hybrid.tp import parallelize_generation_model
    from agentrl.inference.engine import Engine
    from agentrl.learner import fsdp
    from agentrl.learner.data import prepare_batch
    from agentrl.learner.loop import export, pack
    from agentrl.learner.train_step import optimizer_step
    from agentrl.rollers.chat import ChatRenderer
    from agentrl.rollers.tasks import TaskSource

    rank, world, device = fsdp.init_distributed()
    cc, lc = cfg.colocated, cfg.learner
    if world % cc.tg:
        raise ValueError(f"colocated.tg={cc.tg} must divide the {world} ranks")
    layout = HybridLayout(TrainLayout(d=world), GenLayout(tg=cc.tg, dg=world // cc.tg))
    meshes = build_meshes(layout, device.type)
    learner = build_learner(cfg, meshes)
    gen_model = parallelize_generation_model(learner.model.config, meshes.tp)
    hybrid = HybridEngine(learner.model, gen_model, layout, meshes)
    lock = _lockstep(meshes)
    tokenizer = AutoTokenizer.from_pretrained(lc.model_path)
    engine = Engine(lc.model_path, device=str(device), model=gen_model, tokenizer=tokenizer,
                    max_batch_size=cc.max_batch_size, replica=lock, cpu_threads=None)  # fmt: skip
    replicas = world // cc.tg
    replica_index = meshes.gen.mesh.tolist().index(lock.ranks)
    if lc.groups_per_step % replicas:
        raise ValueError(
            f"learner.groups_per_step={lc.groups_per_step} must split evenly over {replicas} replicas"
        )
    per_replica = lc.groups_per_step // replicas
    make_env = env_factory(cfg.env)
    tasks = TaskSource(
        cfg.roller.tasks, load_env_class(cfg.env.name), cfg.roller.seed, **cfg.roller.task_kwargs
    )
    renderer = ChatRenderer(tokenizer, make_env().tool_schemas or None)
    metrics = MetricsLogger(cfg.run_dir, "learner") if rank == 0 else None
    if lock.is_leader:
        engine.start()
    # one event loop for every step: asyncio.run() (Python 3.11) reprs its main task, results and
    # all, when it restores the SIGINT handler: ~50 ms per step of numpy array printing
    gen_loop = asyncio.new_event_loop()
    log.info("colocated: %d ranks, %d replica(s) of tg=%d, %d groups/step", world, replicas, cc.tg,
             lc.groups_per_step)  # fmt: skip
    try:
        while learner.version < lc.max_steps:
            # 1. reshard: training shards -> generation buffers
            t0 = time.perf_counter()
            stats = hybrid.to_generation()
            engine.weight_version = str(learner.version)
            t_reshard = time.perf_counter() - t0

            # 2. generate on the rank-local replica (leader schedules, followers replay)
            t0 = time.perf_counter()
            mine: list[Group] = []
            if lock.is_leader:
                first = (learner.version * replicas + replica_index) * per_replica
                chunk = [tasks[first + i] for i in range(per_replica)]
                mine = gen_loop.run_until_complete(_generate_groups(cfg, chunk, engine, make_env, renderer))
                engine.end_phase()
            else:
                engine.follow()
            t_gen = time.perf_counter() - t0

            # 3. release: KV cache (engine thread, between steps) and generation buffers
            t0 = time.perf_counter()
            if lock.is_leader:
                engine.call(lambda: engine.release(params=False)).result()
            hybrid.release()
            t_release = time.perf_counter() - t0

            # 4. share: every rank gets every group
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, mine)
            groups = [g for part in gathered for g in part]

            # 5. train with the learner's own steps
            t0 = time.perf_counter()
            batch = prepare_batch(groups, advantage=lc.loss.advantage, loss_agg=lc.loss.loss_agg,
                                  vocab_size=learner.vocab_size, learner_version=learner.version,
                                  mini_batches=lc.mini_batches, max_seq_tokens=lc.max_seq_tokens,
                                  overlong=lc.loss.overlong)  # fmt: skip
            plans = pack(learner, batch)
            steps = [
                optimizer_step(learner.backend, learner.actor, plan, lc, learner.version) for plan in plans
            ]
            t_train = time.perf_counter() - t0
            learner.version += 1
            learner.consumed_groups += len(groups)

            # 6. log
            peak: list[Any] = [None] * world
            dist.all_gather_object(peak, _peak_memory_bytes(device))
            if metrics is not None:
                m = {k: sum(s[k] for s in steps) / len(steps) for k in (steps[-1] if steps else {})}
                m.update(batch.metrics)
                m.update({"time/generation_s": t_gen, "time/reshard_s": t_reshard, "time/release_s": t_release,
                          "time/train_s": t_train, "reshard/collectives": stats.collectives,
                          "reshard/bytes": stats.bytes_out, "memory/peak_param_bytes": hybrid.peak_param_bytes,
                          "groups_consumed": learner.consumed_groups,
                          "staleness/max": max(g.staleness(learner.version - 1) for g in groups)})  # fmt: skip
                m.update({f"memory/peak_rss_bytes_rank{r}": v for r, v in enumerate(peak)})
                metrics.log(m, learner.version)
                log.info("version %d  reward %.3f  gen %.1fs  reshard %.2fs  train %.1fs", learner.version,
                         batch.metrics.get("reward/mean", math.nan), t_gen, t_reshard, t_train)  # fmt: skip
        export(learner)
    finally:
        gen_loop.close()
        if lock.is_leader:
            engine.stop()
        if metrics is not None:
            metrics.close()
    return learner.version


def main() -> int:
    import sys

    from agentrl.config import load_config

    args = sys.argv[1:]
    path = None
    if args[:1] == ["--config"]:
        path, args = args[1], args[2:]
    cfg = load_config(path, args, uses=("learner", "roller", "env"))
    run(cfg)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
