"""The env config section (`env:`): which environment episodes run in, its tool-call handling and
its sandbox (`agentrl/envs/sandbox/config.py`).

Kept beside the env code; `agentrl.config` assembles it into the run's `AgentRLConfig` and
re-exports it. Imports nothing of the envs themselves.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from agentrl.envs.sandbox.config import LocalSandboxConfig, SandboxConfig
from agentrl.section import Section


class EnvConfig(Section):
    """The environment episodes run in."""

    name: str = "toy_calculator"
    """Built-in env name or a dotted path `package.module:ClassName`."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the env's constructor."""
    tool_parser: Literal["hermes", "tags"] = "hermes"
    """How tool calls are parsed: Hermes/Qwen `<tool_call>` JSON or plain tags."""
    tool_timeout_s: float = Field(30.0, gt=0)
    """Time one tool call may take before it becomes an error observation."""
    max_tool_output_chars: int = Field(4096, ge=64)
    """Tool output beyond this is truncated with a marker."""
    sandbox: SandboxConfig = LocalSandboxConfig()
    """Where model-written code runs (SWE and other code envs): local, docker, remote, or a backend
    another package registers (entry-point group `agentrl.sandboxes`)."""
    service_resources: dict[str, float] = Field(default_factory=dict)
    """`--launcher ray` only: what each helper service of the env (`Env.services`: the Search-R1
    retriever with `retriever_url: auto`) asks Ray for, e.g. `{CPU: 4}` or `{sandbox: 1}`."""

    @model_validator(mode="before")
    @classmethod
    def _default_sandbox_type(cls, data: Any) -> Any:
        """A sandbox section without `type` keeps the local backend."""
        if isinstance(data, dict) and isinstance(data.get("sandbox"), dict) and "type" not in data["sandbox"]:
            data = {**data, "sandbox": {"type": "local", **data["sandbox"]}}
        return data
