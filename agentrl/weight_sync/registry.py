"""The weight-sync engines by name (`weight_sync.type`), and `create()`, which builds the one a
config names. The engine interface is in `base.py`; each engine is one module plus one entry here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.plugins import Registry

if TYPE_CHECKING:
    from agentrl.config import BroadcastSyncConfig, DiskSyncConfig, InferenceConfig
    from agentrl.weight_sync.base import AdapterSpec, WeightSyncEngine

ENGINES: Registry[type[WeightSyncEngine]] = Registry(
    "weight_sync.type",
    None,  # an engine's config is a section of its own in agentrl/weight_sync/config.py: built-ins only
    {
        "broadcast": "agentrl.weight_sync.broadcast:BroadcastEngine",
        "disk": "agentrl.weight_sync.disk:DiskEngine",
    },
)


def create(
    config: BroadcastSyncConfig | DiskSyncConfig,
    inference: InferenceConfig,
    urls: list[str] | None = None,
    rank: int = 0,
    run_dir: str | Path = "runs/default",
    servers_file: str | Path | None = None,
    adapter: AdapterSpec | None = None,
) -> WeightSyncEngine:
    """The engine named by `config.type`, pushing to `urls` (default: `inference.servers`), or to
    the live list in `servers_file` once it exists (`inference.server_list`). `adapter`: the LoRA
    adapter the pushes carry (`base.pushed_adapter`), checked against every server at `init`."""
    urls = list(urls if urls is not None else inference.servers)
    cls = ENGINES.get(config.type)
    if config.type == "disk":  # the directory the learner writes checkpoints into for the servers
        directory = Path(config.directory) if config.directory else Path(run_dir) / "weights"
        return cls(config, urls, inference, rank, directory, servers_file, adapter)
    return cls(config, urls, inference, rank, servers_file, adapter)
