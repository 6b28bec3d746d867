"""The vLLM worker extension's commit and its rollback, with vLLM's model runner stood in for.

`Runner` stands in for vLLM 0.32's `GPUModelRunner` (`vllm/v1/worker/gpu_model_runner.py`):
`reload_weights(weights_iterator=None, weights_path=None, is_checkpoint_format=True)` copies a
checkpoint into the live model in place, and `model_config.model` / `model_config.hf_config` /
`get_model()` are what the extension reads. Its reload can be told to fail halfway through, as
a load inside vLLM can, leaving a mix: the commit must then put back the last good weights (or
the checkpoint the server started from), whole, and say so."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentrl.inference.vllm_worker import AgentRLWorkerExtension


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(8, 4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)


class Runner:
    def __init__(self, checkpoint: Path) -> None:
        self.model = Model()
        self.model_config = SimpleNamespace(
            model=str(checkpoint), hf_config=SimpleNamespace(tie_word_embeddings=False)
        )
        self.fail_after: int | None = None  # tensors copied before the next reload fails

    def get_model(self) -> Model:
        return self.model

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True) -> None:
        assert is_checkpoint_format
        if weights_iterator is None:
            weights_iterator = iter(load_file(str(Path(weights_path) / "model.safetensors")).items())
        params = dict(self.model.named_parameters())
        fail_after, self.fail_after = self.fail_after, None
        with torch.no_grad():
            for i, (name, tensor) in enumerate(weights_iterator):
                if fail_after is not None and i == fail_after:
                    raise RuntimeError("scripted failure inside the reload")
                params[name].copy_(tensor)


class Worker(AgentRLWorkerExtension):
    def __init__(self, checkpoint: Path) -> None:
        self.model_runner = Runner(checkpoint)
        self.rank = 0


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(8, 4, generator=gen),
        "lm_head.weight": torch.randn(8, 4, generator=gen),
    }


def served(worker: Worker) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.fixture
def worker(tmp_path: Path) -> Worker:
    save_file(weights(0), str(tmp_path / "model.safetensors"))
    worker = Worker(tmp_path)
    worker.model_runner.reload_weights(weights_path=str(tmp_path))  # what vLLM loaded at start-up
    return worker


def commit(worker: Worker, tensors: dict[str, torch.Tensor]) -> dict:
    worker._agentrl_staged = dict(tensors)  # what `agentrl_receive` leaves after the last bucket
    return worker.agentrl_commit(json.dumps({}))


def test_a_failing_reload_rolls_back_to_the_start_checkpoint(worker: Worker) -> None:
    worker.model_runner.fail_after = 1  # the first tensor lands, then the load fails
    with pytest.raises(RuntimeError, match="kept the previous ones"):
        commit(worker, weights(1))
    assert same(served(worker), weights(0))
    assert worker._agentrl_staged is None


def test_a_failing_reload_rolls_back_to_the_last_committed_weights(worker: Worker) -> None:
    assert commit(worker, weights(1))["loaded"] == 2
    assert same(served(worker), weights(1))
    worker.model_runner.fail_after = 1
    with pytest.raises(RuntimeError, match="kept the previous ones"):
        commit(worker, weights(2))
    assert same(served(worker), weights(1))
    assert same(worker._agentrl_good, weights(1))  # still the rollback target for the next failure


def test_a_discarded_push_changes_nothing_and_commits_nothing(worker: Worker) -> None:
    worker._agentrl_staged = weights(3)
    assert worker.agentrl_discard() == {"discarded": 2}
    with pytest.raises(RuntimeError, match="nothing staged"):
        worker.agentrl_commit()
    assert same(served(worker), weights(0))


def test_adapters_sent_over_http_are_written_by_content_and_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`agentrl_write_adapter` (what `VLLMClient.load_adapter_tensors` calls on every worker): the
    PEFT files under `<tmp>/agentrl-adapters/<name>.<digest>`, the same path for every worker of a
    server, another for other weights; `agentrl_remove_adapter` deletes them all."""
    import base64
    import tempfile

    from safetensors.torch import save

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    workers = [AgentRLWorkerExtension(), AgentRLWorkerExtension()]
    for rank, worker in enumerate(workers):
        worker.rank = rank
    config = {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}

    def send(worker, seed: int) -> Path:
        tensors = {
            "base_model.model.q_proj.lora_A.weight": torch.randn(
                2, 4, generator=torch.Generator().manual_seed(seed)
            )
        }
        data = base64.b64encode(save(tensors)).decode()
        payload = json.dumps({"name": "policy-v3", "config": config, "safetensors": data})
        return Path(worker.agentrl_write_adapter(payload)["path"]), tensors

    (first, tensors), (same, _) = send(workers[0], 0), send(workers[1], 0)
    assert first == same and first.parent == tmp_path / "agentrl-adapters"
    assert json.loads((first / "adapter_config.json").read_text()) == config
    assert torch.equal(load_file(str(first / "adapter_model.safetensors"))["base_model.model.q_proj.lora_A.weight"],
                       tensors["base_model.model.q_proj.lora_A.weight"])  # fmt: skip
    other, _ = send(workers[0], 1)
    assert other != first and sorted(p.name for p in other.parent.iterdir()) == sorted(
        [first.name, other.name]
    )
    assert workers[0].agentrl_remove_adapter(json.dumps({"name": "policy-v3"})) == {"removed": 2}
    assert list((tmp_path / "agentrl-adapters").iterdir()) == []
    with pytest.raises(ValueError, match="plain file name"):
        workers[0].agentrl_write_adapter(json.dumps({"name": "../x", "config": {}, "safetensors": ""}))
