"""A tensor-parallel engine replica (2 real processes, gloo): its logits, its generations, and a
multi-turn tool episode equal the unsharded model's / the decoupled embedded server's."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, find_free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_run(tiny_model: Path, tmp_path_factory, request) -> dict:
    from tests.conftest import Processes

    out = tmp_path_factory.mktemp("tp")
    procs = Processes()
    request.addfinalizer(procs.stop_all)
    port = find_free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    worker = str(REPO / "tests" / "integration" / "colocated_tp_worker.py")
    ranks = [procs.start([sys.executable, worker, str(tiny_model), str(out)], env={**env, "RANK": str(r)},
                         cwd=REPO) for r in range(2)]  # fmt: skip
    for proc in ranks:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-3000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(2)}


def test_tp_logits_equal_the_unsharded_model(tp_run, tiny_model: Path):
    from transformers import AutoConfig

    heads = AutoConfig.from_pretrained(str(tiny_model)).num_attention_heads
    for r in range(2):
        assert tp_run[r]["logits_max_diff"] < 1e-5
        assert tp_run[r]["local_q_rows"] * 2 == heads * (tp_run[r]["local_q_rows"] * 2 // heads)  # a half
    assert tp_run[0]["local_q_rows"] == tp_run[1]["local_q_rows"]


def test_tp_replica_logprobs_equal_a_fresh_forward(tp_run, tiny_model: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    gens = tp_run[0]["generated"]
    assert len(gens) == 3 and tp_run[1]["follower_steps"] > 0
    for g in gens:
        ids = torch.tensor([g["input_ids"] + g["output_ids"]])
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].log_softmax(-1)
        start = len(g["input_ids"])
        ref = [float(logp[start - 1 + j, t]) for j, t in enumerate(g["output_ids"])]
        assert max(abs(a - b) for a, b in zip(g["logprobs"], ref, strict=True)) < 1e-5


def test_tool_episode_on_the_tp_replica_equals_the_embedded_server(tp_run):
    http, tp = tp_run[0]["episodes_http"], tp_run[0]["episodes_tp"]
    assert len(http) == len(tp) == 2
    assert tp_run[1]["follower_steps_episodes"] > 0
    for a, b in zip(http, tp, strict=True):
        assert a["turns"] >= 2  # the env answered at least one tool turn (mask-0 observation tokens)
        assert 0 in a["mask"][a["mask"].index(1) :]
        assert a["tokens"] == b["tokens"] and a["mask"] == b["mask"] and a["versions"] == b["versions"]
        assert a["reward"] == b["reward"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"], strict=True)) < 1e-5
