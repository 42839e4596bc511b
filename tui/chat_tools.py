"""The app's MCP servers: named by localrun's own mcp.json or `localrun tui --mcp FILE`, started on
the first message sent with tools on (or when the tools panel opens), once per app, stopped when
the app exits. Each conversation turns servers and tools on and off (tui.tool_calls.ToolSettings);
a reply's tool loop gets only those that are on, and asks before any call runs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from localrun import api
from localrun.errors import LocalrunError
from tui.tool_calls import ToolSettings

if TYPE_CHECKING:
    from localrun.tool_loop import Answer, Ask, ToolLoop, ToolUse
    from localrun.tool_servers import ServerTool, ToolServers

MAX_STEPS = 8  # replies with calls before the model must answer (run's --max-tool-steps default)
CHOICES = ("auto", "required", "none")  # tool choices besides a tool's name


class ChatTools:
    """The MCP servers of one app session, and the answers given to its approval prompts."""

    def __init__(self, config: str | os.PathLike[str] | None = None, use: bool = True, allowed: Sequence[str] = (),
                 max_steps: int = MAX_STEPS, choice: str | None = None) -> None:
        self.notice: str | None = None  # why localrun's own mcp.json could not be read
        self.servers: ToolServers | None = None
        if use:
            try:
                self.servers = api.mcp_servers(config)
            except LocalrunError as e:
                if config is not None:
                    raise  # `tui --mcp FILE`: refused before the UI starts
                self.notice = f"{e} (the chat goes on without MCP tools)"
        self.allowed = tuple(a for a in allowed if a.strip())  # --allow-tools: asked ahead
        self.max_steps = max_steps
        self.choice = choice or "auto"
        self.started = False
        self.tools: list[ServerTool] = []  # every tool of the servers that run, once started
        self._lock = threading.Lock()  # one start at a time (a reply's worker, the tools panel's)
        self._reported: set[str] = set()
        self._answers: dict[int, dict[str, Answer]] = {}  # conversation -> SERVER/TOOL -> always|never

    @property
    def configured(self) -> bool:
        """Whether any server is named (and not disabled)."""
        return self.servers is not None and bool(self.servers.specs)

    def names(self) -> list[str]:
        """The servers' names, as mcp.json lists them."""
        return list(self.servers.specs) if self.servers is not None else []

    def failures(self) -> dict[str, str]:
        """Server -> why it is not available (it did not start, or it stopped)."""
        return dict(self.servers.failures) if self.servers is not None else {}

    def is_on(self, settings: ToolSettings) -> bool:
        """Whether a conversation with these settings sends its messages with tools."""
        return self.configured and any(settings.enabled(name) for name in self.names())

    def start(self) -> list[ServerTool]:
        """Start the servers not yet started (blocking: call it off the UI thread); their tools."""
        if self.servers is None:
            return []
        with self._lock:
            self.tools = self.servers.tools()
            self.started = True
            return list(self.tools)

    def new_failures(self) -> list[str]:
        """One line for each server that became unavailable since the last call (said once)."""
        servers = self.servers
        if servers is None:
            return []
        lines = []
        for name, why in dict(servers.failures).items():
            if name in self._reported:
                continue
            self._reported.add(name)
            spec = servers.specs.get(name)
            log = f" (its messages: {servers.log_path(name)})" if spec is not None and spec.command else ""
            lines.append(f"MCP server '{name}' is not available: {why}{log}; the chat goes on without its tools")
        return lines

    def loop(self, settings: ToolSettings, ask: Ask,
             on_call: Callable[[ServerTool, dict[str, Any]], None] | None = None,
             on_use: Callable[[ToolUse], None] | None = None) -> ToolLoop | None:
        """A reply's tool loop with the tools this conversation has on (None: none are), starting
        the servers when they have not started; `on_call` before a call runs, `on_use` after each."""
        if self.servers is None:
            return None
        with self._lock:
            # only this conversation's tools are offered (a call of one that is off is an unknown
            # tool, never run)
            loop = api.tool_loop(self.servers, self.allowed, ask, keep=lambda t: settings.enabled(t.server, t.name),
                                 max_steps=settings.max_steps or self.max_steps, on_use=on_use, on_call=on_call)
            self.tools = self.servers.tools()
            self.started = True
        return loop if loop.tools else None

    def first_choice(self, settings: ToolSettings, offered: Sequence[str]) -> str:
        """The tool choice of a reply's first step: the conversation's (or the app's), "auto"
        where it names a tool that is not offered."""
        choice = settings.choice or self.choice
        return choice if choice in CHOICES or choice in offered else "auto"

    def remembered(self, conversation: int) -> dict[str, Answer]:
        """The "always" and "never" answers given in a conversation (this app session), by SERVER/TOOL."""
        return self._answers.setdefault(conversation, {})

    def close(self) -> None:
        """Stop the servers (their processes end with them)."""
        if self.servers is not None:
            self.servers.close()


