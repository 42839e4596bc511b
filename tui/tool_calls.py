"""A chat's tool calls as the TUI keeps them: each call of a reply with what came of it (stored
with the reply, shown as a block, exported), the steps of a reply that called tools (sent back to
the model in later turns as the chat API's messages), and a conversation's tool settings."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

CallState = Literal["ran", "error", "refused"]


@dataclass(frozen=True)
class ToolCallRecord:
    """One call a reply made: the name the model called (`name`), the server's tool it ran, the
    arguments, the result the model read, and whether it ran, failed or was refused."""

    id: str
    name: str
    server: str
    tool: str
    arguments: Any
    result: str
    is_error: bool
    allowed: bool
    seconds: float = 0.0
    refused: bool = False  # the user said no: it never ran

    @property
    def state(self) -> CallState:
        if self.refused:
            return "refused"
        return "error" if self.is_error else "ran"

    @property
    def where(self) -> str:
        """server/tool (the name alone for a tool no server has)."""
        return f"{self.server}/{self.tool}" if self.server else self.tool

    def title(self) -> str:
        """'t/codeword · ran · 8 ms': the tool, what came of the call, and the tool's time when it ran."""
        parts = [self.where, self.state]
        if self.allowed:
            parts.append(duration(self.seconds))
        return " · ".join(parts)

    def arguments_text(self) -> str:
        if isinstance(self.arguments, str):
            return self.arguments
        return json.dumps(self.arguments, ensure_ascii=False, indent=2)

    def to_openai(self) -> dict[str, Any]:
        """The call as the chat API's assistant message holds it."""
        args = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "server": self.server, "tool": self.tool,
                "arguments": self.arguments, "result": self.result, "is_error": self.is_error,
                "allowed": self.allowed, "seconds": round(self.seconds, 4), "refused": self.refused}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCallRecord:
        return cls(str(data.get("id", "")), str(data.get("name") or data.get("tool", "")), str(data.get("server", "")),
                   str(data.get("tool", "")), data.get("arguments"), str(data.get("result", "")),
                   bool(data.get("is_error")), bool(data.get("allowed")), float(data.get("seconds") or 0.0),
                   bool(data.get("refused")))


@dataclass(frozen=True)
class ToolStep:
    """One reply of the model that called tools: its text beside the calls, its thought, the calls."""

    content: str = ""
    thinking: str = ""
    calls: tuple[ToolCallRecord, ...] = ()

    def messages(self) -> list[dict[str, Any]]:
        """The step as the chat API's messages: the assistant's calls, then each result."""
        turn: dict[str, Any] = {"role": "assistant", "content": self.content,
                                "tool_calls": [c.to_openai() for c in self.calls]}
        if self.thinking:
            turn["thinking"] = self.thinking
        return [turn, *({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": c.result}
                        for c in self.calls)]

    def to_dict(self) -> dict[str, Any]:
        return {"content": self.content, "thinking": self.thinking, "calls": [c.to_dict() for c in self.calls]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolStep:
        return cls(str(data.get("content", "")), str(data.get("thinking", "")),
                   tuple(ToolCallRecord.from_dict(c) for c in data.get("calls") or () if isinstance(c, Mapping)))


def steps_json(steps: Iterable[ToolStep]) -> str:
    """The messages table's tool_steps column ('' for a reply without calls)."""
    listed = [s.to_dict() for s in steps]
    return json.dumps(listed, ensure_ascii=False) if listed else ""


def read_steps(raw: str | None) -> tuple[ToolStep, ...]:
    """The tool_steps column back (a value this version cannot read: no steps)."""
    if not raw:
        return ()
    try:
        data = json.loads(raw)
        return tuple(ToolStep.from_dict(s) for s in data if isinstance(s, Mapping))
    except (ValueError, TypeError):
        return ()


def duration(seconds: float) -> str:
    """A tool's time: '8 ms', '1.2 s'."""
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def markdown(call: ToolCallRecord) -> list[str]:
    """A call as Markdown lines: a collapsed <details> block with its arguments and result."""
    fence = "````" if "```" in call.result or "```" in call.arguments_text() else "```"
    return ["<details>", f"<summary>Tool {call.title()}</summary>", "", "Arguments:", "", f"{fence}json",
            call.arguments_text(), fence, "", "Result:", "", fence, call.result, fence, "", "</details>", ""]


@dataclass(frozen=True)
class ToolSettings:
    """A conversation's tools: the servers (NAME) and tools (SERVER/TOOL) turned off, the tool choice
    of a reply's first step (auto, required, none or a tool's name; None: the app's), and the replies
    with calls before the model must answer (None: the app's)."""

    off: frozenset[str] = field(default_factory=frozenset)
    choice: str | None = None
    max_steps: int | None = None

    def enabled(self, server: str, tool: str | None = None) -> bool:
        """Whether a server (or one of its tools) is on in this conversation."""
        return server not in self.off and (tool is None or f"{server}/{tool}" not in self.off)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"off": sorted(self.off)}
        if self.choice is not None:
            data["choice"] = self.choice
        if self.max_steps is not None:
            data["max_steps"] = self.max_steps
        return data

    @classmethod
    def from_dict(cls, data: Any) -> ToolSettings:
        """Settings from the params column (what this version cannot read: the defaults)."""
        if not isinstance(data, Mapping):
            return cls()
        off = data.get("off") or []
        choice = data.get("choice")
        steps = data.get("max_steps")
        return cls(frozenset(str(o) for o in off) if isinstance(off, list) else frozenset(),
                   choice if isinstance(choice, str) and choice else None,
                   steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else None)
