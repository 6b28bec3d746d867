"""`bench peer --agentic`: its JSON assembled by the real `main` from recorded runs, and the one
tool task behind both trainers.

As in test_reports.py, the outside edges stand in for what takes minutes: `agentrl run` (the
bench's `_run`) writes a recorded `learner.jsonl` (with the env's `episode/tool_calls` and
`episode/tool_seconds` means, as the real learner logs them) into the run directory it is given,
and TRL's `GRPOTrainer` run (`_trl`) returns the bench's own `_summary` of a recorded step clock
and tool ledger. The env tests use the real tokenizer of `init-model tiny` and TRL's real
`environment_factory` class."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

import pytest

from agentrl.bench import peer, peer_agentic
from agentrl.envs.lookup_tools import (
    LookupToolsEnv,
    LookupToolsTRL,
    lookup_reward,
    tool_latency,
)

# seconds at the end of each step; TRL's steps are slow (its tool calls wait one after another)
CLOCKS = {
    "trl": [10.0, 20.0, 30.0, 40.0, 50.0],
    "trl_matched": [8.0, 16.0, 24.0, 32.0, 40.0],
    "k0": [4.0, 8.0, 12.0, 16.0, 20.0],
    "k2": [0.5, 1.0, 3.0, 5.0, 7.0],  # a backlog before the window, then 2 s a step
    "colocated": [5.0, 10.0, 15.0, 20.0, 25.0],
    "trl_zero_latency": [3.0, 6.0, 9.0, 12.0, 15.0],
    "k2_zero_latency": [1.0, 2.0, 3.0, 4.0, 5.0],
}
REWARDS = {"trl": 0.25, "trl_matched": 0.25, "k0": 0.5, "k2": 0.375, "colocated": 0.5,
           "trl_zero_latency": 0.25, "k2_zero_latency": 0.5}  # fmt: skip
TOOL_SECONDS = 0.4  # per episode, mean
TOOL_CALLS = 2.0


def _fake_run(runs: list[tuple[str, dict]]):
    def run(args: list[str]) -> subprocess.CompletedProcess:
        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("--run_dir=")))
        row = run_dir.name
        options = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
        options["env.kwargs"] = json.loads(args[args.index("--env.kwargs") + 1])
        runs.append((row, options))
        run_dir.mkdir(parents=True, exist_ok=True)
        latency = options["env.kwargs"]["latency_s"]
        lines = [
            json.dumps({"step": i + 1, "time": 1000.0 * len(runs) + t, "reward/mean": REWARDS[row],
                        "episode/tool_calls": TOOL_CALLS + 0.5, "episode/tool_errors": 0.5,
                        "episode/tool_seconds": TOOL_SECONDS if latency else 0.0})
            for i, t in enumerate(CLOCKS[row])
        ]  # fmt: skip
        (run_dir / "learner.jsonl").write_text("\n".join(lines) + "\n")
        return subprocess.CompletedProcess(args, 0, "", "")

    return run


def test_report_rates_and_ratios_come_from_each_runs_own_window(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    runs: list[tuple[str, dict]] = []
    monkeypatch.setattr(peer_agentic, "_run", _fake_run(runs))
    monkeypatch.setattr(peer_agentic, "_longest_prompt", lambda model_dir, tasks: 150)

    def trl(model_dir: str, out: Path, opts, threads: int, latency_s: float) -> dict:
        runs.append((f"{out.name}/{threads}", {"latency_s": latency_s}))
        spp = opts.prompts_per_step * opts.completions
        per_step = TOOL_SECONDS * spp if latency_s else 0.0
        records = [{"step": i + 1, "time": t, "tool_calls": TOOL_CALLS * spp * (i + 1),
                    "tool_seconds": per_step * (i + 1)} for i, t in enumerate(CLOCKS[out.name])]  # fmt: skip
        return peer_agentic._summary(records, [REWARDS[out.name]] * len(records), opts)

    monkeypatch.setattr(peer_agentic, "_trl", trl)
    args = ["--agentic", "--steps", "2", "--warmup-steps", "3", "--prompts-per-step", "2", "--completions", "4",
            "--trl-matched-threads", "3", "--model-dir", str(tmp_path), "--length", "64"]  # fmt: skip
    assert peer.main(args) == 0  # `bench peer --agentic` reaches this bench
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "peer_agentic"
    names = [name for name, _ in runs]
    assert names == [
        "trl/1",
        "trl_matched/3",
        "k0",
        "k2",
        "colocated",
        "trl_zero_latency/1",
        "k2_zero_latency",
    ]
    agentrl_runs = {name: options for name, options in runs if "/" not in name}
    for name, options in agentrl_runs.items():  # the same limits and env for every agentrl row
        assert options["roller.max_total_tokens"] == "214" and options["roller.max_new_tokens"] == "64"
        assert options["roller.max_turns"] == "3" and options["roller.group_size"] == "4"
        assert options["env.name"] == peer_agentic.ENV
        assert options["env.kwargs"]["latency_s"] == (0.0 if name.endswith("_zero_latency") else 0.1)
    assert agentrl_runs["colocated"]["max_staleness"] == "0" and agentrl_runs["k2"]["max_staleness"] == "2"
    metrics, ratios = line["metrics"], line["ratios"]
    assert metrics["warmup_steps"] == 3
    for row, clock in CLOCKS.items():
        assert (metrics[f"{row}_window_from_step"], metrics[f"{row}_window_to_step"]) == (3, 5), row
        assert metrics[f"{row}_window_samples"] == 2 * 2 * 4
        assert metrics[f"{row}_window_seconds"] == pytest.approx(clock[4] - clock[2]), row
        assert metrics[f"{row}_samples_per_s"] == pytest.approx(16 / (clock[4] - clock[2])), row
        assert metrics[f"{row}_final_reward"] == REWARDS[row]
        assert metrics[f"{row}_tool_calls_per_sample"] == pytest.approx(TOOL_CALLS), row
        expected = 0.0 if row.endswith("_zero_latency") else TOOL_SECONDS * 8
        assert metrics[f"{row}_tool_seconds_per_step"] == pytest.approx(expected), row
    rate = {row: metrics[f"{row}_samples_per_s"] for row in CLOCKS}
    assert ratios == pytest.approx({
        "agentic_async_vs_trl": rate["k2"] / rate["trl"],
        "agentic_colocated_vs_trl": rate["colocated"] / rate["trl"],
        "agentic_sync_vs_trl": rate["k0"] / rate["trl"],
        "agentic_async_vs_trl_matched": rate["k2"] / rate["trl_matched"],
        "agentic_colocated_vs_trl_matched": rate["colocated"] / rate["trl_matched"],
        "agentic_sync_vs_trl_matched": rate["k0"] / rate["trl_matched"],
        "agentic_async_vs_trl_zero_latency": rate["k2_zero_latency"] / rate["trl_zero_latency"],
    })  # fmt: skip
    assert ratios["agentic_async_vs_trl"] == pytest.approx(20.0 / 4.0)  # the backlog stays outside the window


def test_rows_must_be_known_and_include_trl(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        peer.main(["--agentic", "--rows", "k2,k4"])
    assert "unknown rows ['k4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peer.main(["--agentic", "--rows", "k2"])
    assert "must include trl" in capsys.readouterr().err


def test_latency_is_long_tailed_and_the_same_for_both_trainers() -> None:
    draws = sorted(tool_latency(0, f"t{i}", 0, 0.1, 0.99) for i in range(4000))
    assert 0.08 < draws[2000] < 0.12  # median ≈ 100 ms
    assert 0.6 < draws[3960] < 1.6  # p99 ≈ 1 s
    assert tool_latency(0, "t1", 1, 0.1, 0.99) != tool_latency(0, "t1", 0, 0.1, 0.99)
    assert tool_latency(0, "t1", 0, 0.0, 0.99) == 0.0

    task = LookupToolsEnv.generate_tasks(1, seed=3)[0]
    ours = LookupToolsEnv(latency_s=0.001)
    ours.reset(task)
    theirs = LookupToolsTRL()
    LookupToolsTRL.latency_s = 0.001
    try:
        theirs.reset(**{**task, "table": json.dumps(task["table"])})
        first, second = task["animals"]
        got_ours = [asyncio.run(ours.lookup(first)), asyncio.run(ours.lookup(second))]
        got_theirs = [asyncio.run(theirs.lookup(first)), asyncio.run(theirs.lookup(second))]
    finally:
        LookupToolsTRL.latency_s = 0.1
    assert got_ours == got_theirs == task["answers"]
    waited = tool_latency(0, task["id"], 0, 0.001, 0.99) + tool_latency(0, task["id"], 1, 0.001, 0.99)
    assert ours.metrics["tool_seconds"] == pytest.approx(waited)
    assert asyncio.run(ours.lookup("dragon")) == "unknown animal 'dragon'"


def test_reward_counts_the_colours_named() -> None:
    assert lookup_reward("Red and blue.", ["red", "blue"]) == 1.0
    assert lookup_reward("reddish blue", ["red", "blue"]) == 0.5
    assert lookup_reward("", ["red", "blue"]) == 0.0


def test_both_trainers_render_the_same_prompt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agentrl.tiny_model import init_model

    tokenizer = AutoTokenizer.from_pretrained(init_model("tiny", tmp_path / "tiny"))
    env = LookupToolsEnv()
    task = env.generate_tasks(1)[0]
    ours = tokenizer.apply_chat_template(env.prompt(task), tools=env.tool_schemas, add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    # TRL renders the dataset's user turn with the environment's bound methods as tools
    theirs = tokenizer.apply_chat_template([{"role": "user", "content": task["question"]}],
                                           tools=[LookupToolsTRL().lookup], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
    assert ours == theirs and '"name": "lookup"' in ours
    demo = env.demonstrate(task)
    assert [m["role"] for m in demo[1:]] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert demo[-1]["content"] == " ".join(task["answers"])
