"""The supervised warm start: demonstrations in the agent loop's exact layout, loss goes down."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM

from agentrl.config import load_config
from agentrl.learner.warmstart import demonstration_batch, warmstart
from agentrl.log import read_metrics


def test_warmstart_lowers_the_demonstration_loss_and_saves_a_checkpoint(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = load_config(
        None,
        [
            f"--learner.model_path={tiny_model}",
            f"--run_dir={tmp_path}",
            "--learner.warmstart.steps=12",
            "--learner.warmstart.batch_size=4",
            "--learner.warmstart.lr=3e-3",
        ],
    )
    batch = demonstration_batch(config, 4, seed=0)
    for ids, mask in batch:
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    out = warmstart(config)
    losses = [r["warmstart/loss"] for r in read_metrics(tmp_path / "warmstart.jsonl")]
    assert len(losses) == 12
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"
    assert (out / "tokenizer.json").exists()
