"""The colocated loop: every rank generates, reshards and trains in turn, on the same devices.

    torchrun --nproc_per_node=2 -m agentrl colocated --config recipes/quickstart_colocated.yaml
    (what `agentrl run` starts for `mode: colocated`: agentrl/launch/colocated.py, or one Ray
    placement group with `launcher.type: ray`)

Start-up (`ColocatedRank`, every rank, in this order, because each creates process groups): the
hybrid layout (training: `colocated.t`-way tensor parallel times FSDP2 over the S/t dp ranks, a
(dp, tp) mesh, or FSDP2 over all S ranks at t = 1; generation: `colocated.tg`-way TP replicas,
S/tg of them), the meshes, the learner (`learner.loop.build_learner`: the actor sharded by the
HybridEngine's training layout, AdamW, LR schedule, data parallel over the dp mesh:
hybrid/backend.py; the frozen reference with `loss.kl_coef > 0`, the critic with its own AdamW
with `loss.advantage: gae`, both FSDP2 over all ranks, never resharded; with `learner.backend:
megatron` all three are the Megatron backend's, TP over every rank: `megatron_layout`), the TP generation model
whose parameters the HybridEngine binds to its buffers, the replica's lock-step channel, and the
engine on that module (no second copy of the weights is ever loaded). Each replica's leader
starts the engine thread.

One step, a short script (`ColocatedRank.generate`, then `.train`):

    1. reshard: training shards -> generation buffers (all-gather inside each micro-DP group;
       with `learner.lora`, the frozen base at the first reshard only, then the adapters alone:
       `lora_generation`; with `weight_sync.lora_mode: merged`, base and adapters every step,
       merged on the generation side)
    2. generate: each replica's leader runs its share of the step's groups with the roller's own
       group code (one `Roller` for the run against an in-process `StepProducer`: the same envs,
       tools, rewards, reward model, ReMax greedy episode, dynamic sampling) on its engine;
       followers replay. With `colocated.partial_rollout` more groups run than the step takes,
       and the step is cut once it has its groups: the unfinished episodes keep their tokens
       (and versions) and go on in the next step, after its reshard
    3. release: KV cache and generation buffers go (the training shards stay, and with LoRA the
       base's generation buffers)
    4. share: every rank gets every group (all_gather_object); the tokens carry version v
    5. train: the learner's step (`learner.step`: advantages, packing over the S/t dp ranks, the t
       ranks of a TP group getting the same micro-batches, recompute, GAE, forward/backward,
       AdamW); version v+1 when the step was applied (a skipped step is counted, as in the
       decoupled loop)
    6. log: generation / reshard / training seconds, reshard bytes, peak memory per rank,
       reward, staleness
    7. checkpoint and export every N versions (`run`, with the decoupled learner's functions)

Generation runs on the weights of version v and training consumes them at version v: the loop is
on-policy, every group has staleness 0, and TIS / decoupled PPO see ratios of ~1 (with partial
rollouts, the tokens of a cut episode generated before the cut are a step or more stale, which
their per-token versions show and the off-policy correction weights).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
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
    training layout (tensor parallel over `meshes.train_tp` when `colocated.t > 1`, then FSDP2 over
    `meshes.train`, each parameter on its TP dim, so every training shard lies inside a generation
    shard); the backend's data parallel is the dp mesh (hybrid/backend.py). With `learner.backend:
    megatron` the Megatron backend itself, TP over every rank (`megatron_layout` checks it)."""
    from agentrl.hybrid.backend import HybridFSDP2Backend
    from agentrl.hybrid.reshard import shard_training_model
    from agentrl.learner.loop import build_learner as build

    lc = cfg.learner
    if lc.backend == "megatron":  # Megatron's own TP layout; local_shards gives it to the engine
        return build(lc, cfg.run_dir)
    shard = functools.partial(shard_training_model, mesh=meshes.train, tp_mesh=meshes.train_tp)
    return build(lc, cfg.run_dir, HybridFSDP2Backend(meshes.train), shard)


def megatron_layout(cfg: AgentRLConfig, world: int) -> None:
    """Colocated with `learner.backend: megatron`: the HybridEngine reshards Megatron's tensor
    parallel over every rank (one replica, one pipeline stage); refuses other layouts naming the
    field to change."""
    m, cc = cfg.learner.megatron, cfg.colocated
    if m.pp != 1:
        raise ValueError(f"learner.megatron.pp={m.pp}: colocated mode reshards one pipeline stage; use pp 1")
    if m.tp != cc.t or m.tp != world:
        raise ValueError(f"learner.megatron.tp={m.tp}: colocated with megatron trains TP over every rank; set "
                         f"colocated.t and learner.megatron.tp to colocated.num_processes ({world})")  # fmt: skip


def lora_generation(
    lora: Any, actor: Any, gen_model: Any, shards: Any, merged: bool = False
) -> tuple[Any, Any, Any]:
    """A LoRA actor's generation side: PEFT's LoRA layers injected into `gen_model` as the embedded
    server injects them for a pushed adapter (`peft_adapter.ServedAdapter`: the engine's prefill
    and decode step run them), the training shards under the injected model's names (PEFT's
    `base_model.model.` prefix dropped), and which of them are frozen (the base, which no step
    changes: gathered by the first reshard only; none with `merged`, where every reshard gathers
    the base and the adapter and `ServedAdapter.merge_refilled` folds one into the other).
    Returns (served adapter, shards, frozen)."""
    from agentrl.inference.peft_adapter import ServedAdapter
    from agentrl.learner.lora import PEFT_PREFIX

    served = ServedAdapter(gen_model)
    served.inject({"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": list(lora.target_modules)})
    frozen = {name.removeprefix(PEFT_PREFIX) for name, p in actor.named_parameters() if not p.requires_grad}

    def renamed() -> Any:
        for shard in shards():
            yield dataclasses.replace(shard, name=shard.name.removeprefix(PEFT_PREFIX))

    return served, renamed, None if merged else frozen.__contains__


def _lockstep(meshes: Any) -> Any:
    """This rank's replica channel: a gloo group over its TP ranks (every rank creates all of them)."""
    from agentrl.colocated.lockstep import Lockstep

    mine = None
    for row in meshes.gen.mesh.tolist():
        group = dist.new_group(row, backend="gloo")
        if dist.get_rank() in row:
            mine = Lockstep(row, group)
    return mine


def hash_seed(*parts: int) -> int:
    """A sampling seed from integers (the same in every process, unlike `hash`)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


class StepProducer:
    """One replica's queue (the roller's `Producer`, in process), step after step: it admits the
    replica's next tasks (task `k·replicas + replica` for its k-th admission, so the replicas
    split one task stream) while fewer than `in_flight` groups are running in the open step, and
    keeps the groups the roller puts; a step is full once `target` groups are done. The roller
    drops groups itself (dynamic sampling, failures) and is then admitted a further task, as
    against the queue. With `in_flight == target` every step waits for all its groups; with more
    in flight (partial rollouts), the groups still running at the cut go on in the next step."""

    def __init__(self, replica: int, replicas: int, in_flight: int, target: int) -> None:
        self.replica, self.replicas, self.in_flight, self.target = replica, replicas, in_flight, target
        self.version = 0
        self.cursor = 0  # this replica's admissions so far (its next task is cursor·replicas + replica)
        self.running = 0  # admitted groups neither put nor dropped
        self.done: list[Group] = []
        self._free = 0  # admissions the open step may still grant
        self._open = False
        self._changed = asyncio.Condition()
        self._full = asyncio.Event()

    async def begin(self, version: int) -> None:
        """Open a step at `version`: admit up to `in_flight` running groups."""
        self.version, self._open = version, True
        async with self._changed:
            self._free = max(0, self.in_flight - self.running)
            self._changed.notify_all()

    async def full(self) -> None:
        await self._full.wait()

    def cut(self) -> list[Group]:
        """Close the step: no more admissions; its `target` groups (those done first)."""
        self._free, self._open = 0, False
        groups, self.done = self.done[: self.target], self.done[self.target :]
        if len(self.done) < self.target:
            self._full.clear()
        return groups

    async def acquire_start(self, n: int = 1) -> Any:
        from agentrl.queue.base import Admission

        async with self._changed:
            await self._changed.wait_for(lambda: self._free >= n)
            self._free -= n
        self.running += n
        first = self.cursor * self.replicas + self.replica
        self.cursor += n
        return Admission(self.version, first)

    async def put(self, group: Group) -> None:
        self.running -= 1
        self.done.append(group)
        if len(self.done) >= self.target:
            self._full.set()

    async def release_start(self, n: int = 1) -> None:
        """A dropped group: its task is not tried again; the open step admits a new one instead."""
        self.running -= n
        if self._open:
            async with self._changed:
                self._free += n
                self._changed.notify_all()

    async def current_version(self) -> int:
        return self.version

    def close(self) -> None:
        return None


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


class ColocatedRank:
    """One rank of the colocated loop: its layouts, learner, HybridEngine, replica and engine.
    `generate()` and `train(groups)` are collective: every rank calls them in step."""

    def __init__(self, cfg: AgentRLConfig):
        from transformers import AutoTokenizer

        from agentrl.colocated.client import EngineClient
        from agentrl.envs.registry import env_factory, load_env_class
        from agentrl.hybrid.layout import GenLayout, HybridLayout, TrainLayout
        from agentrl.hybrid.reshard import HybridEngine, build_meshes
        from agentrl.hybrid.tp import parallelize_generation_model
        from agentrl.inference.engine import Engine
        from agentrl.learner import fsdp
        from agentrl.rewards.client import RewardModelClient
        from agentrl.rollers.chat import ChatRenderer
        from agentrl.rollers.tasks import TaskSource

        self.cfg = cfg
        self.rank, self.world, self.device = fsdp.init_distributed()
        cc, lc = cfg.colocated, cfg.learner
        if self.world != cc.num_processes:
            raise ValueError(f"colocated.num_processes={cc.num_processes}, but {self.world} ranks started")
        megatron = lc.backend == "megatron"
        if megatron:
            megatron_layout(cfg, self.world)
        layout = HybridLayout(
            TrainLayout(t=cc.t, d=self.world // cc.t, fsdp=not megatron),
            GenLayout(tg=cc.tg, dg=self.world // cc.tg),
        )
        self.meshes = build_meshes(layout, self.device.type)
        self.learner = build_learner(cfg, self.meshes)
        self.gen_model = parallelize_generation_model(self.learner.model.config, self.meshes.tp)
        shards = functools.partial(self.learner.backend.local_shards, self.learner.actor)
        self.adapter, frozen = None, None
        self.merged = lc.lora is not None and cfg.weight_sync.lora_mode == "merged"
        if lc.lora is not None:  # base + adapter through PEFT's layers; the base resharded once
            self.adapter, shards, frozen = lora_generation(
                lc.lora, self.learner.model, self.gen_model, shards, self.merged
            )
        self.hybrid = HybridEngine(shards, self.gen_model, layout, self.meshes, frozen=frozen)
        self.lock = _lockstep(self.meshes)
        tokenizer = AutoTokenizer.from_pretrained(lc.model_path)
        self.engine = Engine(lc.model_path, device=str(self.device), model=self.gen_model, tokenizer=tokenizer,
                             max_batch_size=cc.max_batch_size, replica=self.lock, cpu_threads=None,
                             adapter=self.adapter)  # fmt: skip
        self.replicas = self.world // cc.tg
        self.replica_index = self.meshes.gen.mesh.tolist().index(self.lock.ranks)
        if lc.groups_per_step % self.replicas:
            raise ValueError(
                f"learner.groups_per_step={lc.groups_per_step} must split evenly over {self.replicas} replicas"
            )
        self.per_replica = lc.groups_per_step // self.replicas
        self.make_env = env_factory(cfg.env)
        self.tasks = TaskSource(
            cfg.roller.tasks, load_env_class(cfg.env.name), cfg.roller.seed, **cfg.roller.task_kwargs
        )
        self.renderer = ChatRenderer(tokenizer, self.make_env().tool_schemas or None)
        self.reward_model = RewardModelClient(cfg.reward) if cfg.reward.url else None
        in_flight = self.per_replica
        if cc.partial_rollout is not None:
            in_flight = math.ceil(self.per_replica / cc.partial_rollout)
        self.producer = StepProducer(self.replica_index, self.replicas, in_flight, self.per_replica)
        self.client = EngineClient(self.engine)
        self.roller: Any = None  # started by the first step (`_roll`), on `gen_loop`
        self.roller_task: asyncio.Future | None = None
        self.cursors: dict[int, int] = {}  # every replica's, after each step (what a checkpoint saves)
        self.roller_metrics: dict[str, Any] = {}
        from agentrl.learner.bookkeeping import ConsoleProgress, RunTally

        self.tally = RunTally(ConsoleProgress(lc.max_steps, 0, enabled=False))  # skips, saved / exported
        self.applied = False
        if self.lock.is_leader:
            self.engine.start()
        # one event loop for every step: asyncio.run() (Python 3.11) reprs its main task, results and
        # all, when it restores the SIGINT handler: ~50 ms per step of numpy array printing
        self.gen_loop = asyncio.new_event_loop()
        log.info("colocated: %d ranks, training t=%d x dp=%d, %d generation replica(s) of tg=%d, %d groups/step",
                 self.world, cc.t, self.world // cc.t, self.replicas, cc.tg, lc.groups_per_step)  # fmt: skip

    async def _roll(self) -> list[Group]:
        """This replica's share of the step, by the roller's own group code (`Roller`: episodes,
        ReMax's greedy episode, reward-model scores, dynamic sampling, accounting) against the
        in-process `StepProducer`; one roller for the whole run, so that episodes still running
        when a step is cut (partial rollouts) go on in the next. The cut holds new requests and
        aborts the running ones (their tokens so far come back, as after a weight push, and the
        agent loop resubmits them, held until the next step resumes the client). The step's
        groups in task order, so that it does not depend on which episode finished first."""
        from agentrl.rollers.roller import Roller, RollerStats

        producer, client = self.producer, self.client
        if self.roller_task is None:
            config = self.cfg.roller.model_copy(update={"max_groups": None})
            Path(self.cfg.run_dir).mkdir(parents=True, exist_ok=True)
            groups_file = str(Path(self.cfg.run_dir) / f"colocated_replica{self.replica_index}.groups")
            self.roller = Roller(config, self.make_env, self.tasks, client, self.renderer, producer,
                                 groups_file=groups_file, reward_model=self.reward_model)  # fmt: skip
            self.roller_task = asyncio.ensure_future(self.roller.run())
        else:  # the step's own counts, as from a roller of its own; the episodes in flight go on
            old = self.roller.stats
            self.roller.stats = RollerStats(
                in_flight_episodes=old.in_flight_episodes, newest_version=old.newest_version
            )
        client.resume(hash_seed(self.cfg.learner.seed, self.learner.version, self.replica_index))
        await producer.begin(self.learner.version)
        full = asyncio.ensure_future(producer.full())
        await asyncio.wait({full, self.roller_task}, return_when=asyncio.FIRST_COMPLETED)
        if not full.done():
            full.cancel()
            error = None if self.roller_task.cancelled() else self.roller_task.exception()
            why = self.roller.fatal or self.roller.finished or (repr(error) if error else "it stopped")
            raise RuntimeError(f"colocated replica {self.replica_index}: the roller ended: {why}")
        client.hold()
        if producer.running:  # partial rollouts: the unfinished episodes wait for the next step
            engine = self.engine
            await asyncio.wrap_future(engine.call(lambda: engine.abort(abort_all=True, message="step cut")))
        groups = producer.cut()
        self.roller_metrics = {**self.roller.stats.snapshot(), "colocated/groups_carried": producer.running}
        return sorted(groups, key=lambda g: g.metrics.get("task_index", 0))

    def reshard(self) -> Any:
        """Step 1: the HybridEngine's reshard into the generation buffers (with LoRA merged, the
        adapter then folded into the base), the engine at the learner's version. Collective."""
        stats = self.hybrid.to_generation()
        version = self.learner.version
        self.engine.weight_version = str(version)
        if self.adapter is not None:
            from agentrl.inference.lora import ADAPTER_BASE, adapter_name

            if self.merged:  # base and adapter both gathered: fold one into the other
                self.adapter.merge_refilled()
            self.adapter.name = adapter_name(ADAPTER_BASE, version)
        return stats

    def generate(self) -> tuple[list[Group], dict[str, float]]:
        """Steps 1-4: reshard, generate on the rank-local replica, release, share. Every rank
        returns every group of the step (version v) and the phases' metrics."""
        engine, lock = self.engine, self.lock
        # 1. reshard: training shards -> generation buffers
        t0 = time.perf_counter()
        stats = self.reshard()
        t_reshard = time.perf_counter() - t0

        # 2. generate on the rank-local replica (leader schedules, followers replay)
        t0 = time.perf_counter()
        mine: list[Group] = []
        if lock.is_leader:
            mine = self.gen_loop.run_until_complete(self._roll())
            engine.end_phase()
        else:
            engine.follow()
        t_gen = time.perf_counter() - t0

        # 3. release: KV cache (engine thread, between steps) and generation buffers
        t0 = time.perf_counter()
        if lock.is_leader:
            engine.call(lambda: engine.release(params=False)).result()
        self.hybrid.release()
        t_release = time.perf_counter() - t0

        # 4. share: every rank gets every group
        gathered: list[Any] = [None] * self.world
        cursor = self.producer.cursor if lock.is_leader else None
        dist.all_gather_object(gathered, (mine, self.replica_index, cursor))
        groups = [g for part, _, _ in gathered for g in part]
        self.cursors = {i: c for _, i, c in gathered if c is not None}
        moved = {"reshard/collectives": stats.collectives, "reshard/bytes": stats.gathered_bytes}
        if self.adapter is not None and not self.merged:
            moved.update({"reshard/base_bytes": stats.frozen_bytes,
                          "reshard/adapter_bytes": stats.gathered_bytes - stats.frozen_bytes})  # fmt: skip
        return groups, {**self.roller_metrics, "time/generation_s": t_gen, "time/reshard_s": t_reshard,
                        "time/release_s": t_release, **moved}  # fmt: skip

    def train(self, groups: list[Group]) -> dict[str, float]:
        """Step 5: advantages, packing over the dp ranks, recompute, forward/backward, AdamW (the
        learner's own functions); version v+1. Returns the step's metrics (the same on every rank)."""
        from agentrl.learner import bookkeeping, step

        learner, tally = self.learner, self.tally
        result = step.train(learner, bookkeeping.prepare(learner, groups, tally))
        self.applied = result.applied
        if result.nonfinite:
            tally.count("nonfinite_step")
            log.error("step at version %d skipped: non-finite loss or gradient norm", learner.version)
        staleness = max(g.staleness(learner.version) for g in groups)
        learner.consumed_groups += len(groups)
        bookkeeping.publish(learner, None, None, result.applied, tally, counts_as_skip=not result.used)
        m = result.metrics(learner)
        m.update({"groups_consumed": learner.consumed_groups, "staleness/max": staleness})
        m.update({f"skipped/{k}": float(v) for k, v in tally.skipped.items()})
        return m

    # the checkpoint's cursor (`learner.bookkeeping`'s `save` / `resume` call these as a consumer's)
    def state_dict(self) -> dict[str, Any]:
        return {"task_cursors": {str(i): c for i, c in self.cursors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursors = {int(i): c for i, c in state["task_cursors"].items()}
        self.producer.cursor = self.cursors[self.replica_index]

    def close(self) -> None:
        if self.roller_task is not None:  # the roller, then what it leaves (groups cut by the last step)
            for tasks in ({self.roller_task}, asyncio.all_tasks(self.gen_loop)):
                for task in tasks:
                    task.cancel()
                self.gen_loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        if self.reward_model is not None:
            self.gen_loop.run_until_complete(self.reward_model.close())
        self.gen_loop.close()
        if self.lock.is_leader:
            self.engine.stop()


def run(cfg: AgentRLConfig, resume: bool = False) -> int:
    """Every rank: train until `learner.max_steps` versions exist, checkpointing every
    `checkpoint.every` versions and exporting every `checkpoint.export_every` (and both at the
    end), as the decoupled learner does (`learner.bookkeeping`, as the decoupled loop); `resume` continues from
    the newest intact checkpoint: weights, optimizer states, version and every replica's task
    cursor (generation is seeded per step and prompt: `EngineClient`), so the resumed run
    repeats the uninterrupted one. Returns the final version."""
    from agentrl.learner import bookkeeping as book

    r = ColocatedRank(cfg)
    learner, tally = r.learner, r.tally
    if resume and book.resume(learner, r):
        tally.saved = learner.version
        log.info("resumed at version %d (task cursors %s)", learner.version, r.cursors)
    metrics = MetricsLogger.from_config(cfg.run_dir, "learner", cfg.learner.logging) if r.rank == 0 else None
    exporter = endpoint = None
    if r.rank == 0 and cfg.prometheus.learner_port is not None:  # no weight push: push seconds stay empty
        from agentrl.observe.prometheus import LearnerExporter, serve

        exporter = LearnerExporter()
        endpoint = serve(exporter, cfg.prometheus.learner_port, cfg.run_dir, "learner")
    try:
        while learner.version < cfg.learner.max_steps:
            groups, m = r.generate()
            m.update(r.train(groups))
            # 6. log
            peak: list[Any] = [None] * r.world
            dist.all_gather_object(peak, _peak_memory_bytes(r.device))
            if metrics is not None:
                m["memory/peak_param_bytes"] = r.hybrid.peak_param_bytes
                m.update({f"memory/peak_rss_bytes_rank{i}": v for i, v in enumerate(peak)})
                metrics.log(m, learner.version)
                if exporter is not None:
                    exporter.step(learner.version, m)
                log.info("version %d  reward %.3f  gen %.1fs  reshard %.2fs  train %.1fs", learner.version,
                         m.get("reward/mean", math.nan), m["time/generation_s"], m["time/reshard_s"],
                         m["time/train_s"])  # fmt: skip
            # 7. checkpoint and export every N versions
            book.periodic_save(learner, r, r.applied, tally)
        if tally.saved != learner.version:
            book.save(learner, r)
        if tally.exported != learner.version:
            book.export(learner)
    finally:
        if endpoint is not None:
            endpoint.stop()
        r.close()
        if metrics is not None:
            metrics.close()
    return learner.version


def run_rank(cfg: AgentRLConfig, resume: bool = False) -> int:
    """This process's rank of the run (`agentrl colocated`): `run`, then leave the process group.
    Returns the exit code."""
    run(cfg, resume)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    import sys

    from agentrl.config import load_config

    args = sys.argv[1:]
    resume = "--resume" in args
    args = [a for a in args if a != "--resume"]
    path = None
    if args[:1] == ["--config"]:
        path, args = args[1], args[2:]
    return run_rank(load_config(path, args, uses=("learner", "roller", "env", "reward", "colocated")), resume)


if __name__ == "__main__":
    raise SystemExit(main())
