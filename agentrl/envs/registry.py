"""Find an environment class by built-in name or dotted path, and build one per episode.

env:
  name: toy_calculator            # built-in, or a name another package registers
  name: my_pkg.envs:MyEnv         # any importable class
  kwargs: {format_bonus: 0.1}

Another package registers an env by name through the entry-point group `agentrl.envs`
(`my_env = "my_pkg.envs:MyEnv"` under `[project.entry-points."agentrl.envs"]`).

A `module:Class` name is imported like any Python module: from the installed packages and
`PYTHONPATH` first, then from the current directory (so `examples.word_tools:WordTools` works
from a checkout, and `my_env:MyEnv` finds `./my_env.py`). Processes `agentrl run` starts
inherit its current directory.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

from agentrl.config import EnvConfig
from agentrl.envs.base import Env, live_services
from agentrl.envs.tool_env import ToolEnv
from agentrl.plugins import Registry

BUILTIN_ENVS = {
    "toy_lookup": "agentrl.envs.toy:LookupEnv",
    "toy_calculator": "agentrl.envs.toy:CalculatorEnv",
    "toy_calculator_slow": "agentrl.envs.toy:SlowCalculatorEnv",
    "toy_lookup_slow": "agentrl.envs.toy:SlowLookupEnv",
    "search_r1": "agentrl.envs.search.env:SearchR1Env",
    "search_r1_tools": "agentrl.envs.search.env:SearchToolEnv",
    "swe": "agentrl.envs.swe.env:SWEEnv",
    "agent": "agentrl.envs.agent:AgentEnv",
}
ENVS: Registry[type[Env]] = Registry("env.name", "agentrl.envs", BUILTIN_ENVS, kind="env")
"""Envs by name: the built-ins and those other packages register (entry-point group `agentrl.envs`)."""


def load_env_class(name: str) -> type[Env]:
    """The Env subclass named by `name` (a built-in name or `module.path:ClassName`)."""
    if ":" not in name and name not in BUILTIN_ENVS:
        if name not in ENVS:
            raise ValueError(ENVS.unknown(name) + ", or a dotted path like my_pkg.envs:MyEnv")
        cls = ENVS.get(name)  # registered by an installed package
        if not (isinstance(cls, type) and issubclass(cls, Env)):
            raise ValueError(f"env.name: {name!r} is registered as {cls!r}, not an agentrl Env subclass")
        return cls
    target = BUILTIN_ENVS.get(name, name)
    module_name, _, attr = target.partition(":")
    try:
        module = _import(module_name)
    except Exception as exc:  # an env module that fails to import, for whatever reason
        raise ValueError(f"env.name: cannot import {module_name!r} for env {name!r}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        envs = [
            k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Env) and v is not Env
        ]
        close = difflib.get_close_matches(attr, envs, n=1)
        hint = (
            f"; did you mean {module_name}:{close[0]}?"
            if close
            else f" (its Env classes: {', '.join(envs) or 'none'})"
        )
        raise ValueError(f"env.name: {module_name!r} ({module.__file__}) has no class {attr!r}{hint}")
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise ValueError(f"env.name: {target!r} is not an agentrl Env subclass")
    return cls


def _import(module_name: str):
    """Import `module_name`; if it is not found, look in the current directory as well (after
    everything else on the path, so an installed package keeps precedence)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.split(".")[0]
        cwd = os.getcwd()
        if exc.name not in (top, module_name) or cwd in sys.path or "" in sys.path:
            raise
        sys.path.append(cwd)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def task_env_class(config: EnvConfig) -> type[Env]:
    """The env class whose tasks the run draws (generator, required fields): the env's own, or for
    an agent env (`env.name: agent`) the env its `tasks_from` / `verifier` kwarg names (`Env.task_env`)."""
    cls = load_env_class(config.name)
    return cls.task_env(dict(config.kwargs)) or cls


def env_factory(config: EnvConfig) -> Callable[[], Env]:
    """A function making a fresh env per episode, from the env section of the config.

    The tool options (`tool_parser`, `tool_timeout_s`, `max_tool_output_chars`) apply to
    ToolEnvs; setting one for an env that has no tools is an error, not silently ignored.
    An env whose constructor takes a `sandbox` parameter gets `config.sandbox` (unless
    `env.kwargs` names one). A kwarg naming an env service the launcher started gets the
    service's current URL (`base.live_services`: it follows a service Ray moved)."""
    cls = load_env_class(config.name)
    kwargs: dict[str, Any] = dict(config.kwargs)
    if "sandbox" in inspect.signature(cls).parameters:
        kwargs.setdefault("sandbox", config.sandbox)
    tool_options = {"tool_parser", "tool_timeout_s", "max_tool_output_chars"}
    if issubclass(cls, ToolEnv):
        kwargs.setdefault("parser", config.tool_parser)
        kwargs.setdefault("tool_timeout_s", config.tool_timeout_s)
        kwargs.setdefault("max_tool_output_chars", config.max_tool_output_chars)
    else:
        if "parser" in inspect.signature(cls).parameters:  # an agent env parses its calls too
            kwargs.setdefault("parser", config.tool_parser)
            tool_options.discard("tool_parser")
        # compared with the defaults, not with the keys given: a resolved config names every field
        changed = sorted(
            k for k in tool_options if getattr(config, k) != type(config).model_fields[k].default
        )
        if changed:
            raise ValueError(
                f"env.{changed[0]}: {cls.__name__} is not a ToolEnv, so tool options do not apply to it"
            )

    def make() -> Env:  # the env services where they are now (`base.live_services`)
        return cls(**live_services.kwargs(kwargs))

    try:
        make().close()  # fail at start-up, not in the first episode, on bad kwargs
    except TypeError as exc:
        raise ValueError(f"env.kwargs: {cls.__name__} rejects {sorted(config.kwargs)}: {exc}") from exc
    return make
