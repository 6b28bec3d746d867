"""Named registries of backends, open to other packages through Python entry points.

Each seam keeps one `Registry` in the package that owns it (`agentrl/inference/registry.py`,
`agentrl/queue/registry.py`, `agentrl/weight_sync/registry.py`, `agentrl/envs/sandbox/__init__.py`,
`agentrl/envs/registry.py`). A built-in is registered as a `"module:attribute"` string, imported
only when its name is asked for, so an interface never imports its implementations and a backend's
optional dependencies stay optional. A separate distribution adds one by declaring an entry point
in the registry's group, e.g. in its pyproject.toml:

    [project.entry-points."agentrl.inference_backends"]
    my_server = "my_pkg.backend:BACKEND"

Entry points are read (`importlib.metadata`) the first time a name is not a built-in, and one is
loaded only when its name is used: an installed plugin that fails to import breaks only the runs
that ask for it.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownName(ValueError):
    """A name no built-in and no installed entry point registers; the message lists those that do."""


class Registry(Generic[T]):
    """Names to backends of one seam: built-ins plus the entry points of `group`."""

    def __init__(
        self, what: str, group: str | None, builtins: dict[str, str] | None = None, kind: str = "backend"
    ) -> None:
        self.what = what  # the config field naming a backend, for messages: "inference.type"
        self.kind = kind  # what a name names, for messages: "backend", "env"
        self.group = group  # None: built-ins (and `register`) only
        self._targets: dict[str, str | T] = dict(builtins or {})
        self._loaded: dict[str, T] = {}
        self._entry_points: dict[str, importlib.metadata.EntryPoint] | None = None

    def register(self, name: str, target: str | T) -> None:
        """Register `target` (the object, or where it lives as `"module:attribute"`) as `name`."""
        self._targets[name] = target
        self._loaded.pop(name, None)

    def builtins(self) -> list[str]:
        return list(self._targets)

    def names(self) -> list[str]:
        """Every registered name: built-ins first, then installed entry points (not loaded)."""
        return [*self._targets, *(n for n in self._plugins() if n not in self._targets)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._targets or name in self._plugins())

    def get(self, name: str) -> T:
        """The backend registered as `name`, imported on first use."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._targets:
            target = self._targets[name]
            value = _resolve(target) if isinstance(target, str) else target
        elif (ep := self._plugins().get(name)) is not None:
            try:
                value = ep.load()
            except Exception as exc:  # a plugin that fails to import, for whatever reason
                raise UnknownName(
                    f"{self.what}: {name!r} is registered by the entry point {ep.value!r} (group {self.group}) "
                    f"but loading it failed: {type(exc).__name__}: {exc}"
                ) from exc
        else:
            raise UnknownName(self.unknown(name))
        self._loaded[name] = value
        return value

    def require(self, name: str) -> str:
        """`name` if it is registered; else ValueError with `unknown`'s message (for validators,
        which name the field themselves)."""
        if name not in self:
            raise ValueError(self.unknown(name).removeprefix(f"{self.what}: "))
        return name

    def unknown(self, name: str) -> str:
        """The message for a name nothing registers."""
        close = difflib.get_close_matches(name, self.names(), n=1)
        more = (
            f" (other packages add names through the entry-point group {self.group!r})" if self.group else ""
        )
        return (
            f"{self.what}: unknown {self.kind} {name!r}"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f"; registered: {', '.join(self.names())}{more}"
        )

    def _plugins(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None and self.group is None:
            self._entry_points = {}
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=self.group)}
        return self._entry_points


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else []:
        value = getattr(value, part)
    return value
