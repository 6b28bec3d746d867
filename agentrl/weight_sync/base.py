"""Checkpoint engines: push the learner's weights into every inference server.

    engine = create(config.weight_sync, config.inference, rank=rank, run_dir=run_dir)
    engine.init()                      # rendezvous (broadcast) or directory set-up (disk)
    engine.push(weights, version)      # on every learner rank, after each optimizer step
    engine.close()

`weights` is a `WeightSource`: a function returning an iterator of `(HF name, full tensor)`,
e.g. `functools.partial(learner.fsdp.iter_full_tensors, model)` or `model.named_parameters`,
so any training backend can feed any engine. `push` is called on every learner rank because
gathering full tensors from an FSDP2 model is a collective; only rank 0 talks to the servers.
Servers are driven through their weight-update clients, each engine through the interface it
needs (`client_interface`): the disk engine through `agentrl.inference.base.WeightUpdateClient`,
the broadcast engine through `DistributedWeightUpdateClient` (the weight group and its sessions);
`init` refuses a server whose client lacks it. The embedded server, SGLang and vLLM implement both,
so each is updated through either engine. The learner loop is synchronous; the engine runs the
clients' HTTP calls on its own event-loop thread (`AsyncBridge`).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.inference.base import WeightUpdateClient
from agentrl.log import get_logger

if TYPE_CHECKING:
    import torch

    from agentrl.config import InferenceConfig

logger = get_logger(__name__)

WeightSource = Callable[[], Iterable[tuple[str, "torch.Tensor"]]]
"""What `push` takes: a function that returns the `(HF name, full tensor)` pairs to push, tied
weights once. It is called once per attempt (a push redone without a failed server calls it
again) and on every learner rank in step, since it may run collectives (FSDP2 gathers)."""


def errors_of(results: dict[str, Any]) -> dict[str, BaseException | None]:
    """{url: the exception its call raised, or None} of `WeightSyncEngine._each`'s results."""
    return {u: r if isinstance(r, BaseException) else None for u, r in results.items()}


class Resident(Iterator[tuple[str, "torch.Tensor"]]):
    """What a `WeightSource` returns when its tensors are the learner's own weights in place (a
    one-rank FSDP2 actor: `learner.fsdp.iter_full_tensors`), not gathered copies: a push may then
    gather ahead of the broadcast as far as it likes, since holding them costs no memory. Any
    other iterable is taken to hold a fresh copy per tensor (bounded look-ahead)."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._pairs = iter(pairs)

    def __iter__(self) -> Resident:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        return next(self._pairs)


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA config an adapter push carries beside its tensors (PEFT's `adapter_config.json`
    fields a server needs to apply them); the tensors are named as PEFT saves them
    (`base_model.model.<module>.lora_A.weight`)."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str = ""
    modules_to_save: bool = False
    """The learner also trains whole modules (`lora.modules_to_save`): only a merged push carries them."""

    @classmethod
    def of(cls, lora: Any, base_model: str) -> AdapterSpec:
        """The spec of a learner's `learner.lora` section (a `learner.lora.LoraConfig`)."""
        return cls(lora.rank, lora.alpha, tuple(lora.target_modules), base_model, bool(lora.modules_to_save))

    def name(self, version: int) -> str:
        """The name a server serves version `version` of this adapter under (`agentrl-lora-v<v>`)."""
        from agentrl.inference.lora import ADAPTER_BASE, adapter_name

        return adapter_name(ADAPTER_BASE, version)

    def peft_config(self) -> dict[str, Any]:
        """`adapter_config.json` of this adapter, with the fields PEFT 0.21's `LoraConfig` writes
        that a loader reads (`PeftModel.from_pretrained`, vLLM's and SGLang's LoRA loaders)."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.r,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(self.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "modules_to_save": None,
            "use_rslora": False,
            "use_dora": False,
            "inference_mode": True,
            "base_model_name_or_path": self.base_model,
        }

    def config(self, version: int) -> dict[str, Any]:
        """The adapter's config as it travels to a server: `peft_config` plus its served name."""
        return {**self.peft_config(), "name": self.name(version)}


@dataclass
class AdapterWeights:
    """What a LoRA learner hands `push` instead of a plain `WeightSource`: its adapter and, for
    `weight_sync.lora_mode: merged`, base + adapter merged. Calling it gives the adapter's tensors."""

    adapter: WeightSource
    """The adapter's lora_A / lora_B tensors under PEFT's saved names (a collective)."""
    merged: WeightSource
    """Base + adapter merged into the plain model's tensors under HF names (a collective)."""
    spec: AdapterSpec

    def __call__(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.adapter()


def pushed_adapter(lora: Any, lora_mode: str, base_model: str) -> AdapterSpec | None:
    """The adapter a run's pushes carry: the spec of `learner.lora` (`lora`) with `weight_sync.
    lora_mode: adapter`; None for full weights or `merged` (servers then serve plain weights)."""
    if lora is None or lora_mode != "adapter":
        return None
    return AdapterSpec.of(lora, base_model)


def resolve(weights: WeightSource, lora_mode: str) -> tuple[WeightSource, AdapterSpec | None]:
    """The tensors a push sends and the adapter they form (None: full weights). An `AdapterWeights`
    is sent as its adapter (`lora_mode: adapter`) or merged (`merged`: through the full-weight path)."""
    if not isinstance(weights, AdapterWeights):
        return weights, None
    if lora_mode == "merged":
        return weights.merged, None
    if weights.spec.modules_to_save:
        raise ValueError(
            "learner.lora.modules_to_save trains whole modules that an adapter push does not carry: "
            "set weight_sync.lora_mode: merged"
        )
    return weights.adapter, weights.spec


class AdapterUpdates(Protocol):
    """What an adapter push calls on a server's weight-update client, beside `WeightUpdateClient`;
    each path needs its own method, and a client without it takes no adapter push on that path: its
    server is dropped from it with the reason (`no_adapters`).

    Broadcast over the weight group (the embedded server): `pause_generation`,
    `begin_adapter_update(config)`, one `update_weights_from_distributed` per bucket of adapter
    tensors (PEFT saved names; the version with the last bucket), `end_weight_update` (commit: the
    server serves base + this adapter under `config["name"]` and reports the version),
    `continue_generation`; `abort_weight_update` on a failure, as for full weights.
    Broadcast engine, over HTTP (vLLM: adapters are small, and vLLM loads them by path):
    `load_lora_tensors(name, tensors, config, version)` between pause and continue.
    Disk (every backend): `load_lora_adapter(name, directory, version)` of a PEFT adapter
    directory, between pause and continue. Success is read back (`get_weight_version`)."""

    async def begin_adapter_update(self, adapter: dict[str, Any], pause: bool = False) -> None:
        """Open a session whose buckets form the adapter `adapter` (`AdapterSpec.config`); `pause`
        as for `begin_weight_update`."""
        ...

    async def load_lora_tensors(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], weight_version: int
    ) -> None:
        """Serve the adapter `tensors` (PEFT saved names) with PEFT config `config` as `name`."""
        ...

    async def load_lora_adapter(self, name: str, path: str, weight_version: int | None = None) -> None:
        """Load the PEFT adapter directory `path`, serve it as `name`, tagged `weight_version`."""
        ...


ADAPTER_PATHS = {"group": "begin_adapter_update", "http": "load_lora_tensors", "disk": "load_lora_adapter"}
"""The client method each adapter path calls (`AdapterUpdates`)."""


def loads_adapters(client: Any, path: str) -> bool:
    """Whether `client` takes an adapter push on `path` (`ADAPTER_PATHS`)."""
    return callable(getattr(client, ADAPTER_PATHS[path], None))


def no_adapters(client: Any, path: str) -> str:
    """Why `client`'s server is left out of an adapter push on `path`, naming the way out."""
    other = [p for p in ADAPTER_PATHS if p != path and loads_adapters(client, p)]
    how = {"disk": "weight_sync.type: disk", "group": "weight_sync.type: broadcast",
           "http": "weight_sync.type: broadcast"}  # fmt: skip
    ways = [*sorted({how[p] for p in other}), "weight_sync.lora_mode: merged"]
    return f"its client loads no LoRA adapters this way (set {' or '.join(ways)})"


class AsyncBridge:
    """An event loop on a daemon thread, for calling async clients from synchronous code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="weight-sync-io", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine) -> Any:
        """Schedule `coro`; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout_s: float | None = None) -> Any:
        return self.submit(coro).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)


@dataclass
class Outcome:
    """How one server left a push: `committed` at `version` (read back from the server after the
    commit), or not, with `reason`; `version` is then the one it reads back (None: it did not
    answer) and `paused` whether it was left paused (its weights may be a mix, until re-synced)."""

    committed: bool
    version: int | None
    reason: str = ""
    paused: bool = False

    def __str__(self) -> str:
        if self.committed:
            return f"committed v{self.version}"
        at = "unknown version" if self.version is None else f"v{self.version}"
        return f"dropped ({self.reason}; reads {at}{', kept paused' if self.paused else ''})"


@dataclass
class PushStats:
    version: int
    seconds: float = 0.0
    bytes: int = 0
    tensors: int = 0
    buckets: int = 0
    broadcasts: int = 0
    servers_updated: int = 0
    """Servers that committed `version`, read back."""
    servers_dropped: list[str] = field(default_factory=list)
    peak_bucket_bytes: int = 0
    attempts: int = 1
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    """Every server of the live list, by URL: committed, or dropped and why."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds by phase of the push, summed over buckets and attempts, where the engine times them
    (the broadcast engine: regroup, pause, begin, gather_wait, announce, broadcast, replies, commit,
    read_back, continue on the pushing thread; flatten on the gather thread, overlapped with the
    broadcast); not logged, for `agentrl bench sync`'s phase table."""
    bucket_round_trips: list[float] = field(default_factory=list)
    """Per bucket sent (broadcast engine): seconds from announcing it to the last server's reply."""

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def as_metrics(self) -> dict[str, float]:
        return {
            "sync/push_s": self.seconds,
            "sync/bytes": self.bytes,
            "sync/gb_per_s": self.bytes / self.seconds / 1e9 if self.seconds else 0.0,
            "sync/servers_updated": self.servers_updated,
            "sync/servers_dropped": len(self.servers_dropped),
            "sync/servers_paused": sum(o.paused for o in self.outcomes.values()),
            "sync/attempts": self.attempts,
            # per server: 1 committed the version (read back), 0 dropped from this push
            **{
                f"sync/committed/{url.split('://')[-1]}": float(o.committed)
                for url, o in self.outcomes.items()
            },
        }


class WeightSyncEngine(abc.ABC):
    """Base of the engines; subclasses implement `_init_servers` and `push`."""

    client_interface: type[WeightUpdateClient] = WeightUpdateClient
    """The client interface the engine drives every server through (`agentrl/inference/base.py`);
    a server whose client does not implement it is refused (`_refusal`)."""

    def __init__(
        self,
        urls: list[str],
        inference: InferenceConfig,
        rank: int = 0,
        servers_file: str | Path | None = None,
        adapter: AdapterSpec | None = None,
    ) -> None:
        self.urls = list(urls)
        self.inference = inference
        self.rank = rank
        self.adapter = adapter
        """The learner's LoRA adapter when its pushes are adapters (`lora_mode: adapter`): `init`
        checks every server can load it, and clients of servers that serve adapters by name read
        the newest served adapter's version as the server's."""
        self.last: PushStats | None = None
        self._bridge: AsyncBridge | None = None
        self.clients: dict[str, WeightUpdateClient] = {}
        # the launcher's live server list (`inference.server_list`), reread before each push and
        # while the learner waits for data; None: the servers are `urls` for the whole run
        self._list = None
        self._target: list[str] | None = None  # the list's URLs, once read
        if servers_file is not None and rank == 0:
            from agentrl.inference.server_list import Reader

            self._list = Reader(servers_file)
            found = self._list.poll()
            if found is not None:
                self.urls, self._target = list(found.urls), list(found.urls)

    def init(self) -> None:
        """Rank 0: the clients, then (with `adapter`) the LoRA limits check, then the engine's own
        set-up. `AdapterLimitError` naming the server and the limit (rank, module) if a server
        cannot load the adapter: before anything trains."""
        if self.rank == 0:
            self._bridge = AsyncBridge()
            try:
                self.clients = {url: self._client(url) for url in self.urls}
            except BaseException:
                self.close()
                raise
            if self.adapter is not None:
                self._check_adapter()
            self._init_servers()

    def _client(self, url: str) -> WeightUpdateClient:
        """The weight-update client of `url`; `TypeError` (`_refusal`) if it lacks `client_interface`."""
        from agentrl.inference.registry import adapter_base, create_weight_updater

        client = create_weight_updater(self.inference, url, lora=adapter_base(self.inference, self.adapter))
        if not isinstance(client, self.client_interface):
            raise TypeError(self._refusal(url, client))
        return client

    def _refusal(self, url: str, client: object) -> str:
        """Why the server at `url` cannot be pushed to by this engine through `client`."""
        return (
            f"server {url}: its client {type(client).__name__} (inference.type: {self.inference.type}) "
            f"does not implement {self.client_interface.__name__}, which {type(self).__name__} needs"
        )

    def _check_adapter(self) -> None:
        """`check_servers` on the answering servers whose clients read LoRA limits (vLLM, SGLang; the
        embedded server checks an adapter when it arrives). A server down now is checked by its
        first load, which refuses an adapter beyond its limits before sending it."""
        from agentrl.inference.lora import AdapterClient, check_servers
        from agentrl.inference.lora import AdapterSpec as Limits

        assert self.adapter is not None and self._bridge is not None
        spec = Limits(self.adapter.r, tuple(sorted(self.adapter.target_modules)))
        clients = [c for c in self.clients.values() if isinstance(c, AdapterClient) and c.lora is not None]

        async def check() -> None:
            up = await asyncio.gather(*(c.alive() for c in clients))
            for client, ok in zip(clients, up, strict=True):
                if not ok:
                    logger.warning(
                        "%s is not answering: its LoRA limits are checked at its first load", client.url
                    )
            await check_servers([c for c, ok in zip(clients, up, strict=True) if ok], spec)

        try:
            self._bridge.run(check(), timeout_s=self.inference.connect_timeout_s + 30)
        except BaseException:
            self.close()
            raise

    @abc.abstractmethod
    def _init_servers(self) -> None: ...

    def _reread(self) -> list[str]:
        """Follow the live server list, without blocking: a new URL gets a client and joins
        `urls` (a server behind: the engine's catch-up brings it to the current version); returns
        those. A removed URL stays until the next push takes it out (`_take_removed`)."""
        if self._list is not None and self._bridge is not None and (found := self._list.poll()) is not None:
            self._target = list(found.urls)
            logger.warning("server list epoch %d: %s", found.epoch, self._target)
        if self._target is None:
            return []
        added = [u for u in self._target if u not in self.urls]
        for url in added:
            self.clients[url] = self._client(url)
        self.urls += added
        if added:
            logger.warning("servers %s added to the server list: brought to the current version", added)
        return added

    def _leaving(self) -> list[str]:
        """Servers the live list no longer names, not yet taken out."""
        return [] if self._target is None else [u for u in self.urls if u not in self._target]

    def _take_removed(self) -> list[str]:
        """Take the servers the list dropped out of `urls` (their clients stay until `_forget`)."""
        removed = self._leaving()
        if removed:
            self.urls = [u for u in self.urls if u not in removed]
            logger.warning("servers %s removed from the server list: no longer pushed to", removed)
        return removed

    def _forget(self, urls: list[str]) -> None:
        for url in urls:
            client = self.clients.pop(url, None)
            if client is not None and self._bridge is not None:
                try:
                    self._bridge.run(client.close(), timeout_s=10)
                except Exception as exc:  # closing is best effort
                    logger.debug("closing client failed: %s", exc)

    @abc.abstractmethod
    def push(self, weights: WeightSource, version: int) -> PushStats | None:
        """Make every server generate with the tensors `weights()` yields, tagged `version` (an
        `AdapterWeights`: its adapter, or merged, by the config's `lora_mode`; see `resolve`)."""

    def _all(self, method: str, urls: list[str], *args: Any, timeout_s: float = 120.0, **kwargs: Any) -> dict:
        """Call `method` on the clients of `urls` concurrently; {url: exception or None}."""
        return errors_of(self._each(method, {u: kwargs for u in urls}, *args, timeout_s=timeout_s))

    def _each(
        self, method: str, calls: dict[str, dict[str, Any]], *args: Any, timeout_s: float = 120.0
    ) -> dict:
        """Call `method(*args, **calls[url])` on the client of each url concurrently; {url: its
        result, or the exception it raised}."""
        if not calls:  # no round trip through the bridge for nothing
            return {}

        async def one(url: str) -> Any:
            try:
                return await asyncio.wait_for(
                    getattr(self.clients[url], method)(*args, **calls[url]), timeout_s
                )
            except Exception as exc:
                return exc

        async def every() -> list:
            return await asyncio.gather(*(one(u) for u in calls))

        assert self._bridge is not None
        return dict(zip(calls, self._bridge.run(every()), strict=True))

    def _read_versions(self, urls: list[str], timeout_s: float) -> dict[str, int | BaseException]:
        """Each server's weight version, read back from it (an exception where it did not answer)."""
        if not urls:
            return {}

        async def one(url: str) -> int | BaseException:
            try:
                return await asyncio.wait_for(self.clients[url].get_weight_version(), timeout_s)
            except Exception as exc:
                return exc

        async def every() -> list:
            return await asyncio.gather(*(one(u) for u in urls))

        assert self._bridge is not None
        return dict(zip(urls, self._bridge.run(every()), strict=True))

    @staticmethod
    def _report(stats: PushStats, how: str) -> None:
        """Log one line per server (committed, or dropped and why), then the summary."""
        for url, outcome in stats.outcomes.items():
            (logger.info if outcome.committed else logger.error)(
                "version %d on %s: %s", stats.version, url, outcome
            )
        logger.info(
            "version %d committed on %d of %d server(s) %s: %.1f MB in %.2fs",
            stats.version,
            stats.servers_updated,
            len(stats.outcomes),
            how,
            stats.bytes / 1e6,
            stats.seconds,
        )

    def close(self) -> None:
        if self._bridge is not None:
            for client in self.clients.values():
                try:
                    self._bridge.run(client.close(), timeout_s=10)
                except Exception as exc:  # closing is best effort
                    logger.debug("closing client failed: %s", exc)
            self._bridge.close()
            self._bridge = None
