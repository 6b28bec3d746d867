"""Environments: the Env / ToolEnv API, @tool, tool-call parsing, rewards, built-in envs.

User code imports the API from here: `from agentrl.envs import Env, ToolEnv, tool`.
"""

from agentrl.envs.base import Env, StepResult, Transcript
from agentrl.envs.tool_env import ToolEnv
from agentrl.envs.tools import Tool, tool

__all__ = ["Env", "StepResult", "Tool", "ToolEnv", "Transcript", "tool"]
