"""The pieces of the chat screen: the prompt, messages (a user's with its images), a thinking
model's thought, a tool call and its result, a refused message's error, and the status bar."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from textual import events
from textual.markup import escape
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Collapsible, Input, Markdown, Static

from localrun.images import pasted_image
from tui.attachments import Attachment
from tui.conversations import thought_title
from tui.tool_calls import ToolCallRecord
from tui.widgets.attachments import ImageChips


class PromptInput(Input):
    """The chat's prompt. A path to an image file pasted into it while empty attaches the image;
    Backspace in it while empty takes the last attached image off."""

    class ImagePasted(Message):
        """The whole paste was one path to an existing image file."""

        def __init__(self, path: Path) -> None:
            super().__init__()
            self.path = path

    class BackspaceEmpty(Message):
        """Backspace with nothing to delete."""

    def _on_paste(self, event: events.Paste) -> None:
        path = pasted_image(event.text) if not self.value.strip() else None
        if path is not None:
            event.prevent_default()  # Input's own handler would type the path in
            event.stop()
            self.post_message(self.ImagePasted(path))

    def action_delete_left(self) -> None:
        if not self.value and self.selection.is_empty:
            self.post_message(self.BackspaceEmpty())
            return
        super().action_delete_left()


class UserMessage(Static):
    """A prompt as typed (no markup interpretation), its images' chips above it."""

    def __init__(self, text: str, images: Sequence[Attachment] = ()) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.text = text
        self.images = tuple(images)
        self.chips = ImageChips(images) if images else None
        if images:
            self.add_class("-with-images")
            self.display = bool(text)  # an image sent alone is its chips

    def widgets(self) -> list[Any]:
        """What the conversation mounts for it: the chips, then the text."""
        return [self.chips, self] if self.chips is not None else [self]

    async def remove_all(self) -> None:
        """Take it and its chips out of the conversation."""
        if self.chips is not None:
            await self.chips.remove()
        await self.remove()


class AssistantMessage(Markdown):
    """A reply rendered as Markdown, code blocks highlighted."""

    def __init__(self, text: str = "") -> None:
        super().__init__(text, classes="message assistant")
        self.text = text
        self.thought: ThinkingBlock | None = None  # the block above it, when the model thought first
        # The reply's other widgets above it, when it called tools first: earlier steps' text and
        # thoughts, and the calls' blocks (regenerating the reply takes them out with it).
        self.parts: list[Widget] = []


class ReplyError(Static):
    """In place of a reply: why the model refused the message (nothing of it was kept)."""

    def __init__(self, error: str) -> None:
        super().__init__(f"{error}\n(this message was not kept)", markup=False, classes="message")
        self.error = error


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


class ToolCallBlock(Collapsible):
    """One tool call in the conversation: titled with its server/tool, what came of it (ran,
    error, refused) and its time; opened (a click, or Enter on its title) it shows the arguments
    and the result."""

    def __init__(self, call: ToolCallRecord) -> None:
        self.call = call
        self.arguments = Static(call.arguments_text(), markup=False, classes="tool-arguments")
        self.result = Static(call.result, markup=False, classes="tool-result")
        super().__init__(Static("Arguments", classes="tool-label"), self.arguments,
                         Static("Result", classes="tool-label"), self.result,
                         title=escape(call.title()), collapsed=True, classes=f"message tool -{call.state}")


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
