"""The sandbox backends by name (`env.sandbox.type`): the built-ins as `module:Class` strings,
imported only when used, and those other packages register (entry-point group
`agentrl.sandboxes`). Its own module, importing no config, so the sandbox config section can check
a name against it while `create()` (the package's `__init__`) takes that section."""

from __future__ import annotations

from agentrl.envs.sandbox.base import Sandbox
from agentrl.plugins import Registry

SANDBOXES: Registry[type[Sandbox]] = Registry(
    "env.sandbox.type",
    "agentrl.sandboxes",
    {
        "local": "agentrl.envs.sandbox.local:LocalSandbox",
        "docker": "agentrl.envs.sandbox.docker:DockerSandbox",
        "remote": "agentrl.envs.sandbox.remote:RemoteSandbox",
    },
)
"""Sandbox classes by `type`; another package adds one through the entry-point group
`agentrl.sandboxes` (a `Sandbox` subclass taking its `PluginSandboxConfig`)."""
