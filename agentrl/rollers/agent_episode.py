"""One agent episode: the user's agent program drives, the endpoint keeps the tokens.

    episodes = await run_agent_episode(env, task, client, RendererCache(tokenizer), config, endpoint)

Steps of an episode:
1. A session with its own API key is registered with the roller's endpoint
   (`agent_endpoint.AgentEndpoint`), and the agent is started with the endpoint's base URL and
   that key, under the episode's wall-time limit.
2. Each chat-completions request is served by `AgentSession.complete`, one at a time per episode:
   - a request whose messages *extend* the conversation the session holds (same tools, the
     messages held — the assistant turns exactly as the endpoint returned them — then only
     tool/user/system messages) is rendered as the chat template's difference after the tokens
     already there: the tokens that close the last assistant turn, then the new turns and the
     generation prompt (`ChatRenderer.close_turn_ids` / `observation_ids`, the agent loop's own
     rendering). Earlier turns are never rendered again;
   - any other request (history truncated or summarised, another system prompt, tools changed,
     an assistant message edited — even whitespace) starts a new *segment*: a fresh sequence
     rendered from its messages. Segments are counted (`non_extensions`) and, per
     `env.kwargs.non_extension`, each becomes its own `Episode` with the episode's reward
     (`segment`) or only the first is trained (`drop`);
   - the turn is generated from the exact ids so far by the agent loop's `_generate_turn`, so
     aborts on a weight update are resumed and each token keeps the version that produced it;
     generated ids and log-probs are recorded as the server returned them (mask 1), everything
     else is context (mask 0).
3. The agent returns (its result goes to the reward) or fails: it raises or exits non-zero
   (`agent_error`), runs past `timeout_s` (`timeout`), or past `max_requests` /
   `max_generated_tokens` (the request gets a 400 and the agent is ended). A failure raises
   `AgentFailed` with that reason, and the roller drops the group like any failed group (its
   admission is given back).
4. The reward (`AgentEnv.score`: the user's function of the transcript and the result, the
   verifier env, or the reward the agent posted) goes on the last generated token of every
   trained segment; with a reward model its weighted score is added, as in the agent loop.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.config import RollerConfig
from agentrl.envs.agent import AgentEnv, AgentFailed
from agentrl.envs.base import Transcript, resolve
from agentrl.inference.base import InferenceClient
from agentrl.rollers.agent_loop import _generate_turn, _Trace, off_loop, sampling_params
from agentrl.rollers.agent_protocol import ChatRequest, EndpointError, Turn
from agentrl.rollers.chat import ChatRenderer
from agentrl.types import Episode

if TYPE_CHECKING:
    from agentrl.rewards.client import RewardModelClient


class SessionHost(Protocol):
    """Where an episode's session is served (`agent_endpoint.AgentEndpoint`)."""

    def register(self, session: AgentSession) -> None: ...
    def unregister(self, session: AgentSession) -> None: ...
    def url(self, session: AgentSession) -> str: ...


@dataclass
class _Segment:
    """One token sequence of an episode: the conversation it holds and its tokens."""

    tools_key: str
    renderer: ChatRenderer
    trace: _Trace = field(default_factory=_Trace)
    held: list[str] = field(default_factory=list)  # canonical JSON of each message held
    last_output: list[int] = field(default_factory=list)
    last_text: str = ""  # the last assistant message's text as the sequence holds it (stop included)
    open_text: str = ""  # a continued assistant message's text so far: the next turn goes on from it


class AgentSession:
    """The endpoint's state for one episode (its key, segments, counters and limits)."""

    def __init__(
        self,
        env: AgentEnv,
        client: InferenceClient,
        renderers: RendererCache,
        config: RollerConfig,
        greedy: bool = False,
    ) -> None:
        self.key = "agentrl-" + secrets.token_urlsafe(24)
        self.env, self.client, self.renderers = env, client, renderers
        self.config, self.greedy = config, greedy
        self.session_id = uuid.uuid4().hex
        self.segments: list[_Segment] = []
        self.counts: Counter[str] = Counter()
        self.requests = 0
        self.generated = 0
        self.finish_reason = "done"
        self.posted_reward: float | None = None
        self.failure: AgentFailed | None = None  # a limit the endpoint found; ends the agent
        self.ended = asyncio.Event()
        self.last_messages: list[dict[str, Any]] = []
        self.final_text = ""
        self.gen_time = 0.0
        self._lock = asyncio.Lock()

    @property
    def max_requests(self) -> int:
        return self.env.max_requests or self.config.max_turns

    def fail(self, reason: str, message: str) -> EndpointError:
        """End the episode for a limit: the agent is stopped, the request answered with a 400."""
        if self.failure is None:
            self.failure = AgentFailed(reason, message)
            self.ended.set()
        return EndpointError(400, message, code=reason)

    async def complete(self, request: ChatRequest) -> Turn:
        async with self._lock:  # one sequence grows one way: an episode's requests queue up
            if self.failure is not None:
                raise EndpointError(400, f"this episode has ended: {self.failure}", code=self.failure.reason)
            if self.finish_reason == "context":
                raise EndpointError(400, "this episode's context is full (roller.max_total_tokens)",
                                    param="messages", code="context_length_exceeded")  # fmt: skip
            self.requests += 1
            if self.requests > self.max_requests:
                raise self.fail("max_requests", f"episode limit: more than {self.max_requests} requests "
                                "(env.kwargs.max_requests)")  # fmt: skip
            limit = self.env.max_generated_tokens
            if limit is not None and self.generated >= limit:
                raise self.fail("max_generated_tokens", f"episode limit: {self.generated} tokens generated, "
                                f"limit {limit} (env.kwargs.max_generated_tokens)")  # fmt: skip
            self._check_sampling(request)
            segment = await self._place(request)
            return await self._generate(segment, request)

    def _check_sampling(self, request: ChatRequest) -> None:
        run = {"temperature": 0.0 if self.greedy else self.config.temperature,
               "top_p": 1.0 if self.greedy else self.config.top_p}  # fmt: skip
        for name, value in (("temperature", request.temperature), ("top_p", request.top_p)):
            if value is None or abs(value - run[name]) < 1e-9:
                continue
            if self.env.sampling == "refuse":
                raise EndpointError(400, f"{name} {value} differs from the run's {run[name]}: the run fixes "
                                    "sampling (leave it out, or set env.kwargs.sampling: override)", param=name)  # fmt: skip
            self.counts[f"sampling_overridden_{name}"] += 1

    async def _place(self, request: ChatRequest) -> _Segment:
        """The segment this request extends (its new turns appended as context), or a new one."""
        tools_key = json.dumps(request.tools, sort_keys=True) if request.tools else ""
        held = [json.dumps(m, sort_keys=True) for m in request.messages]
        current = self.segments[-1] if self.segments else None
        if request.continue_final:
            return await self._continue(current, tools_key, held, request.messages[-1])
        if current is not None and _extends(current, tools_key, held, request.messages):
            new = request.messages[len(current.held) :]
            renderer = current.renderer
            size = sum(len(m.get("content") or "") for m in new)
            ids = renderer.close_turn_ids(current.last_output)
            ids += await off_loop(size, renderer.observation_ids, new)
            current.trace.add_context(ids)
            current.held, current.open_text = held, ""
            return current
        if request.messages[-1]["role"] == "assistant":
            raise EndpointError(400, "the last message is an assistant message: end with a user or tool "
                                "message, or continue the episode's last turn (continue_final_message)",
                                param="messages")  # fmt: skip
        if current is not None:
            self.counts["non_extensions"] += 1
        renderer = await self.renderers.get(request.tools)
        segment = _Segment(tools_key, renderer, held=held)
        segment.trace.add_context(await off_loop(len(held[-1]), renderer.prompt_ids, request.messages))
        self.segments.append(segment)
        return segment

    async def _continue(
        self, current: _Segment | None, tools_key: str, held: list[str], final: dict[str, Any]
    ) -> _Segment:
        """The segment whose last turn `final` continues: the text the agent wrote after the model's
        (the model's text, the stop sequence that ended it included, must come first) is appended
        verbatim as context (mask 0), and the model goes on in the same turn, as an env's
        observation text does in the agent loop."""
        if final["role"] != "assistant" or final.get("tool_calls"):
            raise EndpointError(400, "continue_final_message needs a last assistant message without tool calls",
                                param="messages")  # fmt: skip
        if current is None or not _continues(current, tools_key, held, final["content"]):
            raise EndpointError(400, "continue_final_message continues only the episode's last turn: the same "
                                "messages before it, and its text starting with what the model wrote, the "
                                "stop sequence that ended it included (a turn the model ended with its "
                                "end-of-turn token cannot be continued)", param="messages")  # fmt: skip
        added = final["content"][len(current.last_text) :]
        current.trace.add_context(await off_loop(len(added), current.renderer.encode, added))
        current.held, current.open_text = held, final["content"]
        self.counts["continued_turns"] += 1
        return current

    async def _generate(self, segment: _Segment, request: ChatRequest) -> Turn:
        trace, config = segment.trace, self.config
        prompt_tokens = len(trace.tokens)
        budget = config.max_total_tokens - prompt_tokens
        if self.env.max_generated_tokens is not None:
            budget = min(budget, self.env.max_generated_tokens - self.generated)
        if budget <= 0:
            self.finish_reason = "context"
            raise EndpointError(400, f"this conversation is {prompt_tokens} tokens: no room left in "
                                f"roller.max_total_tokens {config.max_total_tokens}", param="messages",
                                code="context_length_exceeded")  # fmt: skip
        max_new = min(config.max_new_tokens, budget, request.max_tokens or budget)
        params = sampling_params(config, max_new, request.stop, self.greedy)
        t0 = time.perf_counter()
        try:
            result = await _generate_turn(self.client, trace, params, self.session_id)
        except (
            Exception
        ) as exc:  # the router retried elsewhere first: the episode fails, as in the agent loop
            raise self.fail("server_error", f"generation failed: {exc}") from exc
        self.gen_time += time.perf_counter() - t0
        trace.turns += 1
        n = len(result.output_ids)
        self.generated += n
        segment.last_output = result.output_ids
        text = await off_loop(n, segment.renderer.decode, result.output_ids)
        segment.last_text = segment.open_text + text
        for stop in request.stop:  # as OpenAI: the stop sequence is not part of the content
            if stop and text.endswith(stop):
                text = text[: -len(stop)]
                break
        turn = self._turn(text, request, result.finish_reason, prompt_tokens, n)
        message: dict[str, Any] = {"role": "assistant", "content": segment.open_text + (turn.content or "")}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c["function"]["name"],
                                                  "arguments": json.loads(c["function"]["arguments"])}}
                for c in turn.tool_calls
            ]  # fmt: skip
        previous = request.messages[:-1] if request.continue_final else request.messages
        segment.held[len(previous) :] = [json.dumps(message, sort_keys=True)]
        self.last_messages = [*previous, message]
        self.final_text = text
        return turn

    def _turn(self, text: str, request: ChatRequest, finish: str, prompt_tokens: int, n: int) -> Turn:
        calls: list[dict[str, Any]] = []
        content: str | None = text
        if request.tools and request.tool_choice != "none":
            parsed = self.env.parser.parse(text)
            if parsed.errors:
                self.counts["tool_parse_errors"] += len(parsed.errors)
            if parsed.calls:
                calls = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                    for c in parsed.calls
                ]  # fmt: skip
                content = parsed.content or None
                self.counts["tool_calls"] += len(calls)
        reason = "length" if finish == "length" else ("tool_calls" if calls else "stop")
        return Turn(text, content, calls, reason, prompt_tokens, n)


def _extends(segment: _Segment, tools_key: str, held: list[str], messages: list[dict]) -> bool:
    """True if `messages` are the segment's conversation followed by new non-assistant turns."""
    n = len(segment.held)
    if tools_key != segment.tools_key or len(held) <= n or held[:n] != segment.held:
        return False
    return bool(segment.held) and all(m["role"] != "assistant" for m in messages[n:])


def _continues(segment: _Segment, tools_key: str, held: list[str], text: str) -> bool:
    """True if `held` is the segment's conversation with its last (assistant) message extended to
    `text`, and the model's turn there was cut by a stop sequence or the length, not ended."""
    n = len(segment.held)
    ended = bool(segment.last_output) and segment.last_output[-1] in segment.renderer.eos_ids
    return (
        tools_key == segment.tools_key and len(held) == n and held[:-1] == segment.held[:-1]
        and bool(segment.last_output) and not ended and text.startswith(segment.last_text)
    )  # fmt: skip


class RendererCache:
    """One `ChatRenderer` per tool set (the template renders the tools into the prompt)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._by_tools: dict[str, asyncio.Future[ChatRenderer]] = {}

    async def get(self, tools: list[dict] | None) -> ChatRenderer:
        """The renderer of this tool set, built once in a worker thread; episodes that ask for it
        while it is being built wait for that one."""
        key = json.dumps(tools, sort_keys=True) if tools else ""
        built = self._by_tools.get(key)
        if built is None:
            built = asyncio.ensure_future(asyncio.to_thread(ChatRenderer, self.tokenizer, tools or None))
            self._by_tools[key] = built
            if len(self._by_tools) > 256:
                self._by_tools.pop(next(iter(self._by_tools)))
        try:
            return await asyncio.shield(built)
        except Exception:
            self._by_tools.pop(key, None)  # a template that fails is tried again by the next episode
            raise


async def run_agent_episode(
    env: AgentEnv,
    task: dict[str, Any],
    client: InferenceClient,
    renderers: RendererCache,
    config: RollerConfig,
    endpoint: SessionHost,
    reward_model: RewardModelClient | None = None,
    greedy: bool = False,
) -> list[Episode]:
    """Run the agent on `task` and return the episode's trained segments (one `Episode` each;
    at least one). Raises `AgentFailed` if the agent failed or went past a limit."""
    session = AgentSession(env, client, renderers, config, greedy)
    start = time.perf_counter()
    timeout = env.timeout_s or config.episode_timeout_s
    endpoint.register(session)
    try:
        await resolve(env.reset(task))
        result = await _run_until_ended(env, session, endpoint.url(session), task, timeout)
        transcript = Transcript(task, session.last_messages, session.final_text,
                                sum(s.trace.turns for s in session.segments), session.finish_reason,
                                dict(session.counts))  # fmt: skip
        reward, source = await env.score(transcript, result, session.posted_reward)
        scored: dict[str, Any] = {}
        if reward_model is not None:
            score = await reward_model.score(session.last_messages)
            scored = {"rule_reward": reward, "reward_model_score": score}
            reward += reward_model.config.weight * score
    finally:
        endpoint.unregister(session)
        await resolve(env.close())
    segments = session.segments or [_Segment("", await renderers.get(None))]
    if env.non_extension == "drop":
        segments = segments[:1]
    metrics = {
        **{k: v for k, v in session.counts.items()},
        "agent_requests": session.requests,
        "agent_segments": len(session.segments),
        "non_extensions": session.counts["non_extensions"],
        "reward_source": source,
        "generation_s": round(session.gen_time, 6),
        "episode_s": round(time.perf_counter() - start, 6),
        **scored,
    }
    return [await _episode(seg, i, reward, session, metrics) for i, seg in enumerate(segments)]


async def _run_until_ended(
    env: AgentEnv, session: AgentSession, base_url: str, task: dict[str, Any], timeout: float
) -> Any:
    """The agent's result; `AgentFailed` when it fails, hangs past `timeout` or hits a limit."""
    agent = asyncio.ensure_future(env.run_agent(base_url, session.key, task))
    ended = asyncio.ensure_future(session.ended.wait())
    try:
        done, _ = await asyncio.wait({agent, ended}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    if agent in done and session.failure is None:
        return agent.result()  # AgentFailed of a crash propagates
    agent.cancel()
    await asyncio.gather(agent, return_exceptions=True)
    if session.failure is not None:
        raise session.failure
    raise AgentFailed("timeout", f"agent still running after {timeout:g} s (env.kwargs.timeout_s)")


async def _episode(
    segment: _Segment, index: int, reward: float, session: AgentSession, metrics: dict[str, Any]
) -> Episode:
    trace = segment.trace
    mask = trace.mask
    last_generated = len(mask) - 1 - mask[::-1].index(1) if 1 in mask else -1
    trace.add_turn_reward(last_generated, reward)
    seg_metrics = {**metrics, "segment": index, "resumed_generations": trace.resumed,
                   "prompt_tokens": mask.index(1) if 1 in mask else len(mask)}  # fmt: skip
    return await off_loop(
        len(trace.tokens),
        lambda: Episode(
            trace.tokens, trace.mask, trace.logprobs, trace.versions, reward=reward, num_turns=trace.turns,
            finish_reason=session.finish_reason, metrics=seg_metrics, reward_pos=trace.reward_pos,
            turn_rewards=trace.turn_rewards, routed_experts=trace.routed_experts(),
        ),
    )  # fmt: skip
