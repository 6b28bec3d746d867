"""The embedded server's client: SGLang's native API (`SGLangClient`) plus the two adapter calls
an adapter push makes (`weight_sync.base.AdapterUpdates`), which the embedded server answers.

An adapter broadcast is SGLang's session with the adapter's config in `/begin_weight_update`
(`lora`, an agentrl extra): the buckets that follow are the adapter's tensors under PEFT's saved
names, staged, and `/end_weight_update` applies them on the base. A disk push is SGLang's
`/load_lora_adapter` (`lora_name`, `lora_path`) with the version as an extra field.
"""

from __future__ import annotations

from typing import Any

from agentrl.inference.sglang import SGLangClient, _check_success


class EmbeddedClient(SGLangClient):
    """`SGLangClient` for agentrl's embedded server, which also serves LoRA adapters."""

    async def begin_adapter_update(self, adapter: dict[str, Any], pause: bool = False) -> None:
        body: dict[str, Any] = {"lora": adapter, **({"pause_generation": True} if pause else {})}
        reply = await self.http.request("POST", "/begin_weight_update", body)
        _check_success("/begin_weight_update", reply)
        self.has_session = True
        await self._opened(reply, pause)

    async def load_lora_adapter(self, name: str, path: str, weight_version: int | None = None) -> None:
        body: dict[str, Any] = {"lora_name": name, "lora_path": path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        _check_success("/load_lora_adapter", await self.http.request("POST", "/load_lora_adapter", body))
