"""The fallback checkpoint engine: safetensors on a shared directory.

Rank 0 writes the full weights of version v to `<directory>/v<v>/model.safetensors` (all
ranks take part in the gathers), then asks every server to load them with
`/update_weights_from_disk`, between `/pause_generation` and `/continue_generation`.
Only the last `keep_last` versions stay on disk. Slower than a broadcast (a write and a
read of the whole model per step) but needs nothing but a directory every node can read.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.log import get_logger
from agentrl.weight_sync.base import PushStats, WeightSource, WeightSyncEngine

if TYPE_CHECKING:
    from agentrl.config import DiskSyncConfig, InferenceConfig

logger = get_logger(__name__)


class DiskEngine(WeightSyncEngine):
    def __init__(
        self, config: DiskSyncConfig, urls: list[str], inference: InferenceConfig, rank: int, directory: Path
    ) -> None:
        super().__init__(urls, inference, rank)
        self.config = config
        self.directory = directory

    def _init_servers(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)

    def push(self, weights: WeightSource, version: int) -> PushStats | None:
        from safetensors.torch import save_file

        start = time.perf_counter()
        tensors = {name: t.detach().cpu().contiguous() for name, t in weights()}
        if self.rank != 0:
            return None
        out = self.directory / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out / "model.safetensors.tmp"))
        (out / "model.safetensors.tmp").rename(out / "model.safetensors")  # readers never see a partial file
        stats = PushStats(
            version,
            bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
            tensors=len(tensors),
            buckets=1,
        )
        del tensors
        timeout = self.config.timeout_s
        self._all("pause_generation", self.urls, timeout_s=timeout)
        errors = self._all("update_weights_from_disk", self.urls, str(out), version, timeout_s=timeout)
        self._all("continue_generation", self.urls, timeout_s=timeout)
        failed = [url for url, exc in errors.items() if exc is not None]
        for url in failed:
            logger.error("server %s did not load version %d from disk: %s", url, version, errors[url])
        stats.servers_updated = len(self.urls) - len(failed)
        stats.servers_dropped = failed
        stats.seconds = time.perf_counter() - start
        self.last = stats
        self._prune(version)
        logger.info(
            "pushed version %d via disk in %.2fs to %d server(s)",
            version,
            stats.seconds,
            stats.servers_updated,
        )
        return stats

    def _prune(self, version: int) -> None:
        for old in self.directory.glob("v*"):
            suffix = old.name[1:]
            if suffix.isdigit() and int(suffix) <= version - self.config.keep_last:
                shutil.rmtree(old, ignore_errors=True)
