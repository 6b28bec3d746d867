"""The README's "Writing an environment" walkthrough, its commands run as written from a fresh
directory (`recipes/` and `examples/` linked in, as in a checkout; the ports are free ones
instead of 30000 / 5555, which other jobs on the machine may hold):

1. `agentrl init-model mini`, `agentrl serve`, `agentrl queue`, `agentrl roller --config
   recipes/word_tools.yaml`: the groups the roller put on the README's queue are read back from
   it; their episodes generated tokens after the env's ~270-token prompt (the recipe's budget
   leaves room for a turn);
2. `agentrl run --config recipes/word_tools.yaml`, with `--learner.max_steps` cut to a few RL
   steps (the full recipe's learning is measured by hand: the README gives the numbers): the
   warm start on `demonstrate()`, then RL in which the model makes well-formed tool calls; then
   `agentrl show transcripts runs/word_tools --worst` renders what it wrote."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agentrl.config import ZmqQueueConfig
from agentrl.log import read_metrics
from agentrl.queue.registry import create
from tests.conftest import REPO, find_free_port
from tests.integration.test_weight_sync import wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.integration]
RL_STEPS = 4


def readme_blocks(section: str) -> list[list[str]]:
    """The bash blocks of a README section, as command lines (comments dropped)."""
    text = (REPO / "README.md").read_text()
    body = text[text.index(f"## {section}") :]
    body = body[: body.index("\n## ", 3)]
    blocks = [part.split("```", 1)[0] for part in body.split("```bash\n")[1:]]
    return [[ln.split("  #")[0].strip() for ln in b.splitlines() if ln.strip()] for b in blocks]


def argv(line: str, ports: dict[str, str]) -> list[str]:
    for old, new in ports.items():
        line = line.replace(old, new)
    words = shlex.split(line.removesuffix("&").strip())
    assert words[0] == "agentrl", line
    return [sys.executable, "-m", "agentrl", *words[1:]]


@pytest.mark.timeout(1800)
def test_the_readmes_word_tools_walkthrough_generates_and_calls_tools(processes, tmp_path: Path) -> None:
    by_hand, train = readme_blocks("Writing an environment")
    assert by_hand[0].startswith("export AGENTRL_QUEUE_SECRET=")
    secret = subprocess.run(["bash", "-c", f"{by_hand[0]}; printf %s \"$AGENTRL_QUEUE_SECRET\""],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    http, queue = str(find_free_port()), str(find_free_port())
    ports = {"30000": http, "5555": queue}
    for name in ("recipes", "examples"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {**os.environ, "AGENTRL_QUEUE_SECRET": secret, "PYTHONPATH": str(REPO)}

    # 1. by hand: a model, a server, a queue, a roller
    init, serve, queue_cmd, roller_cmd = by_hand[1:]
    subprocess.run(argv(init, ports), cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    processes.start(argv(serve, ports), cwd=tmp_path, env=env)
    processes.start(argv(queue_cmd, ports), cwd=tmp_path, env=env)
    wait_healthy([f"http://127.0.0.1:{http}"], timeout_s=180)
    roller = processes.start(argv(roller_cmd, ports), cwd=tmp_path, env=env)
    os.environ["AGENTRL_QUEUE_SECRET"] = secret
    consumer = create(ZmqQueueConfig(address=f"tcp://127.0.0.1:{queue}")).consumer("walkthrough")
    try:
        batch = consumer.get_batch(4, 0, 1, timeout_s=600)
    finally:
        consumer.close()
    assert roller.poll() is None, roller.stderr.read().decode()[-3000:]
    processes.stop_all()
    episodes = [ep for g in batch.groups for ep in g.episodes]
    assert len(batch.groups) == 4 and episodes
    assert all(ep.num_generated > 0 for ep in episodes)  # the prompt left room for a turn
    assert all(ep.metrics["prompt_tokens"] > 200 for ep in episodes)  # the tool schema is in it

    # 2. train it: the recipe as the README runs it (a few RL steps), then its transcripts
    run_line, show_line = train
    extra = [f"--queue.address=tcp://127.0.0.1:{find_free_port()}", f"--learner.max_steps={RL_STEPS}"]
    result = subprocess.run([*argv(run_line, ports), *extra], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=1500)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "word_tools"
    records = read_metrics(run_dir / "learner.jsonl")
    assert [r["step"] for r in records] == list(range(1, RL_STEPS + 1))
    calls = [r["episode/tool_calls"] - r.get("episode/tool_errors", 0.0) for r in records]
    assert sum(calls) > 0, calls  # the warm-started model makes well-formed tool calls (30 warm-start
    # steps of the recipe's 120 were too few for any: measured)
    assert max(r["reward/mean"] for r in records) > 0, records
    shown = subprocess.run(argv(show_line, ports), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert '"name": "count_letters"' in shown.stdout and "<tool_response>" in shown.stdout, shown.stdout[
        -2000:
    ]
