"""LoRA adapters on inference servers: what weight sync calls on servers that load adapters, and
how a generation request names one.

An adapter travels as a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes it) that the server reads.
A server serves each version under its own name, `adapter_name(base, version)` (`policy-v3`):
a request names the served adapter, so the version behind every one of its tokens is that
name's, whatever is loaded meanwhile, and an adapter is never replaced in place.

`AdapterClient` is the protocol (`VLLMClient` and `SGLangClient` fill it):

- `adapter_limits()`: the rank, slot and module limits the server was started with, read from
  the server (vLLM `/server_info`, SGLang `/server_info`);
- `load_adapter(base, path, version)`: checks the adapter against those limits before sending
  (`AdapterLimitError` names the limit), loads it, then reads the server's adapter list back and
  returns the served name only if it is there with `path`; any failure raises `AdapterError`;
- `unload_adapter(name)`: the server stops serving `name` (read back the same way);
- `served_adapters()`: `{name: path}` as the server lists them (`GET /v1/models`, both servers);
- `check_servers(clients, spec)`: the limits check alone, for every server, before training;
- `load_lora_adapter(name, path, weight_version)`: weight sync's disk call (`weight_sync.base.
  AdapterUpdates`): `load_adapter` under `name` (`<base>-v<weight_version>`), then `keep_two`.

Weight sync serves the learner's adapter as `ADAPTER_BASE` (`agentrl-lora-v<v>`); after version v
is served, `keep_two` unloads every other version of that base but the newest below v (requests
that named it may still be running) — versions above v too: a learner resumed from an older
checkpoint pushes lower versions, and requests must not name the abandoned ones.

The adapter directory must be readable by the server; `VLLMClient.load_adapter_tensors` sends
the tensors and config to a vLLM server instead, which writes them on its own host.

A client built with `lora=BASE` names, per request, the newest served version of `BASE`
(`newest`), reports that version as the result's weight version and as the server's
(`get_weight_version`), and generates with the base model, at the server's own version, while
none is served (before the first adapter push).
"""

from __future__ import annotations

import abc
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from agentrl.inference.base import BadRequestError, GenerateResult, InferenceError
from agentrl.log import get_logger

logger = get_logger(__name__)

ADAPTER_BASE = "agentrl-lora"
"""The base name weight sync serves the learner's adapter under (`agentrl-lora-v<version>`)."""
_NAME = re.compile(r"^(?P<base>.+)-v(?P<version>\d+)$")
# SGLang allocates LoRA buffers per fused module: an adapter's q_proj fits `--lora-target-modules
# qkv_proj` (`get_normalized_target_modules` in sglang 0.5.23 `srt/lora/utils.py`).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


class AdapterError(InferenceError):
    """A server did not load (or unload) an adapter; the message says which and why."""


class AdapterLimitError(AdapterError, ValueError):
    """The adapter does not fit the server's LoRA limits (its rank, its target modules)."""


def adapter_name(base: str, version: int) -> str:
    """The name version `version` of adapter `base` is served under."""
    if not base or _NAME.match(base):
        raise ValueError(f"adapter base name {base!r}: must be non-empty and not end in -v<N>")
    return f"{base}-v{int(version)}"


def parse_adapter_name(name: str) -> tuple[str, int] | None:
    """`(base, version)` of a served name, or None for a name not made by `adapter_name`."""
    match = _NAME.match(name)
    return (match["base"], int(match["version"])) if match else None


def newest(served: dict[str, str] | list[str], base: str) -> tuple[str, int] | None:
    """The newest served version of `base`: `(name, version)`, or None if none is served."""
    versions = [
        (parsed[1], name) for name in served if (parsed := parse_adapter_name(name)) and parsed[0] == base
    ]
    if not versions:
        return None
    version, name = max(versions)
    return name, version


@dataclass(frozen=True)
class AdapterSpec:
    """What a server needs to know of an adapter before loading it (from `adapter_config.json`)."""

    rank: int
    """The largest rank of any module (`r`, or a larger one in `rank_pattern`)."""
    target_modules: tuple[str, ...]
    modules_to_save: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict) -> AdapterSpec:
        if config.get("peft_type", "LORA") != "LORA":
            raise AdapterLimitError(f"peft_type {config.get('peft_type')!r}: only LORA adapters are served")
        ranks = [int(config["r"]), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
        targets = config.get("target_modules") or []
        if isinstance(targets, str):  # PEFT also takes a regex; servers need the module list
            raise AdapterLimitError(f"target_modules {targets!r}: servers take a list of module names")
        return cls(max(ranks), tuple(sorted(targets)), tuple(sorted(config.get("modules_to_save") or [])))

    @classmethod
    def from_dir(cls, path: str | Path) -> AdapterSpec:
        file = Path(path) / "adapter_config.json"
        try:
            return cls.from_config(json.loads(file.read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, AdapterLimitError):
                raise
            raise AdapterError(
                f"{file}: not a readable PEFT adapter config ({type(exc).__name__}: {exc})"
            ) from exc


@dataclass(frozen=True)
class AdapterLimits:
    """The LoRA limits a server was started with."""

    max_rank: int
    """vLLM `--max-lora-rank`, SGLang `--max-lora-rank`."""
    max_loras: int
    """Adapters one batch may use (vLLM `--max-loras`, SGLang `--max-loras-per-batch`)."""
    target_modules: frozenset[str] | None = None
    """SGLang `--lora-target-modules`, fused names included (None: any module of the model, as
    vLLM; SGLang's `all` is None too)."""

    def check(self, spec: AdapterSpec, server: str = "the server") -> None:
        """Raise `AdapterLimitError` naming the limit `spec` exceeds."""
        if spec.rank > self.max_rank:
            raise AdapterLimitError(
                f"LoRA rank {spec.rank} is above {server}'s --max-lora-rank {self.max_rank}: "
                f"lower learner.lora.rank or start the server with a larger --max-lora-rank"
            )
        if spec.modules_to_save:
            raise AdapterLimitError(
                f"modules_to_save {list(spec.modules_to_save)}: {server} serves LoRA modules only "
                "(use weight_sync.lora_mode: merged)"
            )
        if self.target_modules is not None:
            allowed = {_FUSED.get(m, m) for m in self.target_modules}
            outside = sorted(m for m in spec.target_modules if _FUSED.get(m, m) not in allowed)
            if outside:
                raise AdapterLimitError(
                    f"target modules {outside} are not in {server}'s --lora-target-modules "
                    f"{sorted(self.target_modules)}"
                )


class AdapterClient(abc.ABC):
    """A server that loads LoRA adapters at run time (see the module docstring)."""

    url: str = ""

    @abc.abstractmethod
    async def adapter_limits(self) -> AdapterLimits:
        """The LoRA limits the server runs with; `AdapterError` if it was started without LoRA."""

    @abc.abstractmethod
    async def served_adapters(self) -> dict[str, str]:
        """`{served name: path}` of every adapter the server serves now."""

    @abc.abstractmethod
    async def _load(self, name: str, path: str) -> None:
        """Send the server's load call; raise `AdapterError` with its message when it refuses."""

    @abc.abstractmethod
    async def _unload(self, name: str) -> None:
        """Send the server's unload call; raise `AdapterError` with its message when it refuses."""

    async def load_adapter(self, base: str, path: str, version: int) -> str:
        """Serve the PEFT adapter directory `path` as `adapter_name(base, version)`; return that name
        once the server lists it with `path`. `AdapterLimitError` (nothing sent) when it does not fit
        the server's limits, `AdapterError` when the server refuses it or does not list it after. A
        name the server already serves (a push redone, a resumed learner) is unloaded and loaded
        again from `path`."""
        name = adapter_name(base, version)
        (await self.adapter_limits()).check(AdapterSpec.from_dir(path), self.url)
        if name in await self.served_adapters():  # a redone push: load it afresh, never keep a stale copy
            await self._unload(name)
        await self._load(name, str(path))
        served = await self.served_adapters()
        if served.get(name) != str(path):
            raise AdapterError(
                f"{self.url}: loading adapter {name} from {path} answered success, but the server lists "
                f"{served.get(name, 'no such adapter')!r} for it"
            )
        return name

    async def load_lora_adapter(self, name: str, path: str, weight_version: int | None = None) -> None:
        """Weight sync's disk call: serve the PEFT adapter directory `path` as `name`, which must be
        `adapter_name(base, weight_version)`, read back (`load_adapter`); then `keep_two`."""
        base, version = split_name(name, weight_version)
        await self.load_adapter(base, path, version)
        await self.keep_two(base, version)

    async def keep_two(self, base: str, version: int) -> list[str]:
        """Unload every served version of `base` but `version` and the newest one below it; returns
        the names unloaded. A failed unload is logged, not raised: the new version is served, and a
        stale one left above it shows in the version read back."""
        names = await self.served_adapters()
        served = sorted((p[1], n) for n in names if (p := parse_adapter_name(n)) is not None and p[0] == base)
        below = [v for v, _ in served if v < version]
        keep = {version, max(below)} if below else {version}
        gone = []
        for v, name in served:
            if v in keep:
                continue
            try:
                await self.unload_adapter(name)
                gone.append(name)
            except AdapterError as exc:
                logger.warning("%s: adapter %s still served: %s", self.url, name, exc)
        return gone

    async def unload_adapter(self, name: str) -> None:
        """Stop serving `name`; returns once the server no longer lists it."""
        await self._unload(name)
        if name in await self.served_adapters():
            raise AdapterError(
                f"{self.url}: unloading adapter {name} answered success, but it is still listed"
            )


def split_name(name: str, weight_version: int | None) -> tuple[str, int]:
    """`(base, version)` of a name weight sync sends, checked against the version it sends with it."""
    parsed = parse_adapter_name(name)
    if parsed is None or (weight_version is not None and parsed[1] != int(weight_version)):
        raise AdapterError(f"adapter name {name!r}: expected <base>-v{weight_version} (the pushed version)")
    return parsed


async def check_servers(clients: list[AdapterClient], spec: AdapterSpec) -> None:
    """Before training: every server can load an adapter like `spec` (e.g. `AdapterSpec(rank,
    target_modules)` from the learner's LoRA settings); `AdapterLimitError` naming the server and the
    limit otherwise, `AdapterError` for a server without LoRA."""
    import asyncio

    for client, limits in zip(
        clients, await asyncio.gather(*(c.adapter_limits() for c in clients)), strict=True
    ):
        limits.check(spec, client.url)


def served_from_models(url: str, reply: object) -> dict[str, str]:
    """`{name: path}` of the adapters in an OpenAI `/v1/models` reply (vLLM and SGLang list each
    adapter as a card with `parent` set to the base model and `root` its path)."""
    try:
        cards = reply["data"]  # type: ignore[index]
        return {card["id"]: card["root"] for card in cards if card.get("parent")}
    except (KeyError, TypeError) as exc:
        raise AdapterError(f"{url}/v1/models: unexpected reply {str(reply)[:300]}") from exc


async def generate_with_adapter(
    client: AdapterClient, base: str, send: Callable[[str | None], Awaitable[GenerateResult]]
) -> GenerateResult:
    """`send(name)` naming the newest served version of `base`, the result labelled with that
    version; `send(None)` (the base model, at the server's version) while none is served. Once
    more if the server refuses the name (unloaded between the look-up and the request)."""
    for attempt in (0, 1):
        adapter = newest(await client.served_adapters(), base)
        if adapter is None:
            return await send(None)
        name, version = adapter
        try:
            result = await send(name)
        except BadRequestError as exc:
            if attempt or name not in str(exc):
                raise
            continue
        result.weight_version = version
        return result
    raise AssertionError("unreachable")
