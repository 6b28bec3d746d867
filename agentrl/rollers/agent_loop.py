"""The agent loop: run one multi-turn episode, token-in/token-out, into an `Episode`.

    episode = await run_episode(env, task, client, renderer, config)

Steps of an episode:
1. `env.reset(task)` gives the opening messages; the prompt is rendered once.
2. Each turn: generate from the exact ids so far. If the server aborts the request
   (weights are being updated), resubmit prompt + tokens so far; the new tokens carry
   the new weight version. A request the server failed is not an abort: it raises (the
   router retried it elsewhere first) and the episode fails with the server's message. Generated ids, behaviour log-probs and versions are kept as
   the server returned them (mask 1).
3. `env.step(text)` answers with an observation: chat messages (rendered as the
   template's delta after the closed assistant turn) or raw text (appended verbatim,
   for continuation protocols like Search-R1). Both are mask 0, version −1.
4. The episode ends when the env says done, or at a limit — max turns, the context
   budget (`max_total_tokens`), a generation cut by length, or the wall-clock timeout —
   with the reason recorded in `finish_reason`.
5. `env.reward(transcript)` (plus any per-step rewards) is the episode's reward. Each
   turn's step reward is also kept per turn, on the last generated token of its turn, and
   the final reward is added on the episode's last generated token (`Episode.reward_pos`,
   `Episode.turn_rewards`). With a reward model (`reward.url`), its score of the transcript's
   messages, times `reward.weight`, is added to the final reward; the episode's metrics keep
   `rule_reward` (the env's part), `reward_model_score` and `reward_model_s` (the wait).

A greedy episode (`greedy=True`, ReMax's baseline) samples with temperature 0 and top-k 1.

The roller runs thousands of episodes on one event loop, so no step of one episode may hold
the loop for long: work that grows with what the model wrote (decoding a turn, rendering and
tokenizing a large observation, building the episode's arrays) runs in a worker thread once it
is larger than `OFF_LOOP_ITEMS` (tokens or characters); below that a thread hop costs more than
the work.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from agentrl.envs.base import Env, Transcript, as_step_result, resolve
from agentrl.inference.base import GenerateResult, InferenceClient
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.config import RollerConfig
from agentrl.types import Episode

if TYPE_CHECKING:
    from agentrl.rewards.client import RewardModelClient

OFF_LOOP_ITEMS = 1 << 15
"""Tokens (or characters) beyond which a step's work moves off the event loop."""

_T = TypeVar("_T")


async def off_loop(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """`fn(*args)` inline when `size` is small, else in a worker thread (the loop stays free)."""
    if size <= OFF_LOOP_ITEMS:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


@dataclass
class _Trace:
    """An episode under construction (kept outside the timed section so a timeout keeps it)."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed: list[Any] = field(default_factory=list)
    """Per token, the experts it was routed to when fed to the server (int32 [layers·top_k]; MoE
    servers asked for them), None where no reply covered it yet."""
    messages: list[dict] = field(default_factory=list)
    final_text: str = ""
    turns: int = 0
    step_rewards: list[float] = field(default_factory=list)
    reward_pos: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    finish_reason: str = "max_turns"
    resumed: int = 0
    gen_time: float = 0.0
    env_time: float = 0.0

    def add_context(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [-1] * len(ids)
        self.routed += [None] * len(ids)

    def add_generated(self, result: GenerateResult) -> None:
        n = len(result.output_ids)
        if len(result.logprobs) != n:
            raise ValueError(f"server returned {n} tokens but {len(result.logprobs)} log-probs")
        self.tokens += result.output_ids
        self.mask += [1] * n
        self.logprobs += result.logprobs
        self.versions += [result.weight_version] * n
        self.routed += [None] * n
        if result.routed_experts is not None:  # rows of prompt + output − 1 tokens
            for pos, row in enumerate(result.routed_experts[: len(self.routed)]):
                if self.routed[pos] is None:  # a token keeps the routing of the turn that first fed it
                    self.routed[pos] = row

    def routed_experts(self) -> Any:
        """`Episode.routed_experts`: int32 [T, layers·top_k], -1 on tokens no reply covered; None
        without any record."""
        width = next((len(row) for row in self.routed if row is not None), 0)
        if not width:
            return None
        import numpy as np

        out = np.full((len(self.routed), width), -1, np.int32)
        for pos, row in enumerate(self.routed):
            if row is not None:
                out[pos] = row
        return out

    def add_turn_reward(self, pos: int, reward: float) -> None:
        """Put `reward` on token `pos`; a position at or before the last one adds to it (a turn
        that generated nothing has no token of its own)."""
        if pos < 0:
            return
        if self.reward_pos and pos <= self.reward_pos[-1]:
            self.turn_rewards[-1] += reward
        else:
            self.reward_pos.append(pos)
            self.turn_rewards.append(reward)


def sampling_params(
    config: RollerConfig, max_new_tokens: int, stop: list[str], greedy: bool = False
) -> dict[str, Any]:
    """SGLang sampling params of one turn; `greedy`: argmax decoding (SGLang's temperature 0)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0 if greedy else config.temperature,
        "top_p": 1.0 if greedy else config.top_p,
        "top_k": 1 if greedy else config.top_k,
    }
    if stop:
        params["stop"] = list(stop)
    return params


async def _generate_turn(
    client: InferenceClient, trace: _Trace, params: dict[str, Any], session_id: str
) -> GenerateResult:
    """Generate one assistant turn, resuming across aborts (weight updates)."""
    budget = params["max_new_tokens"]
    start = len(trace.tokens)
    while True:
        rid = uuid.uuid4().hex
        result = await client.generate(
            trace.tokens, {**params, "max_new_tokens": budget}, rid=rid, session_id=session_id
        )
        trace.add_generated(result)
        budget -= len(result.output_ids)
        if result.finish_reason != "abort":
            break
        trace.resumed += 1
        if budget <= 0:
            result.finish_reason = "length"
            break
    result.output_ids = trace.tokens[start:]  # the whole turn, across resumes
    return result


async def _run_turns(
    env: Env,
    trace: _Trace,
    client: InferenceClient,
    renderer: ChatRenderer,
    config: RollerConfig,
    session_id: str,
    greedy: bool = False,
) -> None:
    stop = list(getattr(env, "stop", ()) or ())
    for _ in range(config.max_turns):
        budget = config.max_total_tokens - len(trace.tokens)
        if budget <= 0:
            trace.finish_reason = "context"
            return
        params = sampling_params(config, min(config.max_new_tokens, budget), stop, greedy)
        t0 = time.perf_counter()
        result = await _generate_turn(client, trace, params, session_id)
        trace.gen_time += time.perf_counter() - t0
        trace.turns += 1
        text = await off_loop(len(result.output_ids), renderer.decode, result.output_ids)
        trace.messages.append({"role": "assistant", "content": text})
        trace.final_text = text
        if result.finish_reason == "length":
            trace.finish_reason = "context" if len(trace.tokens) >= config.max_total_tokens else "length"
            return
        t0 = time.perf_counter()
        step = as_step_result(await resolve(env.step(text)))
        trace.env_time += time.perf_counter() - t0
        trace.step_rewards.append(step.reward)
        trace.add_turn_reward(len(trace.tokens) - 1, float(step.reward))  # the turn's last token
        if step.done:
            trace.finish_reason = "done"
            return
        await _append_observation(trace, step.observation, result.output_ids, renderer)
        if len(trace.tokens) >= config.max_total_tokens:
            trace.finish_reason = "context"
            return


async def _append_observation(
    trace: _Trace, observation: Any, output_ids: list[int], renderer: ChatRenderer
) -> None:
    if observation is None:
        raise ValueError("Env.step returned no observation for an episode that is not done")
    if isinstance(observation, str):  # raw continuation text, same assistant turn goes on
        trace.add_context(await off_loop(len(observation), renderer.encode, observation))
        trace.messages.append({"role": "observation", "content": observation})
        return
    size = sum(len(m["content"]) if isinstance(m.get("content"), str) else 1 for m in observation)
    trace.add_context(renderer.close_turn_ids(output_ids))
    trace.add_context(await off_loop(size, renderer.observation_ids, observation))
    trace.messages.extend(observation)


async def run_episode(
    env: Env,
    task: dict[str, Any],
    client: InferenceClient,
    renderer: ChatRenderer,
    config: RollerConfig,
    reward_model: RewardModelClient | None = None,
    greedy: bool = False,
) -> Episode:
    """Run one episode to its end and return it; env errors propagate, limits do not, and a
    reward model that cannot score raises its `RewardModelError`."""
    trace = _Trace()
    scored: dict[str, float] = {}
    start = time.perf_counter()
    try:
        opening = await resolve(env.reset(task))
        if isinstance(opening, str):
            trace.messages.append({"role": "prompt", "content": opening})
            trace.add_context(renderer.encode(opening))
        else:
            trace.messages.extend(opening)
            trace.add_context(renderer.prompt_ids(opening))
        try:
            await asyncio.wait_for(
                _run_turns(env, trace, client, renderer, config, uuid.uuid4().hex, greedy),
                config.episode_timeout_s,
            )
        except TimeoutError:
            trace.finish_reason = "timeout"
        transcript = Transcript(
            task, trace.messages, trace.final_text, trace.turns, trace.finish_reason, dict(env.metrics)
        )
        final = float(await resolve(env.reward(transcript)))
        if reward_model is not None:
            t0 = time.perf_counter()
            score = await reward_model.score(trace.messages)
            scored = {"rule_reward": final + sum(trace.step_rewards), "reward_model_score": score,
                      "reward_model_s": round(time.perf_counter() - t0, 6)}  # fmt: skip
            final += reward_model.config.weight * score
        reward = final + sum(trace.step_rewards)
        last_generated = len(trace.mask) - 1 - trace.mask[::-1].index(1) if 1 in trace.mask else -1
        trace.add_turn_reward(last_generated, final)
    finally:
        await resolve(env.close())
    metrics = {
        **{k: v for k, v in env.metrics.items() if isinstance(v, (int, float, str, bool))},
        "resumed_generations": trace.resumed,
        "generation_s": round(trace.gen_time, 6),
        "env_s": round(trace.env_time, 6),
        "episode_s": round(time.perf_counter() - start, 6),
        "prompt_tokens": trace.mask.index(1) if 1 in trace.mask else len(trace.mask),
        **scored,
    }
    # the arrays are built (and checked) from Python lists: ~0.3 s per million tokens
    return await off_loop(
        len(trace.tokens),
        lambda: Episode(
            trace.tokens,
            trace.mask,
            trace.logprobs,
            trace.versions,
            reward=reward,
            num_turns=trace.turns,
            finish_reason=trace.finish_reason,
            metrics=metrics,
            reward_pos=trace.reward_pos,
            turn_rewards=trace.turn_rewards,
            routed_experts=trace.routed_experts(),
        ),
    )
