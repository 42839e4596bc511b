"""A request with tools on one model: the prompt, the constraint and the parser it uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from localrun.chat import Message
from localrun.errors import UsageError
from localrun.tools.base import ToolFormat, detect_format
from localrun.tools.request import normalize_choice, parse_tools
from localrun.tools.stream import ToolCall, ToolStreamer


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools on one model: the prompt, the constraint, the parser."""

    format: ToolFormat
    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = False

    @classmethod
    def make(cls, template: str | None, raw_tools: Any, raw_choice: Any = None, parallel: bool = False) -> ToolPlan | None:
        """The plan for a request's tools on a model with this chat template; None without tools."""
        if not raw_tools:
            if raw_choice not in (None, "none", "auto"):
                raise UsageError("tool_choice needs tools", "send the tools, or drop tool_choice")
            return None
        tools = parse_tools(raw_tools)
        return cls(detect_format(template), tuple(tools), normalize_choice(raw_choice, tools), parallel)

    def request(self, messages: Sequence[Message]) -> Any:
        """The Request: messages prepared for the template, tools passed where it renders them."""
        from localrun.generation import Request

        prepared = self.format.prepare(list(messages), list(self.tools), self.choice)
        return Request(messages=tuple(prepared), tools=self.tools if self.format.native else ())

    def constraint(self) -> tuple[str, str | None] | None:
        """The call grammar and its trigger (a lazy grammar under "auto" on native formats), or None
        where the model may answer freely; settings.resolve puts it in the request's settings."""
        # A named function is one call of it; more calls only when asked for and the choice allows.
        return self.format.constraint(list(self.tools), self.choice, self.parallel and self.choice in ("auto", "required"))

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.choice == "none":
            return text, []
        return self.format.parse(text)

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """A result record (run --json, batch) with the reply's calls parsed out of its text."""
        content, calls = self.parse(record.get("text", ""))
        out = {**record, "text": content, "tool_calls": [c.to_openai() for c in calls]}
        if calls:
            out["finish_reason"] = "tool_calls"
        return out

    def streamer(self) -> ToolStreamer | None:
        """The incremental parser for a streamed reply; None when no call can come (choice none)."""
        return None if self.choice == "none" else self.format.streamer()
