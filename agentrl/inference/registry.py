"""The inference backends by name: each one `InferenceBackend` descriptor, and the clients built from it.

A backend is everything agentrl needs to know about one kind of server: the client that talks to
it (generation and weight updates), how `agentrl serve --backend NAME` starts it, how long a
starting server may take to answer its health check, what `agentrl doctor` reports about it and
which `inference:` field holds its own settings. `inference.type` names one; `client()` gives one
server's client (`router.create()` puts several behind a `Router`), `create_weight_updater()`
gives weight sync its control client. Built-ins: `embedded` (agentrl's server), `sglang` and `vllm`; another
package adds one through the entry-point group `agentrl.inference_backends`, whose object is an
`InferenceBackend` (see `agentrl/plugins.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from agentrl.plugins import Registry

if TYPE_CHECKING:
    from pydantic import BaseModel

    from agentrl.inference.base import InferenceClient, WeightUpdateClient

InferenceSection = Any
"""The run's `inference:` section (`agentrl/inference/config.py`), which checks its `type` and
`options` against this registry; named here by this alias rather than imported, so the section
and the registry do not import each other."""


class ClientSettings(Protocol):
    """What the client helpers below read of the `inference:` section."""

    type: str
    api_key_env: str
    request_timeout_s: float
    connect_timeout_s: float


@dataclass(frozen=True)
class InferenceBackend:
    """One kind of inference server, as the rest of agentrl sees it."""

    name: str
    """`inference.type` and `agentrl serve --backend` value."""
    client: Callable[..., Any]
    """`client(url, config, **kwargs)`: the `InferenceClient` (and `WeightUpdateClient`) of one
    server; `kwargs` are the api key and timeouts every client takes (`client_kwargs`)."""
    serve: Callable[[str, str, int, InferenceSection], int | None]
    """`serve(model_path, host, port, config)`: run the server in this process until it stops
    (`agentrl serve --backend NAME`, which `agentrl run` starts per server); its exit code."""
    startup_timeout_s: Callable[[InferenceSection], float] = lambda config: 300.0
    """How long `agentrl run` waits for a started server to answer its health check."""
    doctor: Callable[[InferenceSection], str] | None = None
    """What `agentrl doctor` prints on this backend's row (e.g. where it is installed); None: no row."""
    config_field: str | None = None
    """The `inference:` field holding a built-in backend's own settings (`vllm` for vLLM), if any."""
    options: type[BaseModel] | None = None
    """The model `inference.options` must validate against (another package's backend keeps its
    settings there; the backend reads `config.options`); None: it takes no options."""
    help: str = ""
    """One line for `agentrl serve --help`."""
    names_adapters: bool = False
    """Its servers serve LoRA adapters by name, per request (`inference/lora.py`: vLLM, SGLang): its
    client takes `lora=<base>`; False: a pushed adapter serves every request (the embedded server)."""


BACKENDS: Registry[InferenceBackend] = Registry(
    "inference.type",
    "agentrl.inference_backends",
    {
        "embedded": "agentrl.inference.backends:EMBEDDED",
        "sglang": "agentrl.inference.backends:SGLANG",
        "vllm": "agentrl.inference.backends:VLLM",
    },
)


def backend(name: str) -> InferenceBackend:
    """The descriptor registered as `name` (ValueError naming the registered ones if none is)."""
    found = BACKENDS.get(name)
    if not isinstance(found, InferenceBackend):
        raise ValueError(f"inference.type: {name!r} is registered as {found!r}, not an InferenceBackend")
    return found


def client_kwargs(config: ClientSettings) -> dict[str, Any]:
    """The api key and timeouts every client takes."""
    return dict(
        api_key=os.environ.get(config.api_key_env) or None,
        timeout_s=config.request_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
    )


def adapter_base(config: ClientSettings, adapter: object | None) -> str | None:
    """The adapter base name requests to `config.type`'s servers name (`lora=` of its clients):
    `agentrl-lora` when the learner pushes a LoRA adapter (`adapter`, weight sync's `AdapterSpec`;
    None: full or merged weights) and the backend serves adapters by name; else None."""
    if adapter is None or not backend(config.type).names_adapters:
        return None
    from agentrl.inference.lora import ADAPTER_BASE

    return ADAPTER_BASE


def _lora(lora: str | None) -> dict[str, Any]:
    return {} if lora is None else {"lora": lora}  # a backend that names no adapters takes no `lora`


def client(config: ClientSettings, url: str, lora: str | None = None) -> InferenceClient:
    """The client of the server at `url`, for `config.type` (`router.create` puts several behind a
    `Router`); `lora`: the adapter base its requests name (`adapter_base`)."""
    return backend(config.type).client(url, config, **client_kwargs(config), **_lora(lora))


def create_weight_updater(config: ClientSettings, url: str, lora: str | None = None) -> WeightUpdateClient:
    """The weight-update control client of the server at `url`, for `config.type`; with `lora`, it
    reads the newest served version of that adapter as the server's weight version."""
    return backend(config.type).client(url, config, **client_kwargs(config), **_lora(lora))
