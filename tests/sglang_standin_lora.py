"""SGLang 0.5.23's LoRA adapter rules, for the strict stand-in (tests/sglang_standin.py).

Mixed into `StandInSGLang`; each rule taken from the `sglang==0.5.23` wheel
(`pip download --no-deps sglang==0.5.23`), paths under `sglang/srt/`:

| rule | where in sglang 0.5.23 |
|---|---|
| flags `--enable-lora`, `--max-lora-rank`, `--lora-target-modules` (`all` or module names), `--max-loras-per-batch` (8), `--max-loaded-loras`; read back flat at `GET /server_info` | `arg_groups/fields/lora.py` `Lora`; `http_server.py` `server_info` (`ServerArgs.resolved_dict`) |
| `POST /load_lora_adapter` `{lora_name, lora_path, pinned}`, `POST /unload_lora_adapter` `{lora_name}`: `LoRAUpdateOutput` `{success, error_message, loaded_adapters}`, HTTP 400 when `success` is false | `http_server.py` `load_lora_adapter`, `unload_lora_adapter`; `managers/io_struct.py` `LoadLoRAAdapterReqInput`, `LoRAUpdateOutput` |
| without `--enable-lora`: both refused, "LoRA is not enabled" | `managers/tokenizer_control_mixin.py` `load_lora_adapter`, `unload_lora_adapter` |
| a name already loaded: refused | `lora/lora_manager.py` `validate_new_adapter` |
| rank above `--max-lora-rank` or a target module outside `--lora-target-modules` (q/k/v → qkv_proj, gate/up → gate_up_proj): refused, "incompatible with the current LoRA memory pool configuration" | `validate_new_adapter` (`memory_pool.can_support`); `lora/utils.py` `get_normalized_target_modules` |
| an unreadable adapter (config or weights): refused with the error | `lora_manager.py` `_load_lora_adapter` (`LoRAConfig`, `load_lora_weights`) |
| unloading an unknown name: refused, "does not exist" | `lora/lora_registry.py` `LoRARegistry.unregister` |
| above `--max-loaded-loras`, the least recently used adapter is unloaded after a load | `tokenizer_control_mixin.py` `load_lora_adapter` |
| `/generate` `lora_path` names an adapter (by name); without `--enable-lora`, or a name never loaded: HTTP 400 `{"error": {"message"}}`; a name unloaded but loaded before is loaded again from its path | `managers/tokenizer_manager.py` `_validate_and_resolve_lora`, `_resolve_lora_path`; `http_server.py` `_create_error_response` |
| `GET /v1/models`: the base model, then one card per adapter (`id` its name, `root` its path, `parent` the base) | `http_server.py` `available_models` |

`lose_loads` (set by a test) answers the next loads with success without serving them, so a
test can check that a client believes only what it reads back. Generation with an adapter is scripted from the adapter's weights (a digest of its
`adapter_model.safetensors` seeds the token draw), so a test sees which adapter served it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from aiohttp import web

_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


class StandInLoRA:
    """LoRA state and routes; `lora` is None (started without `--enable-lora`) or the flags."""

    lora: dict[str, Any] | None
    calls: list[str]

    def _lora_init(self, lora: dict[str, Any] | None) -> None:
        self.lora = None if lora is None else {"max_loras_per_batch": 8, "max_loaded_loras": None, **lora}
        self.adapters: dict[str, dict[str, Any]] = {}  # name -> {path, digest}, in load / use order (LRU)
        self.ref_cache: dict[str, str] = {}  # every name ever loaded -> its path (`lora_ref_cache`)
        self.lora_bodies: list[tuple[str, dict]] = []  # (route, body) of every LoRA call
        self.generated_with: list[str | None] = []  # the adapter of each /generate
        self.lose_loads = 0
        """Loads still to answer success without registering the adapter (a registry that drifted
        from the ranks, which `_merge_lora_update_results` guards against): a test's fault, not a rule."""

    def _lora_routes(self) -> tuple[dict, dict]:
        post = {"/load_lora_adapter": self._load_lora, "/unload_lora_adapter": self._unload_lora}
        get = {"/v1/models": self._models, "/server_info": self._server_info}
        return post, get

    @staticmethod
    def _lora_result(success: bool, message: str, loaded: dict[str, str]) -> web.Response:
        body = {"success": success, "error_message": message, "loaded_adapters": loaded}
        return web.json_response(body, status=200 if success else 400)

    def _loaded(self) -> dict[str, str]:
        return {name: a["path"] for name, a in self.adapters.items()}

    async def _server_info(self, request: web.Request) -> web.Response:
        lora = self.lora or {}
        return web.json_response(
            {
                "model_path": "stand-in",
                "enable_lora": self.lora is not None,
                "max_lora_rank": lora.get("max_lora_rank"),
                "lora_target_modules": lora.get("lora_target_modules"),
                "max_loras_per_batch": lora.get("max_loras_per_batch", 8),
                "max_loaded_loras": lora.get("max_loaded_loras"),
                "version": "0.5.23",
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        cards = [{"id": "stand-in", "object": "model", "root": "stand-in", "parent": None}]
        cards += [
            {"id": name, "object": "model", "root": a["path"], "parent": "stand-in", "max_model_len": None}
            for name, a in self.adapters.items()
        ]
        return web.json_response({"object": "list", "data": cards})

    def _read_adapter(self, name: str, path: str) -> dict[str, Any]:
        """What `LoRAConfig` + `validate_new_adapter` + `load_lora_weights` check, or ValueError."""
        assert self.lora is not None
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            weights = (Path(path) / "adapter_model.safetensors").read_bytes()
        except OSError as exc:
            raise ValueError(f"failed to load LoRA adapter {name} from {path}: {exc}") from None
        rank = max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])
        allowed = self.lora.get("lora_target_modules") or ["all"]
        modules = {_FUSED.get(m, m) for m in config.get("target_modules") or []}
        if rank > self.lora["max_lora_rank"] or (
            "all" not in allowed and not modules <= {_FUSED.get(m, m) for m in allowed}
        ):
            raise ValueError(
                f"LoRA adapter {name} with rank {rank} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        return {"path": path, "digest": hashlib.sha256(weights).hexdigest()}

    async def _load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_bodies.append((request.path, body))
        if self.lora is None:
            return self._lora_result(
                False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", {}
            )
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str):
            return web.json_response(
                {"object": "error", "message": "lora_name and lora_path: strings are required",
                 "type": "Bad Request", "param": None, "code": 400}, status=400)  # fmt: skip
        if name in self.adapters:
            return self._lora_result(
                False, f"Failed to load LoRA adapter {name} because it is already loaded", self._loaded()
            )
        try:
            self.adapters[name] = self._read_adapter(name, path)
        except ValueError as exc:
            return self._lora_result(False, str(exc), self._loaded())
        if self.lose_loads > 0:
            self.lose_loads -= 1
            loaded = self._loaded()
            del self.adapters[name]
            return self._lora_result(True, "", loaded)
        self.ref_cache[name] = path
        limit = self.lora["max_loaded_loras"]
        while limit is not None and len(self.adapters) > limit:
            del self.adapters[next(iter(self.adapters))]  # least recently used first
        return self._lora_result(True, "", self._loaded())

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.lora_bodies.append((request.path, body))
        if self.lora is None:
            return self._lora_result(
                False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", {}
            )
        name = body.get("lora_name")
        if name not in self.adapters:
            message = f"LoRA with name {name} does not exist. Loaded LoRAs: dict_keys({list(self.adapters)})"
            return self._lora_result(False, message, self._loaded())
        del self.adapters[name]
        return self._lora_result(True, "", self._loaded())

    def _resolve_lora(self, name: str | None) -> tuple[str | None, str | None]:
        """(the adapter's weight digest, or None for the base model; an error message, or None)."""
        self.generated_with.append(name)
        if not name:
            return None, None
        if self.lora is None:
            return None, (
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        if name not in self.adapters:
            if name not in self.ref_cache:
                return (
                    None,
                    f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {list(self.ref_cache)}.",
                )
            try:  # loaded before, unloaded since: SGLang loads it again from its path
                self.adapters[name] = self._read_adapter(name, self.ref_cache[name])
            except ValueError as exc:
                return None, f"Failed to implicitly load LoRA adapter {name}: {exc}"
        self.adapters[name] = self.adapters.pop(name)  # most recently used
        return self.adapters[name]["digest"], None
