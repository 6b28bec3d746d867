"""The fallback checkpoint engine: safetensors on a shared directory.

Rank 0 writes the full weights of version v to `<directory>/v<v>/model.safetensors` (all
ranks take part in the gathers), then asks every server to load them with
`/update_weights_from_disk`, between `/pause_generation` and `/continue_generation`; a server
has the version once it reads it back (each server's load is all or nothing: the embedded
server checks before copying, vLLM's worker rolls a failed load back).
Only the last `keep_last` versions stay on disk. Slower than a broadcast (a write and a
read of the whole model per step) but needs nothing but a directory every node can read.

Servers are probed in the background (`watch.ServerWatch`, as for the broadcast engine): a push
leaves out a server probed down or silent (it would cost the push its timeout), and `behind(v)`
names the servers up but not at v — restarted on their address, or back after a partition —
so the learner pushes to them at once, while it waits for data. A push of the version already
on disk skips the gather and the write: the servers behind only load the file.

A LoRA learner's adapter (`weight_sync.lora_mode: adapter`) is written as a PEFT adapter directory
(`adapter_config.json`, `adapter_model.safetensors`) in `v<v>/` and loaded with
`load_lora_adapter`, served as `agentrl-lora-v<v>`: the embedded server applies it to every
request; vLLM (`/v1/load_lora_adapter`) and SGLang (`/load_lora_adapter`) serve it by name, each
load read back from `/v1/models`, with the previous version kept for requests in flight and older
ones unloaded (`inference/lora.py`). Their clients read the newest served version as the
server's, so the version read back is the adapter's.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.inference.base import WeightUpdateClient
from agentrl.log import get_logger
from agentrl.weight_sync.base import (
    AdapterSpec,
    Outcome,
    PushStats,
    WeightSource,
    WeightSyncEngine,
    loads_adapters,
    no_adapters,
    resolve,
)
from agentrl.weight_sync.watch import DOWN, ServerWatch

if TYPE_CHECKING:
    from agentrl.config import DiskSyncConfig, InferenceConfig

logger = get_logger(__name__)

RETRY_S = 5.0
"""A server that failed to load a version is not named behind again for this long."""


class DiskEngine(WeightSyncEngine):
    """Pushes through the smallest client interface (`WeightUpdateClient`: pause, load from disk,
    continue, read the version back), so any backend's server can be updated this way."""

    client_interface = WeightUpdateClient

    def __init__(
        self,
        config: DiskSyncConfig,
        urls: list[str],
        inference: InferenceConfig,
        rank: int,
        directory: Path,
        servers_file: str | Path | None = None,
        adapter: AdapterSpec | None = None,
    ) -> None:
        super().__init__(urls, inference, rank, servers_file, adapter)
        self.config = config
        self.directory = directory
        self.watch: ServerWatch | None = None
        self._written: int | None = None  # the version on disk (every rank tracks it: same gathers)
        self._pushed_at = 0.0  # time.monotonic() at the end of the last push
        self._retry_at: dict[str, float] = {}

    def _init_servers(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        interval = min(2.0, self.inference.health_check_interval_s)
        self.watch = ServerWatch(
            self.clients, self._bridge, interval, min(self.inference.connect_timeout_s, 2.0)
        )
        self.watch.probe_now(list(self.urls))
        self.watch.start()

    def behind(self, version: int) -> list[str]:
        """Servers probed up since the last push that do not hold `version`, outside their retry
        backoff. Never blocks."""
        if self.rank != 0 or self.watch is None:
            return []
        self._reread()  # a server new in the live list is one behind (and never blocks)
        now, leaving = time.monotonic(), self._leaving()
        return [
            url
            for url, v in self.watch.fresh(self._pushed_at).items()
            if v != DOWN and url not in leaving and v != version and self._retry_at.get(url, 0.0) <= now
        ]

    def _follow_list(self) -> None:
        """Before a push: take in the live server list (a new server is probed, then loads the
        version on disk as one behind; a removed one is no longer pushed to)."""
        self._reread()
        removed = self._take_removed()
        if removed:
            assert self.watch is not None
            self.watch.forget(removed)
            self._forget(removed)
            for url in removed:
                self._retry_at.pop(url, None)

    def push(self, weights: WeightSource, version: int) -> PushStats | None:
        """Write version `version` (unless it is on disk already), have every server up load it,
        read each one's version back. An adapter (`AdapterWeights`, `lora_mode: adapter`) is written
        as a PEFT adapter directory and loaded with `load_lora_adapter`."""
        start = time.perf_counter()
        weights, adapter = resolve(weights, self.config.lora_mode)
        out = self.directory / f"v{version}"
        new = version != self._written
        if not new:  # already on disk: a server behind loads it, nothing is gathered
            stats = PushStats(version)
            if self.rank != 0:
                return None
            targets = self.behind(version)
        else:
            stats = self._write(weights, version, out, adapter)
            if stats is None:
                return None
            self._follow_list()
            targets = [u for u in self.urls if self.watch is None or self.watch.last(u) != DOWN]
        errors = self._load(targets, out, version, adapter)
        read = self._read_versions([u for u in targets if errors[u] is None], self.config.timeout_s)
        stats.outcomes = self._outcomes(targets, errors, read, version, new)
        stats.servers_updated = sum(o.committed for o in stats.outcomes.values())
        stats.servers_dropped = [u for u, o in stats.outcomes.items() if not o.committed]
        stats.seconds = time.perf_counter() - start
        self._written, self._pushed_at = version, time.monotonic()
        self.last = stats
        self._prune(version)
        self._report(stats, "from disk")
        return stats

    def _load(self, targets: list[str], out: Path, version: int, adapter: AdapterSpec | None) -> dict:
        """Pause `targets`, have each load `out` (full weights, or the adapter), continue them;
        {url: exception or None} of the loads."""
        timeout = self.config.timeout_s
        self._all("pause_generation", targets, timeout_s=timeout)
        if adapter is None:
            errors = self._all("update_weights_from_disk", targets, str(out), version, timeout_s=timeout)
        else:
            able = [u for u in targets if loads_adapters(self.clients[u], "disk")]
            errors = {u: RuntimeError(no_adapters(self.clients[u], "disk")) for u in targets if u not in able}
            path = str(out.absolute())  # a server resolves a relative path against its own directory
            errors.update(
                self._all("load_lora_adapter", able, adapter.name(version), path, version, timeout_s=timeout)
            )
        self._all("continue_generation", targets, timeout_s=timeout)
        return errors

    def _outcomes(
        self, targets: list[str], errors: dict, read: dict, version: int, new: bool
    ) -> dict[str, Outcome]:
        """One outcome per server: committed where it loaded and reads `version` back; a server that
        failed is not named behind again for `RETRY_S`."""
        outcomes = {}
        for url in self.urls:
            seen = read.get(url)
            if url in targets and errors[url] is None and seen == version:
                outcomes[url] = Outcome(True, version)
                continue
            if url not in targets:
                why = "probed down: loads it when back"
            elif errors[url] is not None:
                why = f"loading from disk failed: {errors[url]}"
            else:
                why = f"read back {seen} after loading"
            if url in targets:
                self._retry_at[url] = time.monotonic() + RETRY_S
            if url in targets or new:
                outcomes[url] = Outcome(False, seen if isinstance(seen, int) else None, why)
        return outcomes

    def _write(
        self, weights: WeightSource, version: int, out: Path, adapter: AdapterSpec | None = None
    ) -> PushStats | None:
        """Gather (every rank) and, on rank 0, write version `version` (`model.safetensors`, or a
        PEFT adapter directory); None on the other ranks."""
        from safetensors.torch import save_file

        tensors = {name: t.detach().cpu().contiguous() for name, t in weights()}
        if self.rank != 0:
            self._written = version
            return None
        out.mkdir(parents=True, exist_ok=True)
        if adapter is not None:
            (out / "adapter_config.json.tmp").write_text(json.dumps(adapter.peft_config(), indent=2))
            (out / "adapter_config.json.tmp").rename(out / "adapter_config.json")
            name = "adapter_model.safetensors"
        else:
            name = "model.safetensors"
        save_file(tensors, str(out / f"{name}.tmp"), metadata={"format": "pt"})
        (out / f"{name}.tmp").rename(out / name)  # readers never see a partial file
        stats = PushStats(
            version, bytes=sum(t.numel() * t.element_size() for t in tensors.values()), tensors=len(tensors),
            buckets=1,
        )  # fmt: skip
        return stats

    def _prune(self, version: int) -> None:
        for old in self.directory.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and int(suffix) <= version - self.config.keep_last:
                shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.stop()
        super().close()
