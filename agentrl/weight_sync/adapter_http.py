"""The broadcast engine's adapter path without the weight group: a LoRA adapter push
(`lora_mode: adapter`) to servers whose clients take adapters over HTTP (`load_lora_tensors`, vLLM's).

Adapters are small and vLLM loads them by path, so rank 0 sends each server up the adapter's tensors
over HTTP: paused, loaded (written on its host, loaded, read back from its adapter list), its version
read back, resumed. A server is committed only where it reads the version back; otherwise it is
dropped from this push with the reason and named `behind` again after 5 s. An engine built with the
adapter for such servers builds no group (`BroadcastEngine._init_servers`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from agentrl.weight_sync.base import Outcome, loads_adapters
from agentrl.weight_sync.membership import GroupMembership
from agentrl.weight_sync.watch import DOWN

if TYPE_CHECKING:
    from agentrl.weight_sync.base import AdapterSpec, PushStats


class AdapterOverHTTP(GroupMembership):
    """`GroupMembership` plus the adapter push over HTTP; `BroadcastEngine` builds on it and chooses
    this path per push (`_adapters_over_http`)."""

    def _adapter_push_over_http(
        self, pairs: list, adapter: AdapterSpec, version: int, stats: PushStats | None, start: float
    ) -> PushStats | None:
        """An adapter push that goes to every server over HTTP (rank 0 sends; the others return)."""
        if self.rank == 0:
            self._push_over_http(pairs, adapter, version, stats)
            stats.seconds = time.perf_counter() - start
            self.last = stats
            self._report(stats, "over HTTP (adapter tensors)")
        return stats

    def _adapters_over_http(self) -> bool:
        """Rank 0: whether this adapter push goes to the servers over HTTP (`load_lora_tensors`):
        every client takes it so and none over the group (vLLM's; one `inference.type` per run)."""
        clients = list(self.clients.values())
        return bool(clients) and all(
            loads_adapters(c, "http") and not loads_adapters(c, "group") for c in clients
        )

    def _push_over_http(self, pairs: list, adapter: AdapterSpec, version: int, stats: PushStats) -> None:
        """Rank 0: an adapter push without the group. Each server up is paused, sent the adapter
        (`load_lora_tensors`: written on its host, loaded, read back from its adapter list), its
        version read back, resumed; committed only where it reads `version` back, otherwise dropped
        from this push with the reason (it is named `behind` and pushed to again)."""
        self._follow_list()
        self._over_http = True
        timeout = self.config.timeout_s
        targets = [u for u in self.urls if self.watch is None or self.watch.last(u) != DOWN]
        paused = self._all("pause_generation", targets, timeout_s=timeout)
        why = {u: f"/pause_generation failed: {exc}" for u, exc in paused.items() if exc is not None}
        loading = [u for u in targets if u not in why]
        tensors = dict(pairs)
        errors = self._all("load_lora_tensors", loading, adapter.name(version), tensors, adapter.peft_config(),
                           version, timeout_s=timeout)  # fmt: skip
        why.update({u: f"loading the adapter failed: {exc}" for u, exc in errors.items() if exc is not None})
        read = self._read_versions(loading, timeout)
        self._all("continue_generation", loading, timeout_s=timeout)
        self._record_http_push(stats, version, targets, loading, why, read, tensors)

    def _record_http_push(self, stats: PushStats, version: int, targets: list[str], loading: list[str],
                          why: dict[str, str], read: dict, tensors: dict) -> None:  # fmt: skip
        """One outcome per server of an adapter push over HTTP: committed where it read `version`
        back, else dropped with its reason (and tried again in 5 s)."""
        for url in self.urls:
            seen = read.get(url)
            if url in loading and url not in why and seen == version:
                stats.outcomes[url] = Outcome(True, version)
                continue
            reason = why.get(url) or ("probed down: loads it when back" if url not in targets else
                                      f"read back {seen} after loading")  # fmt: skip
            stats.outcomes[url] = Outcome(False, seen if isinstance(seen, int) else None, reason)
            self._retry_at[url] = time.monotonic() + 5.0
        stats.bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        stats.tensors, stats.buckets = len(tensors), 1
        committed = [u for u, o in stats.outcomes.items() if o.committed]
        stats.servers_updated = len(committed)
        stats.servers_dropped = [u for u, o in stats.outcomes.items() if not o.committed]
        if committed:
            self._pushed_version = version
        self._pushed_at = time.monotonic()
