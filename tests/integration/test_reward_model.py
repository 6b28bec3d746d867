"""A quickstart run whose reward is partly a served classifier's score, end to end.

`agentrl init-model tiny-rm` writes a random Qwen2 sequence classifier; `agentrl serve-reward`
serves it; `agentrl run` (learner, roller, embedded server) trains with
`reward = env reward + 0.5 × classifier score`. The env records every transcript it rewarded,
and the rewards the learner logged for each step must equal that formula with the classifier's
score from a direct Hugging Face forward of the same transcripts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from agentrl.log import read_metrics
from agentrl.rollers.tasks import TaskSource
from tests.conftest import find_free_port, run_agentrl

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(600)]

WEIGHT = 0.5
RECORDING_ENV = '''
import json, os
from agentrl.envs.toy import LookupEnv


class RecordingLookup(LookupEnv):
    """The quickstart's env, writing down each transcript it rewards (the test's reference)."""

    def reward(self, transcript):
        value = super().reward(transcript)
        with open(os.environ["REWARD_RECORD"], "a") as f:
            f.write(json.dumps({"task": transcript.task["id"], "messages": transcript.messages,
                                "rule": value}) + "\\n")
        return value
'''


def hf_scores(model_dir: Path, conversations: list[list[dict]]) -> list[float]:
    """The classifier's logit on each conversation alone, rendered by its own chat template."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    roles = {"observation": "user", "prompt": "user"}  # raw-text env turns, as serve-reward reads them
    out = []
    for conv in conversations:
        messages = [{"role": roles.get(m["role"], m["role"]), "content": m["content"]} for m in conv]
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
        with torch.no_grad():
            out.append(model(input_ids=ids["input_ids"]).logits[0, 0].item())
    return out


def test_a_served_classifier_scores_part_of_the_reward_the_learner_trains_on(
    tiny_model: Path, tmp_path: Path, processes
) -> None:
    rm = tmp_path / "tiny-rm"
    made = run_agentrl("init-model", "tiny-rm", str(rm), "--seed", "3")
    assert made.returncode == 0, made.stderr[-2000:]
    port = find_free_port()
    url = f"http://127.0.0.1:{port}"
    # started beside the run: the roller waits for it (up to reward.timeout_s) before its first group
    scorer = processes.agentrl("serve-reward", "--model", str(rm), "--port", str(port))

    (tmp_path / "recording_env.py").write_text(RECORDING_ENV)
    record = tmp_path / "transcripts.jsonl"
    run_dir = tmp_path / "run"
    result = run_agentrl(
        "run", "--config", "recipes/quickstart.yaml", f"--run_dir={run_dir}", "--max_staleness=1",
        f"--learner.model_path={tiny_model}", "--learner.max_steps=2", "--learner.groups_per_step=2",
        "--learner.warmstart.steps=0", "--roller.group_size=4", "--roller.max_turns=2",
        "--roller.max_new_tokens=12", "--roller.max_concurrent_episodes=8",
        "--env.name=recording_env:RecordingLookup", f"--reward.url={url}", f"--reward.weight={WEIGHT}",
        "--reward.timeout_s=120",
        f"--queue.address=tcp://127.0.0.1:{find_free_port()}",
        timeout=420, env={"PYTHONPATH": f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}", "REWARD_RECORD": str(record)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert scorer.poll() is None  # still serving

    # every transcript the env rewarded, with the classifier's score from a direct HF forward
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    scores = hf_scores(rm, [r["messages"] for r in rows])
    by_task: dict[str, list[float]] = {}
    for row, score in zip(rows, scores, strict=True):
        by_task.setdefault(row["task"], []).append(row["rule"] + WEIGHT * score)
    assert np.std(scores) > 1e-3  # the classifier tells these transcripts apart: the check can fail

    # each step's trained groups -> their tasks -> the rewards the formula gives them
    tasks = TaskSource("builtin", _lookup_env(), 0)
    task_of = {}
    for line in (run_dir / "roller-0.groups").read_text().splitlines():
        group = json.loads(line)
        task_of[group["id"]] = tasks[group["task"]]["id"]
    trained = [
        json.loads(line)["trained"] for line in (run_dir / "learner_groups.jsonl").read_text().splitlines()
    ]
    trained = [ids for ids in trained if ids]
    learner = read_metrics(run_dir / "learner.jsonl")
    assert len(learner) == len(trained) == 2
    for record_, ids in zip(learner, trained, strict=True):
        expected = np.array([r for gid in ids for r in by_task[task_of[gid]]])
        assert len(expected) == 2 * 4  # one group per task: the env saw exactly its episodes
        assert record_["reward/mean"] == pytest.approx(expected.mean(), abs=1e-4)
        assert record_["reward/min"] == pytest.approx(expected.min(), abs=1e-4)
        assert record_["reward/max"] == pytest.approx(expected.max(), abs=1e-4)

    roller = read_metrics(run_dir / "roller.jsonl")[-1]
    assert roller["roller/reward_model_scored"] == roller["roller/episodes"] == len(rows)
    assert roller["roller/reward_model_errors"] == 0
    assert 1 <= roller["roller/reward_model_batch_mean"] <= 8
    assert roller["roller/reward_model_calls"] >= 1 and roller["roller/reward_model_s"] > 0


def _lookup_env():
    from agentrl.envs.toy import LookupEnv

    return LookupEnv
