"""A discrete-event model of one run: rollers, servers, tools, admission, the learner and its pushes.

What it models, each as agentrl does it:

- **Admission**: a group may start while the groups started and not yet trained or dropped number
  fewer than `(k + 1) × groups_per_step` (the queue's `used + n ≤ (v + k + 1) × groups_per_step`,
  with `v × groups_per_step` already trained). A group is admissible when trained at version v if
  `v − (its first token's version) ≤ k`; a staler one is dropped and frees its credit.
- **Rollers**: each runs up to `roller_concurrency` episodes; its own per-turn work (render, parse,
  HTTP) is serial within the process (`turn_overhead_s` each, one process = one core).
- **Servers** batch continuously: every step advances each running sequence by one token and costs
  `CostProfile.decode_s(batch, Σ context)`; requests arriving mid-step join at the next step boundary,
  after their prefill. Requests go to the server with the fewest sequences (the router's choice).
  Steps are simulated in runs ("macro-steps") between changes of the batch, so a step of a large run
  costs one event, not one per token.
- **Tools**: an episode waits `tool_latency_s` between turns, holding no server slot.
- **The learner** takes the first `groups_per_step` admissible finished groups, trains
  (`train_s` of their tokens), then pushes: every server pauses (finishing its current step) for
  `push_s`, then the version moves on. Decoupled: generation continues while the learner trains.
- **Colocated**: the same devices alternate: generate one step's groups at the current version
  (no staleness), reshard, train (`colocated_train_s`), reshard back, plus the loop's own
  `colocated_loop_s`.

`simulate` returns trained samples/s over a steady window (after `warmup_steps`), like
`bench.common.steady_rate` measures a real run.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from agentrl.plan.profile import CostProfile
from agentrl.plan.workload import Workload


@dataclass
class Deployment:
    """How the run is laid out, in the simulator's terms (`search.Candidate` maps GPUs onto it)."""

    mode: str = "decoupled"  # or "colocated"
    servers: int = 1
    rollers: int = 1
    roller_concurrency: int = 64  # episodes one roller runs at once


@dataclass
class SimResult:
    samples_per_s: float
    step_time_s: float
    steps: int
    dropped_stale: int
    server_busy: float  # share of server-seconds spent decoding or prefilling
    learner_busy: float  # share of the window the learner trained or pushed
    mean_staleness: float  # mean (trained version − first-token version) of trained groups
    step_end_times: list[float] = field(default_factory=list)


class _Loop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn))

    def after(self, delay: float, fn: Callable[[], None]) -> None:
        self.at(self.now + delay, fn)

    def run(self, until: Callable[[], bool], max_time: float) -> None:
        while self._heap and not until():
            when, _, fn = heapq.heappop(self._heap)
            if when > max_time:
                break
            self.now = when
            fn()


class _Request:
    __slots__ = ("ctx", "done", "prefill", "remaining")

    def __init__(self, prefill: float, tokens: int, ctx: float, done: Callable[[], None]) -> None:
        self.prefill = prefill
        self.remaining = tokens
        self.ctx = ctx
        self.done = done


class _Server:
    """Continuous batching in macro-steps: between batch changes the step time grows linearly
    (each step adds `batch` tokens of context), so the time of n steps has a closed form."""

    def __init__(self, loop: _Loop, profile: CostProfile, slowdown: Callable[[], float]) -> None:
        self.loop, self.p = loop, profile
        self.slowdown = slowdown
        self.factor = 1.0  # the slowdown of the current macro-step (cores shared with the learner)
        self.running: list[_Request] = []
        self.joining: list[_Request] = []
        self.waiting: deque[_Request] = deque()  # beyond max_batch
        self.t0 = 0.0  # start of the current macro-step's first decode step
        self.planned = 0  # steps planned in the current macro-step
        self.token = 0  # invalidates a planned completion
        self.stepping = False
        self.boundary_pending = False
        self.paused = False
        self.busy_s = 0.0
        self._time_of_done = 0.0

    @property
    def load(self) -> int:
        return len(self.running) + len(self.joining) + len(self.waiting)

    def _time_of(self, n: int) -> float:
        b = len(self.running)
        s0 = sum(r.ctx for r in self.running)
        step0 = self.p.decode_s(b, s0)
        return self.factor * (n * step0 + self.p.decode_per_ctx_token_s * b * n * (n - 1) / 2)

    def _steps_by(self, elapsed: float) -> int:
        """Whole steps finished `elapsed` seconds into the macro-step."""
        b = len(self.running)
        a = self.factor * self.p.decode_per_ctx_token_s * b / 2
        c = self.factor * self.p.decode_s(b, sum(r.ctx for r in self.running)) - a
        n = elapsed / c if a <= 0 else (-c + math.sqrt(c * c + 4 * a * elapsed)) / (2 * a)
        n = min(self.planned, max(0, int(n + 1e-9)))
        while n < self.planned and self._time_of(n + 1) <= elapsed + 1e-12:
            n += 1
        return n

    def submit(self, req: _Request) -> None:
        self.joining.append(req)
        self._interrupt()

    def pause(self) -> None:
        self.paused = True
        self._interrupt()

    def resume(self) -> None:
        self.paused = False
        if not self.stepping and not self.boundary_pending:
            self._boundary()

    def reschedule(self) -> None:
        """The cores' load changed: re-plan from the end of the step in progress."""
        if self.stepping:
            self._interrupt()

    def _interrupt(self) -> None:
        """Something changed: end the macro-step at the boundary of the step in progress."""
        if self.boundary_pending:
            return
        if not self.stepping:
            if not self.paused:
                self._boundary()
            return
        done = self._steps_by(self.loop.now - self.t0)
        if done < self.planned:
            done += 1  # the step in progress finishes first
        self._advance(done)
        self.boundary_pending = True
        self.token += 1
        self.loop.at(self.t0 + self._time_of_done, self._boundary)

    def _advance(self, n: int) -> None:
        self._time_of_done = self._time_of(n)
        self.busy_s += self._time_of_done
        for r in self.running:
            r.remaining -= n
            r.ctx += n

    def _boundary(self) -> None:
        self.boundary_pending = False
        self.stepping = False
        finished = [r for r in self.running if r.remaining <= 0]
        self.running = [r for r in self.running if r.remaining > 0]
        for r in finished:
            r.done()
        if self.paused:
            return
        self.waiting.extend(self.joining)
        self.joining = []
        prefill = 0.0
        while self.waiting and len(self.running) < self.p.max_batch:
            r = self.waiting.popleft()
            prefill += r.prefill
            self.running.append(r)
        if not self.running:
            return
        self.stepping = True  # counted among the busy while the slowdown is read
        self.factor = self.slowdown()
        start = self.factor * self.p.prefill_s(prefill)
        self.busy_s += start
        self.t0 = self.loop.now + start
        self.planned = min(r.remaining for r in self.running)
        self.token += 1
        token = self.token
        end = self.t0 + self._time_of(self.planned)

        def complete() -> None:
            if token == self.token:
                self._advance(self.planned)
                self._boundary()

        self.loop.at(end, complete)


class _Episode:
    def __init__(self, sim: _Sim, group: _Group) -> None:
        self.sim, self.group = sim, group
        rng = sim.rng
        w = sim.w
        turns = w.turns.sample(rng)  # a fractional count rounds up with its fraction's probability
        self.turns = max(1, int(turns) + (rng.random() < turns - int(turns)))
        self.turn = 0
        self.ctx = 0.0
        self.new_ctx = max(1.0, w.prompt_tokens.sample(rng))
        self.tokens = 0.0

    def start(self) -> None:
        self.sim.roller_turn(self.group.roller, self._request)

    def _request(self) -> None:
        w, rng = self.sim.w, self.sim.rng
        budget = w.max_total_tokens - self.ctx - self.new_ctx
        out = int(min(max(1.0, round(w.response_tokens.sample(rng))), budget))
        if out < 1:
            self._end()
            return
        if self.group.first_version is None:
            self.group.first_version = self.sim.version
        prefill = self.new_ctx
        self.ctx += self.new_ctx + out
        server = min(self.sim.servers, key=lambda s: s.load)
        server.submit(_Request(prefill, out, self.ctx - out, self._turn_done))

    def _turn_done(self) -> None:
        self.turn += 1
        w, rng = self.sim.w, self.sim.rng
        if self.turn >= self.turns or self.ctx >= w.max_total_tokens - 1:
            self._end()
            return
        self.new_ctx = max(0.0, w.tool_tokens.sample(rng))
        self.sim.loop.after(max(0.0, w.tool_latency_s.sample(rng)), self.start)

    def _end(self) -> None:
        self.tokens = self.ctx
        self.group.episode_done(self)


class _Group:
    def __init__(self, sim: _Sim, roller: int) -> None:
        self.sim, self.roller = sim, roller
        self.first_version: int | None = None
        self.left = sim.w.group_size
        self.tokens = 0.0

    def episode_done(self, ep: _Episode) -> None:
        self.tokens += ep.tokens
        self.left -= 1
        if self.left == 0:
            self.sim.group_done(self)


class _Sim:
    def __init__(self, w: Workload, p: CostProfile, d: Deployment, seed: int) -> None:
        self.w, self.p, self.d = w, p, d
        self.rng = random.Random(seed)
        self.loop = _Loop()
        self.version = 0
        self.servers = [_Server(self.loop, p, self.slowdown) for _ in range(d.servers)]
        self.in_flight = 0  # groups started, not yet trained or dropped
        self.roller_slots = [d.roller_concurrency] * d.rollers
        self.roller_free_at = [0.0] * d.rollers
        self.finished: deque[_Group] = deque()
        self.learner_busy = False
        self.learner_training = False
        self.learner_busy_s = 0.0
        self.step_ends: list[float] = []
        self.dropped = 0
        self.staleness: list[int] = []
        self.gen_phase_left = 0  # colocated: groups still to finish this step

    def slowdown(self) -> float:
        """How much slower work runs now because servers and learner share `cores` (1: not at all)."""
        if self.p.cores <= 0:
            return 1.0
        busy = sum(s.stepping or s.boundary_pending for s in self.servers)
        busy += self.p.learner_threads if self.learner_training else 0
        return max(1.0, busy / self.p.cores)

    def _learner_state(self, training: bool) -> None:
        self.learner_training = training
        if self.p.cores > 0:
            for s in self.servers:
                s.reschedule()

    # -- rollers
    def roller_turn(self, roller: int, fn: Callable[[], None]) -> None:
        """A turn's roller-side work, serial within one roller process."""
        cost = self.p.turn_overhead_s
        if cost <= 0:
            fn()
            return
        start = max(self.loop.now, self.roller_free_at[roller])
        self.roller_free_at[roller] = start + cost
        self.loop.at(start + cost, fn)

    def admit(self) -> None:
        w = self.w
        cap = (w.max_staleness + 1) * w.groups_per_step
        for r in range(self.d.rollers):
            while self.in_flight < cap and self.roller_slots[r] >= w.group_size:
                if self.d.mode == "colocated" and self.gen_phase_left <= 0:
                    return
                self.start_group(r)

    def start_group(self, roller: int) -> None:
        self.in_flight += 1
        self.gen_phase_left -= 1
        self.roller_slots[roller] -= self.w.group_size
        group = _Group(self, roller)
        for _ in range(self.w.group_size):
            _Episode(self, group).start()

    def group_done(self, group: _Group) -> None:
        self.roller_slots[group.roller] += self.w.group_size
        self.finished.append(group)
        if self.d.mode == "colocated":
            if len(self.finished) >= self.w.groups_per_step:
                self.colocated_train()
            else:
                self.admit()
        else:
            self.learner_try()
            self.admit()

    # -- learner
    def learner_try(self) -> None:
        if self.learner_busy:
            return
        k, g = self.w.max_staleness, self.w.groups_per_step
        stale = [x for x in self.finished if self.version - x.first_version > k]
        if stale:
            self.finished = deque(x for x in self.finished if self.version - x.first_version <= k)
            self.in_flight -= len(stale)
            self.dropped += len(stale)
        if len(self.finished) < g:
            return
        batch = [self.finished.popleft() for _ in range(g)]
        self.staleness.extend(self.version - x.first_version for x in batch)
        self.learner_busy = True
        self._learner_state(True)
        train = self.p.train_s(sum(x.tokens for x in batch)) * self.slowdown()
        self.learner_busy_s += train
        self.loop.after(train, lambda: self.push(len(batch)))

    def push(self, trained: int) -> None:
        self._learner_state(False)
        for s in self.servers:
            s.pause()
        push = self.p.push_s()
        self.learner_busy_s += push

        def pushed() -> None:
            self.version += 1
            self.in_flight -= trained
            self.step_ends.append(self.loop.now)
            for s in self.servers:
                s.resume()
            self.learner_busy = False
            self.learner_try()
            self.admit()

        self.loop.after(push, pushed)

    # -- colocated
    def colocated_step(self) -> None:
        self.gen_phase_left = self.w.groups_per_step
        self.admit()

    def colocated_train(self) -> None:
        batch = [self.finished.popleft() for _ in range(self.w.groups_per_step)]
        self.staleness.extend(0 for _ in batch)
        busy = (
            self.p.reshard_s
            + self.p.colocated_loop_s
            + self.p.colocated_train_s(sum(x.tokens for x in batch))
        )
        self.learner_busy_s += busy

        def trained() -> None:
            self.version += 1
            self.in_flight -= len(batch)
            self.step_ends.append(self.loop.now)
            self.colocated_step()

        self.loop.after(busy, trained)


def simulate(
    workload: Workload,
    profile: CostProfile,
    deployment: Deployment,
    steps: int = 12,
    warmup_steps: int = 2,
    seed: int = 0,
    max_time_s: float = 1e7,
) -> SimResult:
    """Run the model until `steps` learner steps ended; rates over the steps after `warmup_steps`."""
    if deployment.roller_concurrency < workload.group_size:
        raise ValueError(
            f"roller_concurrency={deployment.roller_concurrency} cannot hold one group of {workload.group_size}"
        )
    if deployment.servers < 1 or deployment.rollers < 1:
        raise ValueError("a deployment needs at least one server and one roller")
    if profile.max_batch < 1:
        raise ValueError("the profile's max_batch is 0: the model leaves no memory for a KV cache")
    sim = _Sim(workload, profile, deployment, seed)
    if deployment.mode == "colocated":
        sim.colocated_step()
    else:
        sim.admit()
    sim.loop.run(lambda: len(sim.step_ends) >= steps, max_time_s)
    ends = sim.step_ends
    if len(ends) <= warmup_steps:
        raise RuntimeError(
            f"the model reached {len(ends)} of {steps} steps within {max_time_s:.0f} simulated s"
        )
    window = ends[-1] - ends[warmup_steps - 1] if warmup_steps else ends[-1]
    counted = len(ends) - warmup_steps
    samples = counted * workload.episodes_per_step
    busy = sum(s.busy_s for s in sim.servers) / (len(sim.servers) * ends[-1])
    return SimResult(
        samples_per_s=samples / window,
        step_time_s=window / counted,
        steps=len(ends),
        dropped_stale=sim.dropped,
        server_busy=min(1.0, busy),
        learner_busy=min(1.0, sim.learner_busy_s / ends[-1]),
        mean_staleness=sum(sim.staleness) / max(1, len(sim.staleness)),
        step_end_times=ends,
    )
