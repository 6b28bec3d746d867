"""Search-R1 end to end with real processes: `agentrl retriever` answering a Search-R1 client's
requests, and `agentrl roller` running recipes/search_r1.yaml against `agentrl serve` (tiny model)
and that retriever, streaming groups into a TransferQueue hosted by the test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.envs.search.synthetic import build_world
from agentrl.queue import create as create_queue
from tests.conftest import REPO, Processes, find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def _post(url: str, body: object) -> tuple[int, dict]:
    """A plain synchronous POST, as Search-R1's client sends it (`requests.post(url, json=...)`)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"{url} did not come up")


def _start_retriever(procs: Processes, data: Path, *extra: str) -> tuple[str, subprocess.Popen]:
    port = find_free_port()
    proc = procs.agentrl(
        "retriever",
        "--make-synthetic",
        str(data),
        "--num-people",
        "60",
        "--corpus",
        str(data / "corpus.jsonl"),
        "--port",
        str(port),
        *extra,
    )
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/health", proc)
    return url, proc


def test_retriever_command_speaks_search_r1(tmp_path: Path) -> None:
    data = tmp_path / "data"
    qa = build_world(0, 60)["qa"][:3]
    procs = Processes()
    try:
        url, proc = _start_retriever(procs, data, "--topk", "2")
        status, body = _post(
            f"{url}/retrieve", {"queries": [q["question"] for q in qa], "topk": 3, "return_scores": True}
        )
        assert (
            status == 200 and len(body["result"]) == 3 and all(1 <= len(row) <= 3 for row in body["result"])
        )
        for q, row in zip(qa, body["result"], strict=True):
            assert set(row[0]) == {"document", "score"} and set(row[0]["document"]) == {"id", "contents"}
            assert any(q["golden_answers"][0] in hit["document"]["contents"] for hit in row)
        status, body = _post(f"{url}/retrieve", {"queries": [qa[0]["question"]]})  # default topk, no scores
        assert status == 200 and len(body["result"][0]) == 2 and "contents" in body["result"][0][0]
        assert _post(f"{url}/retrieve", b"{oops")[0] == 400
        assert _post(f"{url}/retrieve", {"queries": "not a list"})[0] == 400
        assert _post(f"{url}/retrieve", {"queries": ["still serving"], "topk": 1})[0] == 200
    finally:
        procs.stop_all()
    assert "index built" in proc.stderr.read().decode()
    assert (data / "corpus.bm25_index" / "meta.json").is_file()
    procs = Processes()
    try:  # a second start loads the cached index instead of building it
        _, proc = _start_retriever(procs, data)
    finally:
        procs.stop_all()
    assert "index loaded" in proc.stderr.read().decode()


async def test_roller_runs_the_recipe_against_agentrl_serve(tmp_path: Path, tiny_model: Path) -> None:
    procs = Processes()
    qcfg = ZmqQueueConfig(address=f"tcp://127.0.0.1:{find_free_port()}", auth="none")
    backend = create_queue(qcfg)
    queue = backend.server(groups_per_step=2, max_staleness=1).start()
    consumer = backend.consumer("rank0", server=queue)
    try:
        retriever_url, _ = _start_retriever(procs, tmp_path / "data")
        serve_port = find_free_port()
        serve = procs.agentrl("serve", "--model", str(tiny_model), "--port", str(serve_port))
        _wait_http(f"http://127.0.0.1:{serve_port}/health", serve)
        roller = procs.agentrl(
            "roller",
            "--config",
            str(REPO / "recipes" / "search_r1.yaml"),
            "--queue",
            qcfg.address,
            "--servers",
            f"http://127.0.0.1:{serve_port}",
            "--queue.auth=none",
            f"--run_dir={tmp_path / 'run'}",
            f"--roller.tokenizer_path={tiny_model}",
            "--roller.max_groups=2",
            "--roller.max_turns=3",
            "--roller.max_new_tokens=12",
            "--roller.task_kwargs={split: train, num_people: 60}",
            f"--env.kwargs={{retriever_url: {retriever_url}/retrieve, max_turns: 2}}",
            cwd=REPO,
            env={**os.environ, "AGENTRL_LOG_LEVEL": "INFO"},
        )
        _, err = await asyncio.to_thread(roller.communicate, timeout=240)
        assert roller.returncode == 0, err.decode()[-3000:]
        batch = await asyncio.to_thread(consumer.get_batch, 2, 0, 1, 30)
    finally:
        consumer.close()
        queue.stop()
        procs.stop_all()
    assert len(batch.groups) == 2
    for group in batch.groups:
        assert len(group.episodes) == 5  # GRPO n = 5 from the recipe
        for ep in group.episodes:
            assert ep.reward in (0.0, 1.0) and 1 <= ep.num_turns <= 3
            for key in ("search_calls", "invalid_actions", "em", "subem", "answered"):
                assert key in ep.metrics
            assert ep.metrics["data_source"] in ("synthetic", "synthetic_2hop")
            gen = ep.loss_mask.astype(bool)
            assert np.all(ep.versions[~gen] == -1) and gen.sum() == ep.num_generated
