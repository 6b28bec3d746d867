"""Checkpoints that can be trusted: a truncated or bit-flipped newest checkpoint is named, set aside
and the previous intact one resumed (or, with none intact, the learner refuses naming what to
delete); a non-finite optimizer state or weight stops the learner before anything is pushed or
saved; a full disk during a save (a real tmpfs in a private mount namespace) is reported as the
first error, leaves no partial checkpoint, and `--resume` works once space is back.

Also the worker the ENOSPC test starts inside its mount namespace:
    python tests/unit/learner/test_checkpoint.py enospc MODEL_DIR RUN_DIR OUT_JSON
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentrl.learner.backend import NonFiniteError
from agentrl.learner.checkpoint import CheckpointError
from agentrl.learner.fsdp import full_state_dict
from agentrl.learner.loop import build_learner, run
from tests.conftest import require_private_mounts
from tests.unit.learner.source import ListSource, learner_config, make_groups

REPO = Path(__file__).resolve().parents[3]


def _cfg(model, **kw):
    base = dict(model_path=str(model), groups_per_step=1, max_steps=2, micro_batch_tokens=64, lr=1e-3,
                checkpoint_every=1, export_every=0, batch_timeout_s=0.1)  # fmt: skip
    return learner_config(**{**base, **kw})


class FinitePushes:
    """The weight-sync edge: records each pushed version and whether every tensor was finite."""

    def __init__(self):
        self.versions, self.finite = [], []

    def push(self, weights, version):
        self.versions.append(version)
        self.finite.append(all(bool(torch.isfinite(t).all()) for _, t in weights()))


def _two_checkpoints(model, run_dir: Path) -> list:
    groups = make_groups(4, seed=11)
    run(build_learner(_cfg(model), run_dir), ListSource(groups), max_staleness=2)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert (ckpts / "latest").read_text().strip() == "step_00000002"
    return groups


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:  # 64 bytes overwritten in the middle: same size, different content
        mid = len(data) // 2
        data[mid : mid + 64] = b"\xff" * 64
        path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("name", "how"),
    [("__0_0.distcp", "truncated"), (".metadata", "truncated"), ("rank0.pt", "truncated"),
     ("__0_0.distcp", "bit-flipped")],
)  # fmt: skip
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_previous_one_resumed(
    tiny_model, tmp_path, caplog, name, how
):
    groups = _two_checkpoints(tiny_model, tmp_path)
    ckpts = tmp_path / "checkpoints"
    _damage(ckpts / "step_00000002" / name, how)
    source, pushes = ListSource(groups), FinitePushes()
    learner = build_learner(_cfg(tiny_model, max_steps=3), tmp_path)
    with caplog.at_level(logging.WARNING, logger="agentrl"):
        assert run(learner, source, max_staleness=2, weight_sync=pushes, resume_from_checkpoint=True) == 3
    assert source.versions[0] == 1  # resumed from step 1
    assert name in caplog.text and "step_00000002" in caplog.text and "falling back" in caplog.text
    assert (ckpts / "corrupt-step_00000002" / name).exists()  # kept for inspection, never resumed again
    assert pushes.versions == [2, 3] and all(pushes.finite)
    assert (ckpts / "latest").read_text().strip() == "step_00000003"
    assert all(torch.isfinite(v).all() for v in full_state_dict(learner.model).values())


def test_with_no_intact_checkpoint_the_learner_refuses_naming_each(tiny_model, tmp_path):
    groups = _two_checkpoints(tiny_model, tmp_path)
    ckpts = tmp_path / "checkpoints"
    _damage(ckpts / "step_00000002" / "__0_0.distcp", "bit-flipped")
    _damage(ckpts / "step_00000001" / "rank0.pt", "truncated")
    pushes = FinitePushes()
    learner = build_learner(_cfg(tiny_model, max_steps=3), tmp_path)
    with pytest.raises(CheckpointError) as refused:
        run(learner, ListSource(groups), max_staleness=2, weight_sync=pushes, resume_from_checkpoint=True)
    message = str(refused.value)
    for part in ("step_00000002", "step_00000001", "__0_0.distcp", "rank0.pt", "delete"):
        assert part in message, message
    assert pushes.versions == []
    assert (ckpts / "step_00000002").exists()  # refused: nothing moved or deleted


def test_a_nonfinite_optimizer_state_stops_the_learner_before_anything_is_pushed_or_saved(
    tiny_model, tmp_path
):
    groups = make_groups(4, seed=12)
    learner = build_learner(_cfg(tiny_model, max_steps=1), tmp_path)
    pushes = FinitePushes()
    run(learner, ListSource(groups), max_staleness=2, weight_sync=pushes)
    good = {k: v.clone() for k, v in full_state_dict(learner.model).items()}
    embed = dict(learner.model.named_parameters())["model.embed_tokens.weight"]
    state = learner.optimizer.state[embed]["exp_avg"]
    state.to_local()[0, :8] = float("nan")  # what a silently corrupted checkpoint held
    learner.cfg.max_steps = 3
    with pytest.raises(NonFiniteError, match=r"model\.embed_tokens\.weight \(exp_avg\)"):
        run(learner, ListSource(groups[1:]), max_staleness=2, weight_sync=pushes)
    assert pushes.versions == [1] and all(pushes.finite)  # version 2 was never pushed
    after = full_state_dict(learner.model)
    for k in good:
        torch.testing.assert_close(after[k], good[k], rtol=0, atol=0, msg=k)  # the last good weights
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000001"


def test_a_nonfinite_weight_after_the_step_is_never_pushed_or_saved(tiny_model, tmp_path):
    groups = make_groups(4, seed=13)
    learner = build_learner(_cfg(tiny_model, max_steps=1), tmp_path)
    pushes = FinitePushes()
    run(learner, ListSource(groups), max_staleness=2, weight_sync=pushes)
    for group in learner.optimizer.param_groups:
        group["lr"] = float("inf")  # an update that overflows
    learner.cfg.max_steps = 3
    with pytest.raises(NonFiniteError, match="after the optimizer step"):
        run(learner, ListSource(groups[1:]), max_staleness=2, weight_sync=pushes)
    assert pushes.versions == [1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000001"]


# ------------------------------------------------------------------ a full disk


def _fill(path: Path) -> None:
    """Write zeros to `path` until the file system is full (unbuffered: a buffered file would try
    to flush its last partial block again when closed, and raise ENOSPC there)."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
        except OSError:
            pass


def _enospc_worker(model: str, run_dir: str, out: str) -> None:
    """Inside a private mount namespace, `run_dir` a small tmpfs: one checkpoint, the disk filled,
    a save that meets ENOSPC, then the space given back and `--resume`."""
    from agentrl.learner import main as learner_main

    run_dir_p, facts = Path(run_dir), {}
    groups = make_groups(4, seed=14)
    run(build_learner(_cfg(model, max_steps=1), run_dir_p), ListSource(groups), max_staleness=2)
    ckpts = run_dir_p / "checkpoints"
    size = sum(p.stat().st_size for p in (ckpts / "step_00000001").iterdir())
    filler = run_dir_p / "filler"
    _fill(filler)
    os.truncate(filler, filler.stat().st_size - size // 2)  # less room than one checkpoint
    try:
        run(build_learner(_cfg(model, max_steps=2), run_dir_p), ListSource(groups), max_staleness=2,
            resume_from_checkpoint=True)  # fmt: skip
        facts["error"] = None
    except CheckpointError as exc:
        facts["error"] = str(exc)
        facts["cause"] = type(exc.__cause__).__name__
    facts["after_error"] = sorted(p.name for p in ckpts.iterdir())
    facts["latest_after_error"] = (ckpts / "latest").read_text().strip()
    _fill(run_dir_p / "filler2")  # the partial checkpoint's space is free again: the disk full once more
    learner_main._quietly("writing queue_final.json", learner_main.write_final, run_dir_p, {"x": "y" * 4096})
    filler.unlink()  # space is back
    (run_dir_p / "filler2").unlink()
    source = ListSource(groups)
    facts["resumed_to"] = run(build_learner(_cfg(model, max_steps=2), run_dir_p), source, max_staleness=2,
                              resume_from_checkpoint=True)  # fmt: skip
    facts["resumed_from"] = source.versions[0]
    facts["after_resume"] = sorted(p.name for p in ckpts.iterdir())
    Path(out).write_text(json.dumps(facts))


def test_a_full_disk_during_a_save_is_the_error_reported_and_resume_works_once_space_is_back(
    tiny_model, tmp_path
):
    unshare = require_private_mounts()
    run_dir, out = tmp_path / "run", tmp_path / "facts.json"
    run_dir.mkdir()
    script = (
        f"mount -t tmpfs -o size=8m tmpfs {run_dir} && exec {sys.executable} {__file__} enospc "
        f"{tiny_model} {run_dir} {out}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([unshare, "--mount", "--propagation", "private", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    facts = json.loads(out.read_text())
    assert facts["error"] is not None and "No space left on device" in facts["error"], facts
    assert "step_00000002" in facts["error"] and "step_00000001" in facts["error"]
    assert facts["after_error"] == ["latest", "step_00000001"]  # no partial directory left
    assert facts["latest_after_error"] == "step_00000001"
    assert "queue_final.json failed" in done.stderr  # logged, not raised over the first error
    assert facts["resumed_from"] == 1 and facts["resumed_to"] == 2
    assert facts["after_resume"] == ["latest", "step_00000001", "step_00000002"]


if __name__ == "__main__" and sys.argv[1] == "enospc":
    _enospc_worker(*sys.argv[2:5])
