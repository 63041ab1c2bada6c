"""A small MCP server over stdio with two tools: ``add`` (a calculator) and ``capital`` (a lookup table).

    python examples/mcp_agent/server.py      # speaks MCP on stdin/stdout; the agent starts it itself
"""

from mcp.server.mcpserver import MCPServer

CAPITALS = {"france": "Paris", "italy": "Rome", "japan": "Tokyo", "kenya": "Nairobi", "peru": "Lima"}

server = MCPServer("tracegym-example-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country (a small lookup table)."""
    return CAPITALS.get(country.strip().lower(), f"unknown country: {country}")


if __name__ == "__main__":
    server.run("stdio")
