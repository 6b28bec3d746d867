"""Agent episodes through the roller's OpenAI-compatible endpoint, with the real `openai` SDK as
the client and a real HTTP server scripting SGLang's answers (token ids known exactly)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl.bench.scripted_server import Reply, ScriptedServer
from agentrl.config import EnvConfig, RollerConfig, ZmqQueueConfig
from agentrl.envs.agent import AgentEnv, AgentFailed
from agentrl.envs.registry import env_factory
from agentrl.inference.sglang import SGLangClient
from agentrl.queue.registry import create as create_queue
from agentrl.rollers.agent_endpoint import AgentEndpoint
from agentrl.rollers.agent_episode import AgentSession, RendererCache, run_agent_episode
from agentrl.rollers.chat import ChatRenderer
from agentrl.rollers.roller import Roller
from tests.conftest import find_free_port
from tests.unit.rollers.sdk_agents import RESULTS

AGENTS = "tests.unit.rollers.sdk_agents"
TASK = {"id": "t1", "question": "What colour is the cat?", "animal": "cat"}
CALLS = "".join(
    f'<tool_call>\n{{"name": "lookup", "arguments": {{"animal": "{a}"}}}}\n</tool_call>\n'
    for a in ("cat", "dog")
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


class Policy:
    """Scripted model: two parallel lookups, then an answer once a tool response is in the prompt;
    every reply it gave is kept, to compare with what the episode recorded."""

    def __init__(self, tokenizer, answer: str = "The cat is red.", delay_s: float = 0.0) -> None:
        self.tok, self.answer, self.delay_s = tokenizer, answer, delay_s
        self.outputs: list[list[int]] = []

    def __call__(self, ids: list[int], params: dict) -> Reply:
        text = self.tok.decode(ids)
        out = self.answer if "<tool_response>" in text or "lookup" not in text else CALLS
        out_ids = [*self.tok.encode(out, add_special_tokens=False), self.tok.eos_token_id]
        self.outputs.append(out_ids)
        return Reply(out_ids, logprobs=[-0.5] * len(out_ids), delay_s=self.delay_s)


class Rig:
    def __init__(self, tokenizer, policy: Policy) -> None:
        self.tokenizer, self.policy = tokenizer, policy

    async def __aenter__(self) -> Rig:
        self.server = ScriptedServer(self.policy)
        self.client = SGLangClient(await self.server.start())
        self.endpoint = AgentEndpoint()
        await self.endpoint.start()
        self.renderers = RendererCache(self.tokenizer)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.endpoint.stop()
        await self.client.close()
        await self.server.stop()

    async def run(self, task=TASK, config=None, **kwargs):
        env = AgentEnv(parser="hermes", **kwargs)
        config = config or RollerConfig(max_turns=8, max_new_tokens=128, max_total_tokens=2048)
        return await run_agent_episode(env, task, self.client, self.renderers, config, self.endpoint)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_agent_episode_is_the_servers_tokens_byte_for_byte(tokenizer, stream: bool) -> None:
    policy = Policy(tokenizer)
    task = {**TASK, "id": f"tools-{stream}", "stream": stream}
    async with Rig(tokenizer, policy) as rig:
        episodes = await rig.run(task, agent=f"{AGENTS}:tool_agent", reward=f"{AGENTS}:reward")
        requests = rig.server.requests
    result = RESULTS[task["id"]]
    assert result["finishes"] == ["tool_calls", "stop"] and result["answer"] == "The cat is red."
    (episode,) = episodes
    tokens = list(episode.tokens)
    expected_mask = np.zeros(len(tokens), np.uint8)
    for request, output in zip(requests, policy.outputs, strict=True):
        prompt = request["input_ids"]
        # each request is the episode so far: nothing earlier was rendered again
        assert tokens[: len(prompt) + len(output)] == prompt + output
        expected_mask[len(prompt) : len(prompt) + len(output)] = 1
    assert len(requests) == 2
    assert np.array_equal(episode.loss_mask, expected_mask)  # the loss covers exactly the generated tokens
    generated = episode.loss_mask.astype(bool)
    assert list(episode.tokens[generated]) == [t for out in policy.outputs for t in out]
    assert np.all(episode.logprobs[generated] == -0.5) and np.all(episode.versions[generated] == 0)
    assert np.all(episode.versions[~generated] == -1)
    # the tool results were rendered as the template's tool turns, after the closed assistant turn
    text = tokenizer.decode(tokens)
    assert text.count("<tool_response>") == 2 and "red" in text and "blue" in text
    assert episode.reward == 1.0 and episode.metrics["tool_calls"] == 2
    assert episode.metrics["non_extensions"] == 0 and episode.metrics["reward_source"] == "function"


@pytest.mark.parametrize("mode", ["segment", "drop"])
async def test_an_agent_that_strips_whitespace_starts_new_segments(tokenizer, mode: str) -> None:
    policy = Policy(tokenizer, answer="  Hi there.  ")
    async with Rig(tokenizer, policy) as rig:
        kept = await rig.run({**TASK, "strip": False}, agent=f"{AGENTS}:stripping_agent")
        stripped = await rig.run(
            {**TASK, "strip": True}, agent=f"{AGENTS}:stripping_agent", non_extension=mode
        )
    assert len(kept) == 1 and kept[0].metrics["non_extensions"] == 0 and kept[0].num_turns == 3
    assert stripped[0].metrics["non_extensions"] == 2 and stripped[0].metrics["agent_segments"] == 3
    assert len(stripped) == (3 if mode == "segment" else 1)
    for segment in stripped:  # each segment trains only the turn generated in it, never re-rendered text
        assert list(segment.tokens[segment.loss_mask.astype(bool)]) == policy.outputs[0]
        assert segment.reward == stripped[0].reward


async def test_malformed_requests_get_openai_errors_and_the_episode_goes_on(tokenizer) -> None:
    async with Rig(tokenizer, Policy(tokenizer)) as rig:
        other = AgentSession(
            AgentEnv(agent=f"{AGENTS}:crashing_agent"), rig.client, rig.renderers, RollerConfig()
        )
        rig.endpoint.register(other)
        task = {**TASK, "id": "rude", "other_key": other.key}
        (episode,) = await rig.run(task, agent=f"{AGENTS}:rude_agent")
    seen = RESULTS["rude"]
    for name in ("not_json", "no_messages", "bad_role", "bad_max_tokens", "n2"):
        status, body = seen[name]
        assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, (name, body)
    assert seen["bad_role"][1]["error"]["param"] == "messages[0].role"
    assert seen["other_key"][0] == 401 and seen["no_key"][0] == 401
    assert seen["other_key"][1]["error"]["type"] == "authentication_error"
    assert seen["sdk_error"][0] == 400 and seen["sdk_error"][1]["param"] == "messages[0].content"
    assert seen["models"]["data"][0]["id"] == "agentrl-policy" and seen["reward"] == 200
    assert seen["good"] == "stop" and other.requests == 0  # the other episode saw nothing
    assert episode.metrics["requests_refused"] == 6 and episode.num_generated > 0
    assert episode.reward == 0.75 and episode.metrics["reward_source"] == "posted"


async def test_hanging_crashing_and_looping_agents_end_with_a_reason(tokenizer) -> None:
    async with Rig(tokenizer, Policy(tokenizer)) as rig:
        with pytest.raises(AgentFailed, match=r"after 0\.5 s") as hung:
            await rig.run(agent=f"{AGENTS}:hanging_agent", timeout_s=0.5)
        with pytest.raises(AgentFailed, match="the agent's own bug") as crashed:
            await rig.run(agent=f"{AGENTS}:crashing_agent")
        before = len(rig.server.requests)  # the hung agent's request may not have been answered yet
        with pytest.raises(AgentFailed, match="more than 3 requests") as looped:
            await rig.run(agent=f"{AGENTS}:looping_agent", max_requests=3)
        assert not rig.endpoint.sessions  # every session's key was withdrawn
    assert (hung.value.reason, crashed.value.reason, looped.value.reason) == ("timeout", "agent_error",
                                                                                "max_requests")  # fmt: skip
    assert len(rig.server.requests) - before == 3


async def test_a_subprocess_agent_gets_the_endpoint_in_its_environment(tokenizer) -> None:
    policy = Policy(tokenizer)
    async with Rig(tokenizer, policy) as rig:
        (episode,) = await rig.run(command=[sys.executable, "-m", AGENTS], reward=f"{AGENTS}:reward")
    assert episode.reward == 1.0 and episode.num_turns == 2
    assert list(episode.tokens[episode.loss_mask.astype(bool)]) == [t for o in policy.outputs for t in o]


class Gathering(Policy):
    """Holds every first turn until `n` episodes wait at once: the roller must run them together."""

    def __init__(self, tokenizer, n: int) -> None:
        super().__init__(tokenizer)
        self.n, self.waiting, self.all_in = n, 0, asyncio.Event()

    async def __call__(self, ids: list[int], params: dict) -> Reply:
        if "<tool_response>" not in self.tok.decode(ids):
            self.waiting += 1
            if self.waiting >= self.n:
                self.all_in.set()
            await self.all_in.wait()
        return super().__call__(ids, params)


async def test_200_concurrent_agent_episodes_on_one_roller(tokenizer) -> None:
    server = ScriptedServer(Gathering(tokenizer, 200), record=False)
    url = await server.start()
    backend = create_queue(ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none"))
    queue = backend.server(groups_per_step=1 << 10, max_staleness=1 << 10).start()
    consumer, producer = backend.consumer("rank0", server=queue), backend.producer()
    env = EnvConfig(name="agent", kwargs={"agent": f"{AGENTS}:tool_agent", "reward": f"{AGENTS}:reward"})
    config = RollerConfig(group_size=8, max_concurrent_episodes=200, max_groups=25, max_turns=8,
                          max_total_tokens=2048, log_every_s=60)  # fmt: skip
    tasks = iter([{**TASK, "id": str(i), "shared_client": True} for i in range(1000)])
    client = SGLangClient(url)
    roller = Roller(config, env_factory(env), tasks, client, ChatRenderer(tokenizer), producer)
    try:
        stats = await asyncio.wait_for(roller.run(), 120)
        batch = await asyncio.to_thread(consumer.get_batch, 25, 0, 1 << 10, 10)
    finally:
        await client.close()
        producer.close()
        consumer.close()
        queue.stop()
        await server.stop()
    assert stats.groups_put == 25 and stats.episodes == 200 and stats.groups_failed == 0
    assert stats.peak_in_flight_episodes == 200
    assert len(batch.groups) == 25 and all(len(g.episodes) == 8 for g in batch.groups)
    assert all(ep.reward == 1.0 and ep.num_turns == 2 for g in batch.groups for ep in g.episodes)


class Aborting(Policy):
    """The first turn is aborted after 3 tokens (a weight update) and resumed under version 1."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.rest: list[int] | None = None

    def __call__(self, ids: list[int], params: dict) -> Reply:
        if self.rest is not None:
            rest, self.rest = self.rest, None
            return Reply(rest, logprobs=[-0.25] * len(rest), weight_version=1)
        reply = super().__call__(ids, params)
        if len(self.outputs) == 1:
            self.rest = reply.output_ids[3:]
            return Reply(reply.output_ids[:3], finish="abort", logprobs=[-0.5] * 3, weight_version=0)
        return Reply(reply.output_ids, logprobs=reply.logprobs, weight_version=1)


async def test_a_turn_aborted_by_a_weight_update_is_resumed_with_its_versions(tokenizer) -> None:
    policy = Aborting(tokenizer)
    async with Rig(tokenizer, policy) as rig:
        (episode,) = await rig.run(
            {**TASK, "id": "abort"}, agent=f"{AGENTS}:tool_agent", reward=f"{AGENTS}:reward"
        )
        requests = rig.server.requests
    assert RESULTS["abort"]["finishes"] == ["tool_calls", "stop"] and episode.reward == 1.0
    # the resumed request is prompt + the tokens generated before the abort, nothing re-rendered
    assert requests[1]["input_ids"] == requests[0]["input_ids"] + policy.outputs[0][:3]
    generated = episode.loss_mask.astype(bool)
    first, second = len(policy.outputs[0]), len(policy.outputs[1])
    assert list(episode.versions[generated]) == [0] * 3 + [1] * (first - 3) + [1] * second
    assert episode.metrics["resumed_generations"] == 1


class Recording(SGLangClient):
    """The real client of the embedded server, keeping each reply as it came off the wire."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.replies: list[tuple[list[int], list[int], list[float], int]] = []

    async def generate(self, input_ids, sampling_params, rid=None, session_id=None):
        result = await super().generate(input_ids, sampling_params, rid=rid, session_id=session_id)
        self.replies.append(
            (list(input_ids), list(result.output_ids), list(result.logprobs), result.weight_version)
        )
        return result


async def test_against_the_embedded_server_the_episode_is_what_it_generated(
    tokenizer, tiny_model: Path
) -> None:
    from tests.unit.inference.conftest import ServerThread

    server = ServerThread(tiny_model).start()
    client = Recording(server.url)
    endpoint = AgentEndpoint()
    await endpoint.start()
    config = RollerConfig(max_turns=8, max_new_tokens=12, max_total_tokens=1024)
    try:
        (episode,) = await run_agent_episode(
            AgentEnv(agent=f"{AGENTS}:stripping_agent"), {**TASK, "strip": False}, client,
            RendererCache(tokenizer), config, endpoint,
        )  # fmt: skip
    finally:
        await endpoint.stop()
        await client.close()
        server.stop()
    assert len(client.replies) == 3 and episode.metrics["non_extensions"] == 0
    tokens = list(episode.tokens)
    generated = episode.loss_mask.astype(bool)
    for prompt, output, _, _ in client.replies:
        assert tokens[: len(prompt) + len(output)] == prompt + output  # nothing re-rendered
    assert list(episode.tokens[generated]) == [t for _, out, _, _ in client.replies for t in out]
    expected_logprobs = np.array([lp for _, _, lps, _ in client.replies for lp in lps], np.float32)
    assert np.array_equal(episode.logprobs[generated], expected_logprobs)
    assert int(generated.sum()) == sum(len(out) for _, out, _, _ in client.replies)


@pytest.mark.parametrize("policy", ["override", "refuse"])
async def test_sampling_the_run_fixes_and_a_full_context(tokenizer, policy: str) -> None:
    config = RollerConfig(max_turns=8, max_new_tokens=16, max_total_tokens=256)
    async with Rig(tokenizer, Policy(tokenizer)) as rig:
        task = {**TASK, "id": f"sampling-{policy}"}
        (episode,) = await rig.run(task, config, agent=f"{AGENTS}:sampling_agent", sampling=policy)
    seen = RESULTS[task["id"]]
    status, body = seen["error"]
    if policy == "override":  # answered with the run's temperature, counted; then the context is full
        assert seen["temperature"] == "stop" and episode.metrics["sampling_overridden_temperature"] == 1
        assert status == 400 and body["code"] == "context_length_exceeded"
        assert episode.finish_reason == "context" and episode.num_turns == 1
    else:
        assert "temperature" not in seen and status == 400 and body["param"] == "temperature"
        assert episode.num_generated == 0


class Lookups(Policy):
    """Scripted lookup model: `<lookup> animal </lookup>` first, then the answer read off the result
    (the stop sequence's tokens included, as a server that stopped on it returns them)."""

    def __call__(self, ids: list[int], params: dict) -> Reply:
        text = self.tok.decode(ids)
        if "<result>" in text:
            out = f" <answer> {text.rsplit('<result>', 1)[1].split()[0]} </answer>"
        else:
            out = f"<lookup> {text.rsplit('the ', 1)[1].split()[0]} </lookup>"
        out_ids = self.tok.encode(out, add_special_tokens=False)
        self.outputs.append(out_ids)
        return Reply(out_ids, logprobs=[-0.5] * len(out_ids))


async def test_the_lookup_agent_records_the_built_in_envs_episode_token_for_token(tokenizer) -> None:
    from agentrl.envs.toy import LookupEnv
    from agentrl.rollers.agent_loop import run_episode
    from agentrl.rollers.chat import render_conversation
    from examples.lookup_agent import LookupAgent

    task = LookupEnv.generate_tasks(1, seed=5)[0]
    config = RollerConfig(max_turns=3, max_new_tokens=24, max_total_tokens=256)
    async with Rig(tokenizer, Lookups(tokenizer)) as rig:
        builtin = await run_episode(LookupEnv(), task, rig.client, ChatRenderer(tokenizer), config)
        (agent,) = await run_agent_episode(
            LookupAgent(), task, rig.client, rig.renderers, config, rig.endpoint
        )
    assert builtin.reward == agent.reward == 1.0 and agent.num_turns == 2
    assert list(agent.tokens) == list(builtin.tokens)
    assert list(agent.loss_mask) == list(builtin.loss_mask)
    assert agent.metrics["continued_turns"] == 1 and agent.metrics["non_extensions"] == 0
    # the warm start's demonstrations are laid out as these episodes are
    demo = LookupAgent(teacher_error_rate=0.0).demonstrate(task)
    assert render_conversation(ChatRenderer(tokenizer), demo) == (list(agent.tokens), list(agent.loss_mask))


class Stopping(Policy):
    """Turns a stop sequence cut: "Hi <stop>" first, then " again <stop>" (no end-of-turn token)."""

    def __call__(self, ids: list[int], params: dict) -> Reply:
        out_ids = self.tok.encode(" again <stop>" if self.outputs else "Hi <stop>", add_special_tokens=False)
        self.outputs.append(out_ids)
        return Reply(out_ids, logprobs=[-0.5] * len(out_ids))


async def test_continuing_the_final_message_only_after_what_the_model_wrote(tokenizer) -> None:
    async with Rig(tokenizer, Stopping(tokenizer)) as rig:
        (episode,) = await rig.run({**TASK, "id": "continue"}, agent=f"{AGENTS}:continuing_agent")
    seen = RESULTS["continue"]
    assert seen["continued"] == "stop" and episode.num_turns == 2  # "Hi <stop>" + " more" continued
    for name in ("without_stop", "edited", "with_generation_prompt"):
        assert seen[name][0] == 400 and seen[name][1]["param"] in ("messages", "add_generation_prompt"), name
    text = tokenizer.decode(list(episode.tokens))
    assert text.endswith("<|im_start|>assistant\nHi <stop> more again <stop>")
    assert episode.metrics["continued_turns"] == 1 and episode.metrics["requests_refused"] == 3


# An agent as a sandboxed program sees only the sandbox's /usr: the standard library's HTTP client.
URLLIB_AGENT = r"""
import json, os, sys, urllib.request
task = json.loads(sys.stdin.read())
def ask(messages):
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": messages}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]
try:  # nothing else is reachable from inside: the sandbox has no network of its own
    urllib.request.urlopen("http://10.255.255.1:9/", timeout=2)
    outside = "reached"
except OSError:
    outside = "unreachable"
print(json.dumps({"answer": ask([{"role": "user", "content": task["question"]}]), "outside": outside,
                  "uid": os.getuid(), "cwd": os.getcwd()}))
"""


def _sandboxed_result(transcript, result) -> float:
    RESULTS["sandboxed"] = result
    return 1.0


async def test_a_sandboxed_command_agent_reaches_its_endpoint_and_nothing_else(
    tokenizer, tmp_path: Path
) -> None:
    from agentrl.config import LocalSandboxConfig
    from agentrl.envs.sandbox.local import available_isolation

    uid = 424242 if os.geteuid() == 0 else None
    if "bwrap" not in available_isolation(uid):
        pytest.skip(
            "bubblewrap is not installed or cannot create namespaces here (apt-get install -y bubblewrap)"
        )
    policy = Policy(tokenizer, answer="Red, I think.")
    sandbox = LocalSandboxConfig(isolation="bwrap", disk_mb=0)
    async with Rig(tokenizer, policy) as rig:
        env = AgentEnv(command=["python3", "-c", URLLIB_AGENT], reward=f"{__name__}:_sandboxed_result",
                       sandboxed=True, sandbox=sandbox)  # fmt: skip
        config = RollerConfig(max_turns=4, max_new_tokens=64, max_total_tokens=1024)
        (episode,) = await run_agent_episode(env, TASK, rig.client, rig.renderers, config, rig.endpoint)
    result = RESULTS["sandboxed"]
    assert result["answer"] == "Red, I think." and result["outside"] == "unreachable"
    assert result["cwd"] == sandbox.workdir and (uid is None or result["uid"] != 0)  # a private uid as root
    assert list(episode.tokens[episode.loss_mask.astype(bool)]) == policy.outputs[0]
    # a sandboxed agent that hangs is ended at its wall-time limit, its process tree with it
    from tests.unit.envs.sandbox.conftest import processes_with

    marker = "agentrl-hanging-sandboxed-agent"
    hanging = AgentEnv(command=["python3", "-c", f"import time; time.sleep(3600)  # {marker}"],
                       timeout_s=1.0, sandboxed=True, sandbox=sandbox)  # fmt: skip
    async with Rig(tokenizer, policy) as rig:
        with pytest.raises(AgentFailed, match=r"after 1 s") as hung:
            await run_agent_episode(hanging, TASK, rig.client, rig.renderers, config, rig.endpoint)
    assert hung.value.reason == "timeout" and not processes_with(marker)


def test_only_a_command_agent_in_a_local_sandbox_is_sandboxed() -> None:
    from agentrl.config import DockerSandboxConfig, LocalSandboxConfig

    with pytest.raises(ValueError, match="only a command agent"):
        AgentEnv(agent=f"{AGENTS}:tool_agent", sandboxed=True, sandbox=LocalSandboxConfig())
    with pytest.raises(ValueError, match=r"needs env\.sandbox\.type local"):
        AgentEnv(command=["true"], sandboxed=True, sandbox=DockerSandboxConfig())
    assert AgentEnv(command=["true"], sandbox=LocalSandboxConfig()).sandbox is None  # not asked for
