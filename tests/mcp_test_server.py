"""An MCP server built with the official SDK for the tests: tools that answer, fail, hang and
crash. Run as `python tests/mcp_test_server.py stdio`, or `... http` (Streamable HTTP on
127.0.0.1: it prints `listening PORT` once its socket is bound, and requests queue on it until
the server takes them)."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("localrun-test")


@server.tool()
def add(a: int, b: int) -> str:
    """Add two integers."""
    return str(a + b)


@server.tool()
def codeword(project: str) -> str:
    """The codeword of a project."""
    return f"The codeword of {project} is PELICAN-{len(project)}."


@server.tool()
def fail(reason: str) -> str:
    """A tool whose own code raises."""
    raise ValueError(f"it failed because {reason}")


@server.tool()
def sleep(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def crash() -> str:
    """The server process dies in the middle of the call."""
    os._exit(3)


def main() -> None:
    if sys.argv[1:] == ["stdio"]:
        server.run("stdio")
        return
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    print(f"listening {sock.getsockname()[1]}", flush=True)
    app = server.streamable_http_app(host="127.0.0.1")
    asyncio.run(uvicorn.Server(uvicorn.Config(app, log_level="warning")).serve(sockets=[sock]))


if __name__ == "__main__":
    main()
