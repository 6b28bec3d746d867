"""Environments: the Env / ToolEnv API, @tool, tool-call parsing, rewards, built-in envs."""
