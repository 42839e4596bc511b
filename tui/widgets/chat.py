"""The pieces of the chat screen: messages, a thinking model's thought, and the status bar."""

from __future__ import annotations

from typing import Any

from textual.widgets import Collapsible, Markdown, Static

from tui.conversations import thought_title


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
        self.thought: ThinkingBlock | None = None  # the block above it, when the model thought first


class ThinkingBlock(Collapsible):
    """A thinking model's thought, above its answer: open while it streams, titled with its time and
    tokens, collapsed once the answer starts (the title, Enter or Ctrl+G opens it again)."""

    def __init__(self, thinking: str = "", title: str = "Thinking…", collapsed: bool = False) -> None:
        self.thought = Static(thinking, markup=False, classes="thought")
        super().__init__(self.thought, title=title, collapsed=collapsed, classes="message thinking")
        self.thinking = thinking

    def append(self, text: str) -> None:
        """More of the thought, as it streams."""
        self.thinking += text
        self.thought.update(self.thinking)

    def progress(self, seconds: float, tokens: int) -> None:
        """The title while the model is still thinking."""
        self.title = f"Thinking… {thought_title(seconds, tokens).removeprefix('Thought for ')}"

    def finish(self, seconds: float | None, tokens: int | None) -> None:
        """The thought is over: its final title."""
        self.title = thought_title(seconds, tokens)


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
        self.drafts: tuple[int, int] | None = None  # speculative decoding: the last reply's drafted and kept tokens

    def show(self, **fields: Any) -> None:
        for key, value in fields.items():
            setattr(self, key, value)
        self.update(self.text())

    def text(self) -> str:
        parts = [self.model or "no model", self.state]
        if self.tokens_per_second:
            parts.append(f"{self.tokens_per_second:.1f} tok/s")
        if self.drafts:
            parts.append(f"drafts {self.drafts[1]}/{self.drafts[0]} kept")
        if self.output:
            parts.append(f"output: {self.output}")
        ctx = f"/{self.context_length}" if self.context_length else ""
        parts.append(f"ctx {self.context_used}{ctx}")
        return " │ ".join(parts)
