"""MCP tools in a ToolEnv, against a real MCP server over stdio."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("mcp", reason="the mcp extra is not installed")

from agentrl.envs.mcp_tools import MCPToolset
from agentrl.envs.tool_env import ToolEnv

SERVER = textwrap.dedent(
    '''
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("test-tools")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def fail(reason: str) -> str:
        """Always fails."""
        raise ToolError(reason)

    server.run("stdio")
    '''
)


@pytest.mark.slow
async def test_mcp_server_tools_run_inside_a_tool_env(tmp_path: Path) -> None:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    async with MCPToolset(command=[sys.executable, str(script)], timeout_s=20) as toolset:
        names = sorted(t.name for t in toolset.tools)
        assert names == ["add", "fail"]
        env = ToolEnv(tools=toolset.tools)
        schema = {t["function"]["name"]: t["function"] for t in env.tool_schemas}
        assert schema["add"]["description"] == "Add two integers."
        assert set(schema["add"]["parameters"]["properties"]) == {"a", "b"}
        env.reset({"question": "q"})
        result = await env.step(
            '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
            '<tool_call>{"name": "fail", "arguments": {"reason": "nope"}}</tool_call>'
        )
        assert result.observation[0]["content"] == "42"
        assert (
            result.observation[1]["content"].startswith("Error: fail failed")
            and "nope" in result.observation[1]["content"]
        )
        assert env.metrics["tool_error_raised"] == 1


def test_toolset_needs_exactly_one_transport() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        MCPToolset()
