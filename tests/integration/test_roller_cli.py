"""A user's env file, run by hand-started components: `agentrl serve` + `agentrl queue` +
`agentrl roller`. The groups that arrive are checked token by token: the prompt is the
chat template's rendering, the mask marks exactly the generated tokens, their log-probs
are the served model's (fresh forward pass) and their versions the server's."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.config import ZmqQueueConfig
from agentrl.queue import create
from agentrl.rollers.chat import ChatRenderer
from examples.word_tools import WordTools
from tests.conftest import REPO, find_free_port
from tests.integration.test_weight_sync import wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def test_user_env_file_runs_with_agentrl_roller_against_agentrl_serve(
    processes, tiny_model: Path, tmp_path
) -> None:
    secret = {"AGENTRL_QUEUE_SECRET": "x" * 32, "PYTHONPATH": str(REPO)}
    env = {**os.environ, **secret}
    http, queue_port = find_free_port(), find_free_port()
    address = f"tcp://127.0.0.1:{queue_port}"
    processes.agentrl("serve", "--model", str(tiny_model), "--port", str(http), env=env)
    processes.agentrl(
        "queue", "--bind", address, f"--run_dir={tmp_path}", "--learner.groups_per_step=2", env=env
    )
    wait_healthy([f"http://127.0.0.1:{http}"])
    roller = processes.agentrl(
        "roller", "--queue", address, "--servers", f"http://127.0.0.1:{http}", f"--run_dir={tmp_path}",
        "--env.name=examples.word_tools:WordTools", f"--roller.tokenizer_path={tiny_model}",
        "--roller.group_size=2", "--roller.max_groups=2", "--roller.max_new_tokens=24", "--roller.max_turns=2",
        env=env,
    )  # fmt: skip
    os.environ.update(secret)
    consumer = create(ZmqQueueConfig(address=address)).consumer("test")
    try:
        batch = consumer.get_batch(2, 0, 1, timeout_s=120)
        consumer.ack(batch.group_ids)
    finally:
        consumer.close()
    assert roller.wait(timeout=60) == 0, roller.stderr.read().decode()[-2000:]

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    renderer = ChatRenderer(tokenizer, WordTools().tool_schemas)
    tasks = {t["id"]: t for t in WordTools.generate_tasks(8)}
    assert len(batch.groups) == 2
    for group in batch.groups:
        assert len(group.episodes) == 2
        prompt = renderer.prompt_ids(WordTools().prompt(tasks[group.prompt_id]))
        for ep in group.episodes:
            assert ep.tokens[: len(prompt)].tolist() == prompt and not ep.loss_mask[: len(prompt)].any()
            gen = ep.loss_mask.astype(bool)
            assert gen[len(prompt)] and ep.num_generated > 0
            assert np.all(ep.versions[gen] == 0) and np.all(ep.versions[~gen] == -1)
            assert np.all(ep.logprobs[~gen] == 0)
            with torch.no_grad():
                logits = model(torch.tensor([ep.tokens.tolist()])).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1).gather(
                1, torch.tensor(ep.tokens[1:].tolist())[:, None]
            )[:, 0]
            positions = np.nonzero(gen)[0]
            np.testing.assert_allclose(ep.logprobs[positions], logp[positions - 1].numpy(), atol=2e-4)
