"""MCP servers: the tools a model may use while it chats, from an `mcp.json` in the common format
(Claude Desktop's, Cursor's, LM Studio's):

    {"mcpServers": {"time": {"command": "mcp-server-time", "args": [], "env": {}, "cwd": "..."},
                    "mine": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "..."}}}}

A server starts on first use (its process over stdio, or a Streamable HTTP connection), once per
`ToolServers`, and stops when that closes. One that fails to start, does not answer or crashes is
one message naming it (`failures`), and the others go on. The official `mcp` SDK speaks the
protocol; its asyncio side runs on a thread of its own, so the callers (the CLI, the TUI, the
server's request threads) call it like any blocking function.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import UsageError

START_TIMEOUT = 30.0  # seconds a server has to start and list its tools
CALL_TIMEOUT = 60.0  # seconds one tool call may take


@dataclass(frozen=True)
class ServerSpec:
    """One entry of mcp.json: a command run over stdio, or a URL (Streamable HTTP)."""

    name: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return self.url or " ".join([self.command or "", *self.args]).strip()


def default_config() -> Path:
    """localrun's own mcp.json (in LOCALRUN_HOME)."""
    from localrun.store import home

    return home() / "mcp.json"


def read_config(path: str | os.PathLike[str] | None = None) -> dict[str, ServerSpec]:
    """The servers an mcp.json names (default: localrun's own, which may be absent: no servers)."""
    chosen = Path(path) if path is not None else default_config()
    if not chosen.is_file():
        if path is None:
            return {}
        raise UsageError(f"MCP configuration {chosen} does not exist", "give the path of an mcp.json")
    try:
        data = json.loads(chosen.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read the MCP configuration {chosen}: {e}",
                         'it must be JSON: {"mcpServers": {"NAME": {"command": ..., "args": [...]}}}') from None
    servers = data.get("mcpServers", data.get("servers")) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise UsageError(f"{chosen} has no \"mcpServers\" object",
                         'write {"mcpServers": {"NAME": {"command": ..., "args": [...]}}}')
    return {name: _spec(chosen, name, raw) for name, raw in servers.items()}


def _spec(path: Path, name: str, raw: Any) -> ServerSpec:
    where = f"{path}: server '{name}'"
    if not isinstance(raw, dict):
        raise UsageError(f"{where} must be an object with \"command\" or \"url\"")
    if raw.get("disabled") is True:
        return ServerSpec(name)  # kept, never started (LM Studio's and Cline's key)
    command, url = raw.get("command"), raw.get("url") or raw.get("serverUrl")
    if bool(command) == bool(url):
        raise UsageError(f"{where} needs either \"command\" (a program run over stdio) or \"url\"")
    args = raw.get("args") or []
    env = raw.get("env") or {}
    headers = raw.get("headers") or {}
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise UsageError(f"{where}: \"args\" must be a list of strings")
    for key, value in (("env", env), ("headers", headers)):
        if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
            raise UsageError(f"{where}: \"{key}\" must map names to strings")
    cwd = raw.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise UsageError(f"{where}: \"cwd\" must be a folder's path")
    return ServerSpec(name, command=command, args=tuple(args), env=dict(env), cwd=cwd, url=url, headers=dict(headers))


@dataclass(frozen=True)
class ServerTool:
    """One tool of one server, under the name the model sees (the tool's own name, or
    SERVER__NAME where two servers have a tool of that name)."""

    server: str
    name: str
    description: str
    schema: dict[str, Any]
    title: str | None = None
    model_name: str = ""

    def function(self) -> dict[str, Any]:
        """The tool as an OpenAI function tool (what ToolPlan takes)."""
        return {"type": "function", "function": {"name": self.model_name or self.name,
                                                 "description": self.description, "parameters": self.schema}}


@dataclass(frozen=True)
class CallResult:
    """What one call gave back: its text for the model, whether it is an error, and its time."""

    text: str
    is_error: bool
    seconds: float


class _Server:
    """One connected server: its client lives in one asyncio task, from start to stop."""

    def __init__(self, spec: ServerSpec, log_dir: Path) -> None:
        self.spec = spec
        self.client: Any = None
        self.tools: list[Any] = []
        self.error: str | None = None
        self.ready = asyncio.Event()
        self.stop = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.log_dir = log_dir

    def transport(self, errlog: Any) -> Any:
        if self.spec.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(headers=dict(self.spec.headers), timeout=CALL_TIMEOUT)
            return streamable_http_client(self.spec.url, http_client=http)
        from mcp import StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=str(self.spec.command), args=list(self.spec.args),
                                       env=dict(self.spec.env) or None, cwd=self.spec.cwd)
        return stdio_client(params, errlog=errlog)

    async def run(self) -> None:
        from mcp import Client

        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"mcp-{_safe(self.spec.name)}.log").open("a", encoding="utf-8")  # ToolServers.log_path
        try:
            async with Client(self.transport(log), read_timeout_seconds=CALL_TIMEOUT, mode="auto") as client:
                self.tools = list((await client.list_tools()).tools)
                self.client = client
                self.ready.set()
                await self.stop.wait()
        except BaseException as e:  # noqa: BLE001 - anything that ends the server is reported by name
            if not isinstance(e, asyncio.CancelledError) or not self.stop.is_set():
                self.error = _reason(e)
            if isinstance(e, asyncio.CancelledError) and not self.ready.is_set():
                self.error = self.error or "it was stopped while starting"
        finally:
            self.client = None
            if self.error is None and not self.stop.is_set():
                self.error = "it stopped"
            self.ready.set()
            log.close()


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _reason(e: BaseException) -> str:
    """One line for an exception, through exception groups (anyio's task groups wrap them)."""
    while isinstance(getattr(e, "exceptions", None), (list, tuple)) and e.exceptions:  # type: ignore[attr-defined]
        e = e.exceptions[0]  # type: ignore[attr-defined]
    if isinstance(e, FileNotFoundError):
        return f"its command was not found ({e.filename or e})"
    from mcp_types import CONNECTION_CLOSED

    if getattr(e, "code", None) == CONNECTION_CLOSED or getattr(getattr(e, "error", None), "code", None) == CONNECTION_CLOSED:
        return "its connection closed (the process exited?)"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _ServerGone(Exception):
    """A server ended while a call ran on it."""


class ToolServers:
    """The MCP servers of one chat session (or one server process): started on first use,
    stopped by close(). Safe to call from any thread."""

    def __init__(self, specs: Mapping[str, ServerSpec], *, start_timeout: float = START_TIMEOUT,
                 call_timeout: float = CALL_TIMEOUT, log_dir: Path | None = None) -> None:
        from localrun.store import home

        self.specs = {n: s for n, s in specs.items() if s.command or s.url}
        self.start_timeout = start_timeout
        self.call_timeout = call_timeout
        self.log_dir = log_dir or home() / "logs"
        self.failures: dict[str, str] = {}  # server -> why it is not available
        self._servers: dict[str, _Server] = {}
        self._lock = threading.Lock()
        self._starting = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- the event loop thread ---------------------------------------------------------------
    def _run(self, coro: Any, timeout: float | None) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, name="mcp", daemon=True)
                self._thread.start()
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            fut.cancel()
            raise

    # -- servers -----------------------------------------------------------------------------
    @property
    def running(self) -> list[str]:
        """The servers started and not stopped."""
        return [name for name, s in self._servers.items() if s.task is not None and not s.task.done()]

    def log_path(self, name: str) -> Path:
        """Where a stdio server's messages (its stderr) go."""
        return self.log_dir / f"mcp-{_safe(name)}.log"

    def start(self, names: list[str] | None = None) -> None:
        """Start the servers not yet started (all, or those named), together; a server that fails
        is recorded in `failures` and left out."""
        with self._starting:  # one start at a time (a chat's reply and its tools panel may both ask)
            wanted = [n for n in (names if names is not None else list(self.specs))
                      if n in self.specs and n not in self._servers and n not in self.failures]
            if wanted:
                self._run(self._start(wanted), None)

    async def _start(self, names: list[str]) -> None:
        fresh = [(name, _Server(self.specs[name], self.log_dir)) for name in names]
        for name, server in fresh:
            server.task = asyncio.get_running_loop().create_task(server.run(), name=f"mcp:{name}")

        async def one(name: str, server: _Server) -> None:
            try:
                await asyncio.wait_for(server.ready.wait(), self.start_timeout)
            except (TimeoutError, asyncio.TimeoutError):  # one class from Python 3.11 on
                server.stop.set()
                if server.task is not None:
                    server.task.cancel()
                self.failures[name] = f"it did not answer within {self.start_timeout:g} s"
                return
            if server.client is None:
                self.failures[name] = server.error or "it stopped"
            else:
                self._servers[name] = server

        await asyncio.gather(*(one(n, s) for n, s in fresh))

    def tools(self, names: list[str] | None = None) -> list[ServerTool]:
        """The tools of the servers (all, or those named) that run, starting them if needed."""
        self.start(names)
        raw = [(name, t) for name, s in self._servers.items() if names is None or name in names for t in s.tools]
        counts: dict[str, int] = {}
        for _, t in raw:
            counts[t.name] = counts.get(t.name, 0) + 1
        return [ServerTool(server=name, name=t.name, description=t.description or "",
                           schema=dict(t.input_schema or {"type": "object"}),
                           title=getattr(t, "title", None),
                           model_name=t.name if counts[t.name] == 1 else f"{_safe(name)}__{t.name}")
                for name, t in raw]

    def call(self, tool: ServerTool, arguments: dict[str, Any], timeout: float | None = None) -> CallResult:
        """Run one call, for at most `timeout` seconds (default: call_timeout); every failure (the
        tool's own error, a timeout, a server that crashed) is an error result the model reads,
        never an exception."""
        t0 = time.perf_counter()
        timeout = self.call_timeout if timeout is None else timeout
        server = self._servers.get(tool.server)
        if server is None or server.client is None or server.task is None or server.task.done():
            why = (server.error if server else None) or self.failures.get(tool.server) or "it is not running"
            return CallResult(f"the MCP server '{tool.server}' is not available: {why}", True, 0.0)
        try:
            result = self._run(self._call(server, tool.name, arguments, timeout), timeout + 10)
        except (FutureTimeout, TimeoutError, asyncio.TimeoutError):
            return CallResult(f"the tool '{tool.name}' on '{tool.server}' did not answer within "
                              f"{timeout:g} s", True, time.perf_counter() - t0)
        except _ServerGone as e:
            self.failures[tool.server] = str(e)
            self._servers.pop(tool.server, None)
            return CallResult(f"the MCP server '{tool.server}' stopped during the call: {e}", True,
                              time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - the model gets the error; the chat goes on
            return CallResult(f"the tool '{tool.name}' failed: {_reason(e)}", True, time.perf_counter() - t0)
        return CallResult(result_text(result), bool(result.is_error), time.perf_counter() - t0)

    async def _call(self, server: _Server, name: str, arguments: dict[str, Any], timeout: float) -> Any:
        assert server.task is not None
        call = asyncio.ensure_future(server.client.call_tool(name, arguments, read_timeout_seconds=timeout))
        done, _ = await asyncio.wait({call, server.task}, timeout=timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if call in done and (call.exception() is None or server.task in done):
            if server.task in done and call.exception() is not None:
                raise _ServerGone(server.error or "it stopped")
            return call.result()
        if call not in done:
            call.cancel()
            if server.task not in done:
                raise TimeoutError
            raise _ServerGone(server.error or "it stopped")
        # The call failed: a protocol error of the tool's, or the server's connection closed
        error = call.exception()
        if error is not None and _reason(error).startswith("its connection closed"):
            server.stop.set()  # its task ends; the client's context closes what is left
            raise _ServerGone(_reason(error))
        return call.result()

    def close(self) -> None:
        """Stop every server (their processes end with them) and the loop's thread."""
        if self._loop is None:
            return
        try:
            self._run(self._close(), 15)
        except Exception:  # noqa: BLE001 - closing never fails the caller
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        self._loop = None
        self._servers.clear()

    async def _close(self) -> None:
        tasks = []
        for server in self._servers.values():
            server.stop.set()
            if server.task is not None:
                tasks.append(server.task)
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    def __enter__(self) -> ToolServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def result_text(result: Any) -> str:
    """A call result as the text a model reads: its text parts, and structured content or other
    parts (images, resources) described in JSON."""
    parts: list[str] = []
    for block in result.content or []:
        kind = getattr(block, "type", "")
        if kind == "text":
            parts.append(block.text)
        elif kind == "image":
            parts.append(f"[image {getattr(block, 'mime_type', '')}]")
        elif kind == "resource":
            res = getattr(block, "resource", None)
            parts.append(getattr(res, "text", None) or f"[resource {getattr(res, 'uri', '')}]")
        else:
            parts.append(json.dumps(block.model_dump(mode="json", exclude_none=True)))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)
