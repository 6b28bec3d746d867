"""Prometheus `/metrics` endpoints of the learner, the queue server, the rollers and the embedded
inference server, from what each process already computes.

`Endpoint.start(registry, port, run_dir, role)` serves one registry on 127.0.0.1 from a daemon
thread (port 0: a free port, written to `<run_dir>/prometheus/<role>.port`); `stop()` shuts it
down, and each process stops its endpoint when it stops. What each process serves:

- learner (`LearnerExporter`, updated once per step by the learner loop with the metrics it
  logged): `agentrl_learner_steps_total`, `agentrl_learner_version`,
  `agentrl_learner_tokens_per_second` (the step's `tokens_per_s`), `agentrl_learner_push_seconds`
  (a histogram of weight sync's `sync/push_s`), `agentrl_learner_staleness` (a histogram of the
  step's `staleness/<k>`: versions behind, `version - min(versions)`, of each trained group).
- queue (`QueueCollector`, read from `QueueServer.metrics()` at each scrape): `agentrl_queue_depth`,
  `agentrl_queue_bytes`, `agentrl_queue_inflight`, `agentrl_queue_parked_puts`, `agentrl_queue_version`,
  `agentrl_queue_leases`, `agentrl_queue_admission_credits_held`, `agentrl_queue_admission_started`,
  `agentrl_queue_admission_limit`, `agentrl_queue_events_total{event=...}` (its counters).
- roller (`RollerCollector`, read from the roller's `RollerStats` and its producer):
  `agentrl_roller_episodes_in_flight`, `agentrl_roller_episodes_total`,
  `agentrl_roller_episodes_per_second`, `agentrl_roller_groups_put_total`,
  `agentrl_roller_groups_failed_total`, `agentrl_roller_version`,
  `agentrl_roller_admission_credits_held`, `agentrl_roller_staleness_at_put` (a histogram).
- embedded server (`EngineCollector`, on the server's own port at `/metrics`):
  `agentrl_server_weight_version`, `agentrl_server_requests_running`,
  `agentrl_server_decode_steps_total`, `agentrl_server_paused`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from agentrl.log import get_logger

log = get_logger("observe.prometheus")

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
"""Upper bounds of the staleness histograms (weight versions), `+Inf` added."""
PUSH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Endpoint:
    """One registry served over HTTP on 127.0.0.1 by a daemon thread."""

    def __init__(self, server: Any, thread: threading.Thread, port_file: Path | None) -> None:
        self._server, self._thread, self._port_file = server, thread, port_file
        self.port: int = server.server_port

    @classmethod
    def start(cls, registry: CollectorRegistry, port: int, run_dir: str | Path, role: str) -> Endpoint:
        server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        port_file = None
        if port == 0:
            port_file = Path(run_dir) / "prometheus" / f"{role}.port"
            port_file.parent.mkdir(parents=True, exist_ok=True)
            port_file.write_text(f"{server.server_port}\n")
        log.info("%s: Prometheus metrics on http://127.0.0.1:%d/metrics", role, server.server_port)
        return cls(server, thread, port_file)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        if self._port_file is not None:
            self._port_file.unlink(missing_ok=True)


def serve(collector: Any, port: int | None, run_dir: str | Path, role: str) -> Endpoint | None:
    """`collector` (anything with `collect()`) served on `port` (None: not at all)."""
    if port is None:
        return None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return Endpoint.start(registry, port, run_dir, role)


def _histogram(name: str, doc: str, counts: Counter, total: float) -> HistogramMetricFamily:
    """A cumulative histogram over `STALENESS_BUCKETS` from counts by integer value."""
    buckets = [(str(float(b)), sum(n for v, n in counts.items() if v <= b)) for b in STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class LearnerExporter:
    """The learner's metrics, set by `step()` after each learner step on rank 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = PromCounter(
            "agentrl_learner_steps", "Learner steps run (applied or skipped)", registry=r
        )
        self.version = Gauge(
            "agentrl_learner_version", "Weight version the learner has published", registry=r
        )
        self.tokens_per_s = Gauge(
            "agentrl_learner_tokens_per_second", "Trained tokens per second of the last step", registry=r
        )
        self.push_s = Histogram(
            "agentrl_learner_push_seconds", "Seconds of each weight push", buckets=PUSH_BUCKETS, registry=r
        )
        self.staleness = Histogram(
            "agentrl_learner_staleness",
            "Versions behind the learner of each trained group (version - min(versions))",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )

    def collect(self) -> Iterable[Any]:
        with self._lock:  # a scrape sees whole steps: never one step's version with another's counts
            return list(self.registry.collect())

    def step(self, version: int, metrics: dict[str, Any]) -> None:
        """One learner step: the version after it and the metrics it logged (`staleness/<k>`, the
        count of its trained groups k versions behind; `tokens_per_s`; `sync/push_s` when it pushed)."""
        with self._lock:
            self.steps.inc()
            self.version.set(version)
            for key, count in metrics.items():
                if key.startswith("staleness/"):
                    for _ in range(int(count)):
                        self.staleness.observe(int(key.split("/", 1)[1]))
            if "tokens_per_s" in metrics:
                self.tokens_per_s.set(metrics["tokens_per_s"])
            if "sync/push_s" in metrics:
                self.push_s.observe(metrics["sync/push_s"])


_QUEUE_GAUGES = {
    "depth": "Groups queued, not yet handed out",
    "bytes": "Bytes of the queued groups",
    "inflight": "Groups handed out to the learner, not yet acked",
    "parked_puts": "Puts held unanswered (backpressure)",
    "version": "Learner version the queue knows",
    "leases": "Roller leases alive",
    "leased": "Admission credits held by rollers (granted, not yet spent)",
    "started": "Groups admitted so far, as admission counts them",
    "admission_limit": "Admission's limit: (version + k + 1) x groups_per_step",
}
_QUEUE_NAMES = {"leased": "admission_credits_held", "started": "admission_started"}


class QueueCollector:
    """`QueueServer.metrics()` at each scrape."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Any]:
        m = self.server.metrics()
        for key, doc in _QUEUE_GAUGES.items():
            if key in m:
                yield GaugeMetricFamily(f"agentrl_queue_{_QUEUE_NAMES.get(key, key)}", doc, value=m[key])
        events = CounterMetricFamily("agentrl_queue_events", "The queue's event counters", labels=["event"])
        # a copy (one C call, atomic under the GIL): the server's thread updates them meanwhile
        for key, value in sorted(dict(getattr(self.server, "counters", {})).items()):
            events.add_metric([key], value)
        yield events


class RollerCollector:
    """A roller's `RollerStats` (and its producer's admission credits) at each scrape."""

    def __init__(self, roller: Any) -> None:
        self.roller = roller

    def collect(self) -> Iterator[Any]:
        s = self.roller.stats
        snap = s.snapshot()
        for name, doc, value in (
            ("episodes_in_flight", "Episodes running now", s.in_flight_episodes),
            ("episodes_per_second", "Episodes finished per second since the roller started",
             snap["roller/episodes_per_s"]),
            ("version", "Newest learner version the roller has heard of", s.newest_version),
            ("admission_credits_held", "Admission credits the roller holds",
             getattr(self.roller.producer, "held", 0)),
        ):  # fmt: skip
            yield GaugeMetricFamily(f"agentrl_roller_{name}", doc, value=value)
        # groups before episodes: a group's episodes are counted before it is put, so read in this
        # order episodes >= group_size x groups_put holds in every scrape
        for name, doc, value in (
            ("groups_put", "Groups the queue stored", s.groups_put),
            ("groups_failed", "Groups that failed", s.groups_failed),
            ("episodes", "Episodes finished", s.episodes),
        ):
            yield CounterMetricFamily(f"agentrl_roller_{name}", doc, value=value)
        counts = Counter(dict(s.staleness_counts))  # a copy: the roller's loop adds to it meanwhile
        yield _histogram(
            "agentrl_roller_staleness_at_put",
            "Versions behind the learner of each group when put",
            counts,
            sum(v * n for v, n in counts.items()),
        )


class EngineCollector:
    """The embedded inference engine's state at each scrape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        e = self.engine
        version = str(e.weight_version)
        if version.lstrip("-").isdigit():
            yield GaugeMetricFamily(
                "agentrl_server_weight_version", "Weight version served", value=int(version)
            )
        yield GaugeMetricFamily("agentrl_server_requests_running", "Requests in the running batch",
                                value=e.num_running)  # fmt: skip
        yield GaugeMetricFamily("agentrl_server_paused", "1 while generation is paused", value=int(e.paused))
        yield CounterMetricFamily("agentrl_server_decode_steps", "Decode steps run", value=e.steps)


def render(collector: Any) -> bytes:
    """The text exposition of one collector (the embedded server's `/metrics` body)."""
    from prometheus_client import generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
