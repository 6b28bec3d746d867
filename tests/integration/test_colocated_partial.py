"""Partial rollouts in colocated mode (`colocated.partial_rollout`), 2 real gloo ranks: a step stops
generating once its share of groups is done; an episode still generating at the cut keeps the
tokens it had, and the turn goes on after the next reshard on the new weights, its later tokens
carrying the newer version (the decoupled roller's resume after an aborted request).

Each replica keeps 2 groups in flight and trains on 1: its first task (`CutEnv`, quick) has a
prompt that leaves room for a few tokens only, its second (long) a short one. The quick episodes'
reward waits, at version 0 only, until the engine has generated more tokens of a long episode
than a quick one can, so the cut lands inside the long episodes' turn on any machine speed."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from agentrl.envs.base import Env, StepResult, Transcript

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ENGINE: Any = None  # the worker's engine, for `CutEnv.reward` to watch (its leader's process)
FILL = 0  # words of the quick prompts' filler (set by the worker for its tokenizer)
MAX_NEW, MAX_TOTAL, QUICK_ROOM, UNDERWAY = 48, 256, 8, 16


def _prompt(task: dict[str, Any], fill: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Say something about {task['id']}." + " word" * fill}]


class CutEnv(Env):
    """Task i of a replica (its k = i // 2-th admission) is quick when k is even (a prompt that
    leaves at most QUICK_ROOM tokens), long when k is odd; rewards differ by answer length."""

    def reset(self, task: dict[str, Any]) -> list[dict[str, Any]]:
        self.task = task
        return _prompt(task, FILL if task["quick"] else 0)

    def step(self, action_text: str) -> StepResult:
        return StepResult(None, 0.0, True, {})

    async def reward(self, transcript: Transcript) -> float:
        if self.task["quick"] and ENGINE is not None and ENGINE.weight_version == "0":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not _long_turn_underway():
                await asyncio.sleep(0.005)
        return float(len(transcript.final_text) % 3)

    @classmethod
    def generate_tasks(cls, num: int, seed: int = 0, **kwargs: Any) -> list[dict[str, Any]]:
        return [{"id": f"t{i}", "quick": (i // 2) % 2 == 0} for i in range(num)]


def _long_turn_underway() -> bool:
    """The engine runs a request that has generated more tokens than a quick episode can."""
    batch = ENGINE._batch
    return batch is not None and any(len(req.output_ids) >= UNDERWAY for req in list(batch.reqs))


def _fill(renderer: Any) -> int:
    """The filler that leaves a quick prompt 1 to QUICK_ROOM tokens of MAX_TOTAL."""
    task = {"id": "t0"}
    for n in range(1, 4 * MAX_TOTAL):
        room = MAX_TOTAL - len(renderer.prompt_ids(_prompt(task, n)))
        if room <= QUICK_ROOM:
            assert room >= 1, room
            return n
    raise AssertionError("no filler fits")


def _worker(rank: int, world: int, port: int, model: str, out_dir: str) -> None:
    import torch.distributed as dist

    import tests.integration.test_colocated_partial as me
    from agentrl.colocated.loop import ColocatedRank
    from agentrl.config import load_config
    from agentrl.hybrid.procs import init_gloo

    init_gloo(rank, world, port)
    args = [f"--run_dir={out_dir}/run", f"--learner.model_path={model}", "--learner.warmstart.steps=0",
            "--learner.groups_per_step=2", "--learner.max_steps=3", "--learner.loss.entropy_coef=0.05",
            "--learner.optim.lr=1e-3", "--colocated.partial_rollout=0.5", "--roller.group_size=2",
            "--roller.max_turns=1", f"--roller.max_new_tokens={MAX_NEW}", f"--roller.max_total_tokens={MAX_TOTAL}",
            "--env.name=tests.integration.test_colocated_partial:CutEnv", "--env.kwargs={}"]  # fmt: skip
    cfg = load_config("recipes/quickstart_colocated.yaml", args, uses=("learner", "roller", "env"))
    r = ColocatedRank(cfg)
    me.ENGINE, me.FILL = r.engine, _fill(r.renderer)
    requests: list[dict] = []
    generate = r.client.generate

    async def recorded(input_ids: list[int], sampling_params: dict, **kwargs: Any) -> Any:
        result = await generate(input_ids, sampling_params, **kwargs)
        requests.append({"input": list(input_ids), "output": result.output_ids, "logprobs": result.logprobs,
                         "version": result.weight_version, "finish": result.finish_reason})  # fmt: skip
        return result

    r.client.generate = recorded
    steps = []
    try:
        for _ in range(3):
            groups, m = r.generate()
            r.train(groups)
            steps.append({
                "version": r.learner.version,
                "carried": m.get("colocated/groups_carried"),
                "episodes": [{"task": g.metrics.get("task_index"), "tokens": ep.tokens.tolist(),
                              "versions": ep.versions.tolist(), "logprobs": ep.logprobs.tolist(),
                              "mask": ep.loss_mask.tolist(), "resumed": ep.metrics["resumed_generations"]}
                             for g in groups for ep in g.episodes],
            })  # fmt: skip
    finally:
        r.close()
    if rank == 0:
        Path(out_dir, "partial.json").write_text(json.dumps({"steps": steps, "requests": requests}))
    dist.barrier()
    dist.destroy_process_group()


def test_an_episode_cut_at_a_step_boundary_resumes_on_the_new_weights(
    tiny_model: Path, tmp_path: Path
) -> None:
    from agentrl.hybrid.procs import run_ranks

    run_ranks(_worker, 2, (str(tiny_model), str(tmp_path)), 400, "the colocated partial rollout test")
    out = json.loads((tmp_path / "partial.json").read_text())
    steps, requests = out["steps"], out["requests"]
    assert [s["version"] for s in steps] == [1, 2, 3], steps  # every step applied
    assert steps[0]["carried"] == 1  # replica 0's long group was cut, not trained on at version 0
    assert {e["task"] for e in steps[0]["episodes"]} == {0, 1}  # the quick tasks of both replicas
    # replica 0 (this process): a request of version 0 aborted by the cut, mid-turn
    cut = [q for q in requests if q["finish"] == "abort" and q["version"] == 0 and q["output"]]
    assert cut, [(q["finish"], q["version"], len(q["output"])) for q in requests]
    for q in cut:
        prefix = q["input"] + q["output"]
        # the agent loop resubmitted prompt + tokens so far, on the next step's weights
        again = [p for p in requests if p["input"] == prefix]
        assert again and all(p["version"] >= 1 for p in again), q
        trained = [e for s in steps[1:] for e in s["episodes"] if e["tokens"][: len(prefix)] == prefix]
        assert len(trained) == 1, q
        ep, start, end = trained[0], len(q["input"]), len(prefix)
        assert ep["task"] == 2 and ep["resumed"] >= 1
        # earlier tokens unchanged, with their version and behaviour log-probs ...
        assert ep["versions"][start:end] == [0] * (end - start)
        assert ep["logprobs"][start:end] == pytest.approx(q["logprobs"], abs=0)
        assert ep["mask"][start:end] == [1] * (end - start)
        # ... and the rest of the turn generated on the newer weights
        rest = again[0]["output"]
        assert rest and ep["tokens"][end : end + len(rest)] == rest
        assert all(v >= 1 for v in ep["versions"][end : end + len(rest)])
        assert len(q["output"]) + len(rest) <= MAX_NEW  # one turn's budget, across the cut
