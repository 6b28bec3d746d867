"""`SGLangClient`'s LoRA adapters against the strict SGLang 0.5.23 stand-in
(tests/sglang_standin_lora.py names the wheel's file behind each rule): versioned names,
the limits read from `/server_info` and checked before anything is sent, loads believed only
when read back from `/v1/models`, requests naming the newest served version (`lora_path`),
and every body the client sends on these routes one 0.5.23 takes (tests/unit/inference/schemas.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agentrl.inference.lora import (
    AdapterError,
    AdapterLimitError,
    AdapterSpec,
    adapter_name,
    check_servers,
    newest,
)
from agentrl.inference.sglang import SGLangClient
from tests.sglang_standin import StandInSGLang
from tests.unit.inference import schemas as S

PARAMS = {"max_new_tokens": 6, "ignore_eos": True}


def adapter(directory: Path, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0) -> Path:
    """A PEFT-format adapter directory (`adapter_config.json`, `adapter_model.safetensors`)."""
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": list(targets)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {
        f"{prefix}.{m}.lora_{ab}.weight": torch.randn(rank, rank, generator=gen)
        for m in targets
        for ab in "AB"
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


@pytest.fixture
def standin():
    server = StandInSGLang(device="cpu", token_interval_s=0.0, lora={"max_lora_rank": 8}).start()
    yield server
    server.stop()


def test_names_carry_the_version() -> None:
    assert adapter_name("policy", 3) == "policy-v3"
    assert newest({"policy-v3": "/a", "policy-v12": "/b", "critic-v40": "/c", "policy": "/d"}, "policy") == (
        "policy-v12",
        12,
    )
    assert newest({"critic-v1": "/c"}, "policy") is None
    with pytest.raises(ValueError, match="-v<N>"):
        adapter_name("policy-v2", 3)


async def test_load_serve_and_unload_by_version(standin: StandInSGLang, tmp_path: Path) -> None:
    paths = {v: adapter(tmp_path / f"a{v}", seed=v) for v in (1, 2)}
    async with SGLangClient(standin.url, lora="policy") as client:
        base = await client.generate([1, 2, 3], PARAMS)  # nothing loaded: the base model
        assert base.weight_version == 0 and standin.generated_with == [None]
        results = {}
        for version, path in paths.items():
            assert await client.load_adapter("policy", str(path), version) == f"policy-v{version}"
            assert await client.get_weight_version() == version
            results[version] = await client.generate([1, 2, 3], PARAMS)
            assert results[version].weight_version == version
            assert standin.generated_with[-1] == f"policy-v{version}"
        # each adapter's weights drive its output: the request reached the adapter it named
        assert len({tuple(r.output_ids) for r in (base, *results.values())}) == 3
        assert await client.served_adapters() == {f"policy-v{v}": str(p) for v, p in paths.items()}
        await client.unload_adapter("policy-v2")
        assert await client.get_weight_version() == 1  # the newest one served
        with pytest.raises(AdapterError, match="does not exist"):
            await client.unload_adapter("policy-v2")
    for route, body in standin.lora_bodies:
        {"/load_lora_adapter": S.SGLangLoadLoRAReq, "/unload_lora_adapter": S.SGLangUnloadLoRAReq}[
            route
        ].model_validate(body)
    payload = {**SGLangClient("http://x").generate_payload([1], PARAMS, None, None), "lora_path": "policy-v1"}
    S.SGLangGenerateReq.model_validate(payload)


async def test_limits_are_read_from_the_server_and_checked_before_sending(tmp_path: Path) -> None:
    server = StandInSGLang(
        device="cpu", lora={"max_lora_rank": 8, "lora_target_modules": ["qkv_proj", "o_proj"]}
    ).start()
    try:
        async with SGLangClient(server.url) as client:
            limits = await client.adapter_limits()
            assert (limits.max_rank, limits.max_loras, limits.target_modules) == (
                8,
                8,
                frozenset({"qkv_proj", "o_proj"}),
            )
            with pytest.raises(AdapterLimitError, match=r"rank 16 is above .*--max-lora-rank 8"):
                await client.load_adapter("policy", str(adapter(tmp_path / "big", rank=16)), 1)
            with pytest.raises(
                AdapterLimitError, match=r"\['down_proj'\] are not in .*--lora-target-modules"
            ):
                await client.load_adapter("policy", str(adapter(tmp_path / "mlp", targets=("down_proj",))), 1)
            assert server.lora_bodies == []  # refused before anything was sent
            # q_proj / v_proj fit SGLang's fused qkv_proj buffers
            assert await client.load_adapter("policy", str(adapter(tmp_path / "attn")), 1) == "policy-v1"
    finally:
        server.stop()


async def test_what_the_server_refuses_or_does_not_serve_is_a_failure(
    standin: StandInSGLang, tmp_path: Path
) -> None:
    good = adapter(tmp_path / "good")
    async with SGLangClient(standin.url, lora="policy") as client:
        # sent past the client's check, SGLang refuses a rank above its limit with its own message
        with pytest.raises(AdapterError, match="incompatible with the current LoRA memory pool"):
            await client._load("policy-v1", str(adapter(tmp_path / "big", rank=16)))
        broken = adapter(tmp_path / "broken")
        (broken / "adapter_model.safetensors").unlink()
        with pytest.raises(AdapterError, match=r"adapter_model\.safetensors"):
            await client.load_adapter("policy", str(broken), 1)
        standin.lose_loads = 1  # answers success, serves nothing
        with pytest.raises(AdapterError, match="answered success, but the server lists 'no such adapter'"):
            await client.load_adapter("policy", str(good), 1)
        assert await client.served_adapters() == {}
        assert (await client.generate([1, 2], PARAMS)).weight_version == 0  # still the base model
        await client.load_adapter("policy", str(good), 1)
        with pytest.raises(AdapterError, match="already loaded"):
            await client._load("policy-v1", str(good))
        # the same version again (a redone push) from other weights: unloaded, then loaded afresh
        redone = adapter(tmp_path / "redone", seed=5)
        digest = standin.adapters["policy-v1"]["digest"]
        assert await client.load_adapter("policy", str(redone), 1) == "policy-v1"
        assert standin.adapters["policy-v1"]["digest"] != digest
        assert await client.served_adapters() == {"policy-v1": str(redone)}


async def test_a_server_without_lora_says_so(tmp_path: Path) -> None:
    server = StandInSGLang(device="cpu").start()
    try:
        async with SGLangClient(server.url) as client:
            with pytest.raises(AdapterError, match="without --enable-lora"):
                await client.load_adapter("policy", str(adapter(tmp_path / "a")), 1)
            with pytest.raises(AdapterError, match="LoRA is not enabled"):
                await client._load("policy-v1", str(tmp_path / "a"))
            reply = await client.http.request("GET", "/server_info")
            assert reply["enable_lora"] is False
    finally:
        server.stop()


def test_adapter_spec_reads_peft_configs(tmp_path: Path) -> None:
    path = adapter(tmp_path / "a", rank=4, targets=("v_proj", "q_proj"))
    config = json.loads((path / "adapter_config.json").read_text())
    assert AdapterSpec.from_dir(path) == AdapterSpec(4, ("q_proj", "v_proj"))
    assert AdapterSpec.from_config({**config, "rank_pattern": {"q_proj": 32}}).rank == 32
    with pytest.raises(AdapterLimitError, match="only LORA"):
        AdapterSpec.from_config({**config, "peft_type": "IA3"})
    with pytest.raises(AdapterError, match="not a readable PEFT adapter config"):
        AdapterSpec.from_dir(tmp_path / "missing")


async def test_check_servers_before_training_names_the_server_and_the_limit() -> None:
    small = StandInSGLang(device="cpu", lora={"max_lora_rank": 8}).start()
    large = StandInSGLang(device="cpu", lora={"max_lora_rank": 64}).start()
    try:
        clients = [SGLangClient(small.url), SGLangClient(large.url)]
        await check_servers(clients, AdapterSpec(8, ("q_proj", "v_proj")))
        with pytest.raises(AdapterLimitError, match=rf"rank 32 is above {small.url}'s --max-lora-rank 8"):
            await check_servers(clients, AdapterSpec(32, ("q_proj",)))
        for client in clients:
            await client.close()
    finally:
        small.stop()
        large.stop()


@pytest.mark.slow  # a process of its own: ~10 s on a busy machine (torch's import)
def test_the_standin_takes_sglangs_lora_flags(processes) -> None:
    """`python -m tests.sglang_standin --enable-lora ...` (the flags of `sglang_launch`)."""
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.conftest import find_free_port

    port = find_free_port()
    flags = ["--enable-lora", "--max-lora-rank", "32", "--lora-target-modules", "q_proj", "v_proj"]
    processes.start([sys.executable, "-m", "tests.sglang_standin", "--port", str(port), *flags],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as reply:
                info = json.loads(reply.read())
            break
        except OSError:
            assert time.monotonic() < deadline, "the stand-in did not start"
            time.sleep(0.2)
    assert info["enable_lora"] and info["max_lora_rank"] == 32
    assert info["lora_target_modules"] == ["q_proj", "v_proj"]
