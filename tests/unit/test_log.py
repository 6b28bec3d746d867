"""Metrics logging: JSONL records that read back, NaN kept visible."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from agentrl.log import MetricsLogger, get_logger, read_metrics


def test_jsonl_sink_round_trips(tmp_path: Path) -> None:
    logger = MetricsLogger(tmp_path)
    logger.log({"loss": 0.5, "reward": np.float32(1.25), "count": np.int64(3)}, step=1)
    logger.log({"loss": math.nan}, step=2)
    logger.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward"] == 1.25 and records[0]["count"] == 3
    assert records[1]["loss"] == "nan"


def test_loggers_share_one_namespace() -> None:
    assert get_logger("queue").name == "agentrl.queue"
    assert get_logger("agentrl.learner").name == "agentrl.learner"
    assert get_logger("agentrl").name == "agentrl"
