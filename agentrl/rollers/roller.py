"""The roller: many multi-turn episodes at once, streamed to the learner as groups.

    roller = Roller(config, make_env, tasks, client, renderer, producer)
    stats = await roller.run()

Each task becomes one `Group` of `group_size` episodes. Staleness is bounded by
admission, not by discarding work: before starting a group the roller asks the queue
(`producer.acquire_start`), which grants it only while
`started_groups ≤ (v + max_staleness + 1) × groups_per_step` across *all* rollers, with
`v` the learner's published version. Groups the roller drops itself (dynamic sampling,
failures) give their admission back, so they never hold up the learner. Each admission also
names the task to run: the next number of the run's task cursor, held by the queue, so the
rollers of a run split one task stream (`tasks.TaskSource`); given a plain iterator instead
(tests, benches), the roller takes its next item.

How it ends: `max_groups` put, `stop()`, or the queue saying so — the run is over (`RunOver`:
`finished` is set, a clean exit) or the queue is unreachable, refuses this roller, or went
silent (`QueueUnavailable`: `fatal` is set, with the message to show). A group whose lease
lapsed (`LeaseLapsed`) was not taken by the queue; it is counted and the roller goes on.

Named loops, started by `run()` in this order and stopped in reverse:
- `_report_loop`: a progress line and a metrics record every `log_every_s` (and, while the
  admit loop has waited that long with nothing in flight, a line saying it waits for the learner);
- `_admit_loop`: waits for admission and a free slot, then starts `_run_group` tasks;
- `_run_group` (one per group in flight): runs its episodes under the episode semaphore,
  filters, and `put`s the group (waiting while the queue is full).
`run()` returns when `max_groups` groups were put or `stop()` was called; in-flight
groups finish first, so no admitted work is lost.

With `roller.greedy_baseline` (ReMax), `_run_group` also runs one greedy episode of the task
beside its sampled ones; it is not put (not trained on), and its reward becomes the group's
`metrics["greedy_reward"]`.

A group whose episodes generated no token is put all the same (the learner skips it, counted),
but never silently: it is counted (`roller/groups_no_generation`) and logged with why
(`no_generation_reason`: prompt too long, context full, the server's context, a timeout) and
the budget. With a reward model (`reward_model`), every episode, greedy ones
too, is scored by it (`agent_loop`), and its client's counters join the metrics record.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentrl.config import RollerConfig
from agentrl.envs.agent import AgentEnv, AgentFailed
from agentrl.envs.base import Env
from agentrl.inference.base import InferenceClient
from agentrl.log import MetricsLogger, get_logger
from agentrl.queue.base import LeaseLapsed, Producer, QueueError, QueueUnavailable, RunOver
from agentrl.rewards.client import RewardModelClient
from agentrl.rollers.agent_endpoint import AgentEndpoint
from agentrl.rollers.agent_episode import RendererCache, run_agent_episode
from agentrl.rollers.agent_loop import run_episode
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.tasks import TaskSource
from agentrl.types import Episode, Group

logger = get_logger(__name__)

OVERLONG = ("context", "length")


def no_generation_reason(episode: Episode, max_total_tokens: int) -> str:
    """Why an episode generated no token, from its finish reason and prompt length."""
    prompt = episode.metrics.get("prompt_tokens", len(episode.tokens))
    if episode.finish_reason == "context":
        return "prompt too long" if prompt >= max_total_tokens else "context full"
    if episode.finish_reason == "length":
        return "server stopped at its context"
    if episode.finish_reason == "timeout":
        return "episode timeout"
    return f"server returned no token (finish {episode.finish_reason})"


@dataclass
class RollerStats:
    episodes: int = 0
    groups_put: int = 0
    groups_dropped_uniform: int = 0
    groups_failed: int = 0
    groups_abandoned: int = 0
    groups_lease_lapsed: int = 0
    greedy_episodes: int = 0
    episodes_overlong_masked: int = 0
    groups_no_generation: int = 0
    no_generation: Counter = field(default_factory=Counter)  # why episodes generated nothing
    tool_calls: int = 0
    tool_errors: int = 0
    agent_failures: Counter = field(default_factory=Counter)  # why agent episodes failed (`AgentEnv`)
    agent_non_extensions: int = 0
    rewards: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    staleness_at_put: deque[int] = field(default_factory=lambda: deque(maxlen=1024))
    staleness_counts: Counter = field(default_factory=Counter)  # every put's staleness (`/metrics`)
    newest_version: int = -1
    version_regressions: int = 0
    in_flight_episodes: int = 0
    peak_in_flight_episodes: int = 0
    turns: int = 0
    started: float = field(default_factory=time.perf_counter)

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.perf_counter() - self.started
        recent = list(self.rewards)[-256:]
        return {
            "roller/episodes": self.episodes,
            "roller/episodes_per_s": self.episodes / elapsed if elapsed else 0.0,
            "roller/groups_put": self.groups_put,
            "roller/groups_dropped_uniform": self.groups_dropped_uniform,
            "roller/groups_failed": self.groups_failed,
            "roller/groups_abandoned": self.groups_abandoned,
            "roller/groups_lease_lapsed": self.groups_lease_lapsed,
            "roller/greedy_episodes": self.greedy_episodes,
            "roller/episodes_overlong_masked": self.episodes_overlong_masked,
            "roller/groups_no_generation": self.groups_no_generation,
            "roller/reward_mean": float(np.mean(recent)) if recent else 0.0,
            "roller/tool_calls": self.tool_calls,
            "roller/tool_errors": self.tool_errors,
            "roller/in_flight_episodes": self.in_flight_episodes,
            "roller/staleness_max": max(self.staleness_at_put, default=0),
            "roller/version": self.newest_version,
            "roller/version_regressions": self.version_regressions,
            **({"roller/agent_failures": sum(self.agent_failures.values()),
                "roller/agent_non_extensions": self.agent_non_extensions} if self.agent_failures
               or self.agent_non_extensions else {}),
        }  # fmt: skip


class Roller:
    def __init__(
        self,
        config: RollerConfig,
        make_env: Callable[[], Env],
        tasks: TaskSource | Iterator[dict[str, Any]],
        client: InferenceClient,
        renderer: ChatRenderer,
        producer: Producer,
        metrics: MetricsLogger | None = None,
        groups_file: str | None = None,
        reward_model: RewardModelClient | None = None,
    ) -> None:
        """`groups_file`: append `{"id", "task"}` (JSON lines) for every group the queue acknowledged,
        the roller's side of the run's account. `reward_model`: scores every episode (`reward.url`)."""
        self.config = config
        self.make_env = make_env
        self.tasks = tasks
        self.client = client
        self.renderer = renderer
        self.producer = producer
        self.metrics = metrics
        self.reward_model = reward_model
        self.stats = RollerStats()
        self._episode_slots = asyncio.Semaphore(config.max_concurrent_episodes)
        # never admit more groups than can run at once: admission stays meaningful
        self._group_slots = asyncio.Semaphore(max(1, config.max_concurrent_episodes // config.group_size))
        self._stopping = asyncio.Event()
        self._groups: set[asyncio.Task] = set()
        self._admitted = 0
        self._failures_in_a_row = 0
        self._waiting_since: float | None = None  # since when the admit loop waits for admission
        self._admitted_version = -1
        self.fatal: str | None = None  # why the roller gave up, if it did
        self.finished: str | None = None  # why the run is over, if the queue said so
        self._groups_file = open(groups_file, "a", buffering=1) if groups_file else None  # noqa: SIM115
        self._endpoint: AgentEndpoint | None = None  # started by the first agent episode (`AgentEnv`)
        self._renderers = RendererCache(renderer.tokenizer)

    def stop(self) -> None:
        """Stop admitting new groups; `run()` returns once in-flight groups are put."""
        self._stopping.set()

    async def run(self) -> RollerStats:
        reporter = asyncio.create_task(self._report_loop(), name="_report_loop")
        try:
            await self._admit_loop()
            if self._groups:
                # after stop(), in-flight groups get a grace period (the learner may be gone)
                timeout = self.config.shutdown_grace_s if self._stopping.is_set() else None
                _, late = await asyncio.wait(set(self._groups), timeout=timeout)
                if late:
                    self.stats.groups_abandoned += len(late)
                    logger.warning("%d in-flight group(s) abandoned at shutdown", len(late))
        finally:
            reporter.cancel()
            for task in self._groups:
                task.cancel()
            if self._endpoint is not None:
                await self._endpoint.stop()
            self._report()
            if self._groups_file is not None:
                self._groups_file.close()
        return self.stats

    def _queue_ended(self, exc: QueueError) -> None:
        """The queue ended this roller's part: the run is over, or the queue cannot be used."""
        if isinstance(exc, RunOver):
            self.finished = self.finished or str(exc)
        elif self.fatal is None:
            self.fatal = str(exc)
        self.stop()

    async def _admit_loop(self) -> None:
        limit = self.config.max_groups
        while not self._stopping.is_set():
            if limit is not None and self.stats.groups_put + len(self._groups) >= limit:
                if not self._groups:
                    return  # all put
                await asyncio.wait(set(self._groups), return_when=asyncio.FIRST_COMPLETED)
                continue  # a dropped or failed group frees its place for a new one
            await self._group_slots.acquire()
            self._waiting_since = time.perf_counter()
            try:
                admission = await self._wait_or_stop(self.producer.acquire_start(1))
            except (RunOver, QueueUnavailable) as exc:
                admission = None
                self._queue_ended(exc)
            finally:
                self._waiting_since = None
            if admission is None:
                self._group_slots.release()
                return
            self._admitted += 1
            self._admitted_version = admission.version
            metrics = {"admitted_version": admission.version, "admitted_index": self._admitted}
            if isinstance(self.tasks, TaskSource) and admission.first_task >= 0:
                task = self.tasks[admission.first_task]
                metrics["task_index"] = admission.first_task
            else:
                task = next(self.tasks)
            group_task = asyncio.create_task(self._run_group(task, metrics), name="_run_group")
            self._groups.add(group_task)
            group_task.add_done_callback(self._groups.discard)

    async def _wait_or_stop(self, awaitable: Any) -> Any:
        """Await `awaitable` unless `stop()` comes first (then None)."""
        waiter = asyncio.ensure_future(awaitable)
        stopper = asyncio.ensure_future(self._stopping.wait())
        done, _ = await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if waiter in done:
            return waiter.result()
        waiter.cancel()
        return None

    async def _run_group(self, task: dict[str, Any], admission: dict[str, int]) -> None:
        """One admitted task into one `Group`: its episodes (and ReMax's greedy one), then the
        filters and the `put` (`_put_group`); a failed group is counted and its admission given
        back (`_group_failed`)."""
        runs = [asyncio.create_task(self._run_one(task)) for _ in range(self.config.group_size)]
        if self.config.greedy_baseline:
            runs.append(asyncio.create_task(self._run_one(task, greedy=True)))
        try:
            episodes = await asyncio.gather(*runs)
        except Exception as exc:  # a lost request or a bug in user env code: count it, keep rolling
            for run in runs:
                run.cancel()
            await self._group_failed(task, exc)
            return
        finally:
            self._group_slots.release()
        runs_out = list(episodes)
        if self.config.greedy_baseline:
            admission = {**admission, "greedy_reward": runs_out.pop()[0].reward}
        episodes = [ep for run in runs_out for ep in run]  # an agent episode may be several segments
        group = Group(episodes, prompt_id=str(task.get("id", "")), metrics=admission)
        if not any(ep.num_generated for ep in episodes):
            self._no_generation(task, episodes)
        await self._put_group(group, admission)

    async def _group_failed(self, task: dict[str, Any], exc: Exception) -> None:
        """Count a failed group, give its admission back, and stop the roller after
        `max_consecutive_failures` in a row."""
        self.stats.groups_failed += 1
        self._failures_in_a_row += 1
        if isinstance(exc, AgentFailed):
            self.stats.agent_failures[exc.reason] += 1
        log = logger.exception if self.stats.groups_failed <= 3 else logger.warning
        log("group for task %s failed and was dropped (counted): %s", task.get("id", "?"), exc)
        try:
            await self.producer.release_start(1)
        except QueueError as queue_exc:  # the queue is gone too; its lease will lapse
            self._queue_ended(queue_exc)
            return
        limit = self.config.max_consecutive_failures
        if limit and self._failures_in_a_row >= limit and self.fatal is None:
            self.fatal = (f"{self._failures_in_a_row} groups in a row failed (roller.max_consecutive_failures); "
                          f"last error: {exc}")  # fmt: skip
            self.stop()

    async def _put_group(self, group: Group, admission: dict[str, int]) -> None:
        """Dynamic sampling (a uniform-reward group gives its admission back), then `put` (waiting
        while the queue is full), the groups file and the staleness at put."""
        try:
            if self.config.drop_uniform_reward_groups and len(set(group.rewards.tolist())) == 1:
                self.stats.groups_dropped_uniform += 1
                await self.producer.release_start(1)
                return
            await self.producer.put(group)
        except LeaseLapsed:
            self.stats.groups_lease_lapsed += 1  # the queue reclaimed its credit; not taken, not lost
            return
        except (RunOver, QueueUnavailable) as exc:
            self._queue_ended(exc)
            return
        self.stats.groups_put += 1
        if self._groups_file is not None:
            record = {"id": group.group_id, "task": admission.get("task_index")}
            self._groups_file.write(json.dumps(record) + "\n")
        self._failures_in_a_row = 0
        try:
            current = await self.producer.current_version()
        except (RunOver, QueueUnavailable) as exc:
            self._queue_ended(exc)
            return
        staleness = group.staleness(current)
        self.stats.staleness_at_put.append(staleness)
        self.stats.staleness_counts[staleness] += 1
        if self.config.max_groups is not None and self.stats.groups_put >= self.config.max_groups:
            self.stop()

    async def _run_one(self, task: dict[str, Any], greedy: bool = False) -> list[Episode]:
        """One episode: one sequence, or for an agent env one per segment (`agent_episode`)."""
        async with self._episode_slots:
            self.stats.in_flight_episodes += 1
            self.stats.peak_in_flight_episodes = max(
                self.stats.peak_in_flight_episodes, self.stats.in_flight_episodes
            )
            try:
                env = self.make_env()
                if isinstance(env, AgentEnv):
                    episodes = await run_agent_episode(env, task, self.client, self._renderers, self.config,
                                                       await self._agent_endpoint(env), self.reward_model,
                                                       greedy)  # fmt: skip
                    self.stats.agent_non_extensions += int(episodes[0].metrics.get("non_extensions", 0))
                else:
                    episodes = [await run_episode(
                        env, task, self.client, self.renderer, self.config, self.reward_model, greedy
                    )]  # fmt: skip
            finally:
                self.stats.in_flight_episodes -= 1
        if greedy:
            self.stats.greedy_episodes += 1
        else:
            for episode in episodes:
                self._account(episode)
        return episodes

    async def _agent_endpoint(self, env: AgentEnv) -> AgentEndpoint:
        """The roller's one OpenAI-compatible endpoint, started by its first agent episode."""
        if self._endpoint is None:
            endpoint = AgentEndpoint(model=env.model)
            self._endpoint = endpoint
            await endpoint.start()
        while not self._endpoint.base_url:  # another episode is starting it
            await asyncio.sleep(0.01)
        return self._endpoint

    def _no_generation(self, task: dict[str, Any], episodes: list[Episode]) -> None:
        """Count and say why a group's episodes generated nothing (the learner cannot train on it)."""
        stats, cfg = self.stats, self.config
        stats.groups_no_generation += 1
        why = Counter(no_generation_reason(ep, cfg.max_total_tokens) for ep in episodes)
        stats.no_generation.update(why)
        n = stats.groups_no_generation
        if n <= 3 or n % 100 == 0:
            prompt = episodes[0].metrics.get("prompt_tokens", len(episodes[0].tokens))
            logger.warning(
                "group for task %s generated no token (%d such groups): %s; its prompt is %d tokens, "
                "roller.max_total_tokens %d, roller.max_new_tokens %d (agentrl env check shows the budget)",
                task.get("id", "?"), n, ", ".join(f"{r} ×{c}" for r, c in why.most_common()), prompt,
                cfg.max_total_tokens, cfg.max_new_tokens,
            )  # fmt: skip

    def _account(self, episode: Episode) -> None:
        stats = self.stats
        stats.episodes += 1
        stats.turns += episode.num_turns
        stats.rewards.append(episode.reward)
        stats.tool_calls += int(episode.metrics.get("tool_calls", 0))
        stats.tool_errors += int(episode.metrics.get("tool_errors", 0))
        if episode.num_generated:
            newest = int(episode.versions.max())
            if newest < stats.newest_version:
                stats.version_regressions += 1
                logger.warning("weight version went backwards: %d after %d", newest, stats.newest_version)
            stats.newest_version = max(stats.newest_version, newest)
        if self.config.drop_overlong and episode.finish_reason in OVERLONG:
            episode.loss_mask = np.zeros_like(episode.loss_mask)
            episode.metrics["overlong_masked"] = True
            stats.episodes_overlong_masked += 1

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.log_every_s)
            self._report()

    def _report(self) -> None:
        from agentrl.inference.router import Router

        snap = self.stats.snapshot()
        if self.reward_model is not None:
            snap.update(self.reward_model.metrics())
        if isinstance(self.client, Router):  # requests lost after retries; requests servers failed
            snap["roller/requests_lost"] = self.client.stats["lost"]
            snap["roller/server_errors"] = self.client.stats["server_errors"]
        logger.info(
            "episodes %d (%.1f/s)  groups put %d  failed %d  reward %.3f  tool errors %d/%d  in flight %d  "
            "staleness ≤ %d",
            snap["roller/episodes"],
            snap["roller/episodes_per_s"],
            snap["roller/groups_put"],
            snap["roller/groups_failed"],
            snap["roller/reward_mean"],
            snap["roller/tool_errors"],
            snap["roller/tool_calls"],
            snap["roller/in_flight_episodes"],
            snap["roller/staleness_max"],
        )
        waited = time.perf_counter() - self._waiting_since if self._waiting_since is not None else 0.0
        if waited >= self.config.log_every_s and not self.stats.in_flight_episodes:
            logger.info(
                "waiting for the learner: the queue admits no new group (%d started, learner at version %d) "
                "until the learner trains on what was put — is an `agentrl learner` (or `agentrl run`) "
                "consuming this queue? (waited %.0f s)",
                self._admitted, max(self._admitted_version, 0), waited,
            )  # fmt: skip
        if self.metrics is not None:
            self.metrics.log(snap, step=self.stats.groups_put)
