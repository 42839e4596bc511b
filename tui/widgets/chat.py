"""The pieces of the chat screen: messages and the status bar."""

from __future__ import annotations

from typing import Any

from textual.widgets import Markdown, Static


class UserMessage(Static):
    """A prompt as typed (no markup interpretation)."""

    def __init__(self, text: str) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.text = text


class AssistantMessage(Markdown):
    """A reply rendered as Markdown, code blocks highlighted."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text


class StatusBar(Static):
    """Model, state, speed, structured output and context use of the chat."""

    def __init__(self) -> None:
        super().__init__("", id="chat-status", markup=False)
        self.model: str | None = None
        self.state = "no model"
        self.tokens_per_second: float | None = None
        self.context_used = 0
        self.context_length: int | None = None
        self.output: str | None = None  # the structured output replies must follow, if any

    def show(self, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(self, key, value)
        self.update(self.text())

    def text(self) -> str:
        parts = [self.model or "no model", self.state]
        if self.tokens_per_second:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.output:
            parts.append(f"output: {self.output}")
        ctx = f"/{self.context_length}" if self.context_length else ""
        parts.append(f"ctx {self.context_used}{ctx}")
        return " │ ".join(parts)
