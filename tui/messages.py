"""Messages that cross screens and threads (post_message is thread-safe)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from textual.message import Message

if TYPE_CHECKING:
    from tui.tool_calls import ToolCallRecord, ToolStep


class ModelsChanged(Message):
    """The installed models changed (download, conversion, deletion): the Library reloads."""

    def __init__(self, select: str | None = None) -> None:
        super().__init__()
        self.select = select


class ReplyText(Message):
    """Streamed text of the reply in progress (several tokens coalesced): answer text, and a
    thinking model's thought with its pieces and seconds so far."""

    def __init__(self, generation: int, text: str, thinking: str = "", thinking_pieces: int = 0,
                 thinking_seconds: float = 0.0) -> None:
        super().__init__()
        self.generation = generation
        self.text = text
        self.thinking = thinking
        self.thinking_pieces = thinking_pieces
        self.thinking_seconds = thinking_seconds


class ReplyDone(Message):
    """The reply ended: its full text and thought, the final chunk's statistics, and the replies
    before it that called tools."""

    def __init__(self, generation: int, text: str, stats: dict[str, Any], thinking: str = "",
                 steps: tuple[ToolStep, ...] = ()) -> None:
        super().__init__()
        self.generation = generation
        self.text = text
        self.stats = stats
        self.thinking = thinking
        self.steps = steps


class ToolStepEnded(Message):
    """A reply of the model ended with tool calls: its text beside them (the calls come next, one
    ToolUsed each, then the model's next reply)."""

    def __init__(self, generation: int, content: str, thinking_seconds: float = 0.0,
                 thinking_pieces: int = 0) -> None:
        super().__init__()
        self.generation = generation
        self.content = content
        self.thinking_seconds = thinking_seconds
        self.thinking_pieces = thinking_pieces


class ToolRunning(Message):
    """A call was allowed and runs on its server now."""

    def __init__(self, generation: int, where: str) -> None:
        super().__init__()
        self.generation = generation
        self.where = where


class ToolUsed(Message):
    """A call is over: it ran, failed or was refused."""

    def __init__(self, generation: int, call: ToolCallRecord) -> None:
        super().__init__()
        self.generation = generation
        self.call = call


class ReplyFailed(Message):
    """The reply failed (engine error or crash), or the model refused the message (`refused`: an
    image a text-only model cannot read); nothing was stored."""

    def __init__(self, generation: int, error: str, refused: bool = False) -> None:
        super().__init__()
        self.generation = generation
        self.error = error
        self.refused = refused


class ModelLoaded(Message):
    """A model finished loading (or failed to) in the background."""

    def __init__(self, model: str, info: dict[str, Any] | None, error: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.info = info
        self.error = error
