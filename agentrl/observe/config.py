"""The `prometheus:` config section: which processes serve a Prometheus `/metrics` endpoint, on
which port of 127.0.0.1. Its own module so `agentrl/config.py` can hold it without importing
`prometheus_client` (imported only by a process whose port is set)."""

from __future__ import annotations

from pydantic import Field

from agentrl.section import Section


class PrometheusConfig(Section):
    """Prometheus `/metrics` endpoints on 127.0.0.1; a port unset: none, 0: a free one, N: that one.

    A free port is logged and written to `<run_dir>/prometheus/<process>.port` (removed when the
    endpoint stops; a process killed without its cleanup leaves it behind, stale). Needs
    `pip install 'agentrl[prometheus]'`. The embedded inference server needs no port: it answers
    `/metrics` on its own serving port, as SGLang does."""

    learner_port: int | None = Field(None, ge=0, le=65535)
    """The learner's endpoint (rank 0; in `mode: colocated` too): steps, version, tokens/s, push
    seconds, staleness."""
    queue_port: int | None = Field(None, ge=0, le=65535)
    """The TransferQueue server's endpoint (hosted by the learner, or `agentrl queue`): depth, bytes,
    admission credits, leases, event counters."""
    roller_port: int | None = Field(None, ge=0, le=65535)
    """The rollers' endpoints: roller i listens on `roller_port + i` (0: a free port each)."""
