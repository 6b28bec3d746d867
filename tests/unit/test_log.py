"""Metrics logging: JSONL records that read back with NaN kept visible, and the optional
TensorBoard and W&B sinks read back with their own readers (TensorBoard's EventAccumulator;
W&B's offline transaction log parsed into W&B's own protobuf records). Odd values (NaN, inf,
strings, arrays, arbitrary objects) never crash a sink; a sink that fails mid-run is dropped."""

from __future__ import annotations

import glob
import math
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from agentrl.learner.config import LoggingConfig
from agentrl.log import MetricsLogger, get_logger, read_metrics

ODD = {
    "nan": math.nan,
    "inf": math.inf,
    "note": "warming up",
    "flag": True,
    "hist": np.arange(3),  # not one number: JSONL only (as a list)
    "path": Path("/x/y"),  # not JSON: JSONL only (as its str)
    "none": None,
}


def _log_steps(logger: MetricsLogger) -> None:
    logger.log({"loss": 0.5, "reward": np.float32(1.25), "count": np.int64(3), **ODD}, step=1)
    logger.log({"loss": torch.tensor(0.25), "reward/mean": 2.0}, step=2)
    logger.log({"loss": 0.125, "nan": -math.inf}, step=5)


def test_jsonl_sink_round_trips(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    logger.log({"loss": 0.5, "reward": np.float32(1.25), "count": np.int64(3)}, step=1)
    logger.log({"loss": math.nan}, step=2)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward"] == 1.25 and records[0]["count"] == 3
    assert records[1]["loss"] == "nan"


def test_jsonl_sink_keeps_odd_values(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    _log_steps(logger)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 5]
    first = records[0]
    assert first["nan"] == "nan" and first["inf"] == "inf" and first["note"] == "warming up"
    assert first["flag"] is True and first["hist"] == [0, 1, 2] and first["path"] == "/x/y"
    assert first["none"] is None
    assert records[1]["loss"] == 0.25 and records[2]["nan"] == "-inf"


def test_tensorboard_sink_writes_scalars_at_their_steps(tmp_path: Path) -> None:
    pytest.importorskip(
        "tensorboard", reason="tensorboard not installed (pip install 'agentrl[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    _log_steps(logger)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert scalars("loss") == [(1, 0.5), (2, 0.25), (5, 0.125)]
    assert scalars("reward") == [(1, 1.25)] and scalars("count") == [(1, 3.0)]
    assert scalars("reward/mean") == [(2, 2.0)] and scalars("flag") == [(1, 1.0)]
    assert scalars("inf") == [(1, math.inf)]
    (s1, nan), (s5, neg_inf) = scalars("nan")
    assert (s1, s5) == (1, 5) and math.isnan(nan) and neg_inf == -math.inf
    assert not {"note", "hist", "path", "none"} & set(events.Tags()["scalars"])


def test_a_failing_sink_is_dropped_and_jsonl_continues(tmp_path: Path) -> None:
    pytest.importorskip(
        "tensorboard", reason="tensorboard not installed (pip install 'agentrl[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log({"loss": 1.0}, step=1)
    writer = logger._tb

    def disk_full(*args, **kwargs):  # the outside edge (TensorBoard's writer) fails
        raise OSError(28, "No space left on device")

    writer.add_scalar = disk_full
    logger.log({"loss": 2.0}, step=2)
    logger.log({"loss": 3.0}, step=3)
    logger.close()
    assert [r["loss"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0)]


def wandb_records(path: Path) -> Iterator:
    """W&B's protobuf `Record`s from an offline run's `run-<id>.wandb` transaction log.

    The file is W&B's LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then
    32 KiB blocks of chunks, each with a 7-byte header (CRC-32 over type byte + data, length,
    type: 1 full, 2 first, 3 middle, 4 last); a chunk header never straddles a block."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            break  # zero padding at the end of the last block
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc and kind in (1, 2, 3, 4)
        pos += 7 + length
        pending += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The wandb module in offline mode with its files under `tmp_path` (skips if not installed)."""
    wandb = pytest.importorskip("wandb", reason="wandb not installed (pip install 'agentrl[wandb]')")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true",
                       "WANDB_CONFIG_DIR": str(tmp_path / "cfg"), "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                       "WANDB_DATA_DIR": str(tmp_path / "data")}.items():  # fmt: skip
        monkeypatch.setenv(var, value)
    return wandb


def test_wandb_offline_sink_records_the_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    wandb = _offline_wandb(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    try:
        logger = MetricsLogger(run_dir, wandb_project="agentrl-test")
        _log_steps(logger)
        logger.close()
    finally:
        wandb.teardown()  # stops the wandb-core service this test started
    (log_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = list(wandb_records(Path(log_file)))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "agentrl-test"
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
            history[r.history.step.num] = {
                k: json.loads(v) for k, v in items.items() if not k.startswith("_")
            }
    assert sorted(history) == [1, 2, 5]
    first = history[1]
    assert first["loss"] == 0.5 and first["reward"] == 1.25 and first["count"] == 3 and first["flag"] == 1
    assert math.isnan(first["nan"]) and first["inf"] == math.inf and first["note"] == "warming up"
    assert not {"hist", "path", "none"} & set(first)
    assert history[2] == {"loss": 0.25, "reward/mean": 2.0}
    assert history[5] == {"loss": 0.125, "nan": -math.inf}
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finish() ran


def test_loggers_share_one_namespace() -> None:
    assert get_logger("queue").name == "agentrl.queue"
    assert get_logger("agentrl.learner").name == "agentrl.learner"
    assert get_logger("agentrl").name == "agentrl"


def test_wandb_run_continues_when_the_run_directory_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wandb = _offline_wandb(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    try:
        for step in (1, 2):  # a run, then its --resume in the same run directory
            logger = MetricsLogger(run_dir, wandb_project="agentrl-test")
            logger.log({"loss": 1.0 / step}, step)
            logger.close()
    finally:
        wandb.teardown()
    ids = set()
    for log_file in glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")):
        ids |= {r.run.run_id for r in wandb_records(Path(log_file)) if r.WhichOneof("record_type") == "run"}
    assert ids == {(run_dir / "metrics.wandb_id").read_text()}


def test_text_reaches_tensorboard_and_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`log_text` (the learner's transcripts): TensorBoard's text plugin, W&B as an HTML panel."""
    import json

    pytest.importorskip(
        "tensorboard", reason="tensorboard not installed (pip install 'agentrl[tensorboard]')"
    )
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wandb = _offline_wandb(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    try:
        logger = MetricsLogger(run_dir, tensorboard=True, wandb_project="agentrl-test")
        logger.log_text({"transcripts/0": "step 3\n--- model ---\n<tool_call> & more"}, step=3)
        logger.log({"loss": 1.0}, step=3)
        logger.close()
    finally:
        wandb.teardown()
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors("transcripts/0/text_summary")
    assert event.step == 3 and "<tool_call> & more" in event.tensor_proto.string_val[0].decode()
    (log_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    items = {}
    for r in wandb_records(Path(log_file)):
        if r.WhichOneof("record_type") == "history" and r.history.step.num == 3:
            items.update({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    assert items["transcripts/0/_type"] == "html-file" and items["loss"] == 1.0
    (html,) = glob.glob(
        str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "html" / "transcripts" / "*")
    )
    assert "&lt;tool_call&gt; &amp; more" in Path(html).read_text()


def test_mlflow_sink_reads_back_through_the_client(tmp_path: Path) -> None:
    """A real local MLflow tracking store (SQLite), read back with MLflow's own client; the
    resumed run (same run directory) continues the same MLflow run."""
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install 'agentrl[mlflow]')")
    pytest.importorskip("sqlalchemy", reason="a SQLite MLflow store needs sqlalchemy (agentrl[mlflow])")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    # the sinks of a `learner.logging` section, as the learner (decoupled or colocated) builds them
    sinks = LoggingConfig(mlflow={"tracking_uri": uri, "experiment": "agentrl-test"})
    logger = MetricsLogger.from_config(run_dir, "learner", sinks)
    _log_steps(logger)
    logger.log({"odd[key]": 7.0}, step=6)  # a character MLflow refuses becomes "_"
    logger.close()
    resumed = MetricsLogger(run_dir, "learner", mlflow_tracking_uri=uri, mlflow_experiment="agentrl-test")
    resumed.log({"loss": 0.0625}, step=7)
    resumed.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("agentrl-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == (run_dir / "learner.mlflow_id").read_text()
    assert run.info.status == "FINISHED" and run.info.run_name == "run-learner"

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))

    assert history("loss") == [(1, 0.5), (2, 0.25), (5, 0.125), (7, 0.0625)]
    assert history("reward") == [(1, 1.25)] and history("reward/mean") == [(2, 2.0)]
    assert history("count") == [(1, 3.0)] and history("flag") == [(1, 1.0)]
    (nan_first, nan_then) = history("nan")
    assert math.isnan(nan_first[1]) and nan_then[0] == 5 and nan_then[1] < -1e300  # MLflow stores -inf
    assert history("inf")[0][1] > 1e300 and history("odd_key_") == [(6, 7.0)]
    assert set(run.data.metrics) == {
        "loss",
        "reward",
        "reward/mean",
        "count",
        "flag",
        "nan",
        "inf",
        "odd_key_",
    }
