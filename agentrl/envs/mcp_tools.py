"""Tools served by an MCP server, usable by any ToolEnv.

    async with MCPToolset(command=["python", "my_mcp_server.py"]) as toolset:   # or url="http://host/mcp"
        env = ToolEnv(tools=toolset.tools)

The toolset opens one MCP session (stdio subprocess or streamable HTTP) and lists the
server's tools once; episodes share it. Each tool's schema is the server's
`inputSchema`; calls go through `tools/call` under the env's timeout, and a result
flagged `isError` becomes an error observation like any failing Python tool.
Needs the `mcp` extra (`pip install 'agentrl[mcp]'`, MCP Python SDK 2.x).
"""

from __future__ import annotations

import json
from typing import Any

from agentrl.envs.tools import Tool


class MCPToolError(RuntimeError):
    """The MCP server reported that a tool call failed."""


class MCPToolset:
    """An open MCP session and the tools it offers."""

    def __init__(
        self,
        command: list[str] | None = None,
        url: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        if (command is None) == (url is None):
            raise ValueError("MCPToolset needs exactly one of command=[...] (stdio) or url=... (HTTP)")
        self.command, self.url, self.env, self.timeout_s = command, url, env, timeout_s
        self.tools: list[Tool] = []
        self._client: Any = None

    async def __aenter__(self) -> MCPToolset:
        from mcp import Client
        from mcp.client.stdio import StdioServerParameters

        server: Any = self.url
        if self.command is not None:
            server = StdioServerParameters(command=self.command[0], args=self.command[1:], env=self.env)
        self._client = Client(server, read_timeout_seconds=self.timeout_s)
        await self._client.__aenter__()
        listing = await self._client.list_tools()
        self.tools = [self._wrap(t) for t in listing.tools]
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.__aexit__(*exc)
            self._client = None

    def _wrap(self, spec: Any) -> Tool:
        async def invoke(arguments: dict[str, Any], name: str = spec.name) -> str:
            result = await self._client.call_tool(name, arguments)
            text = "\n".join(
                getattr(block, "text", None) or json.dumps(block.model_dump(mode="json"))
                for block in result.content
            )
            if result.is_error:
                raise MCPToolError(text)
            return text

        return Tool(spec.name, spec.description or "", dict(spec.input_schema), invoke=invoke)
