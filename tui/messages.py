"""Messages that cross screens and threads (post_message is thread-safe)."""

from __future__ import annotations

from typing import Any

from textual.message import Message


class ModelsChanged(Message):
    """The installed models changed (download, conversion, deletion): the Library reloads."""

    def __init__(self, select: str | None = None) -> None:
        super().__init__()
        self.select = select


class ReplyText(Message):
    """Streamed text of the reply in progress (several tokens coalesced)."""

    def __init__(self, generation: int, text: str) -> None:
        super().__init__()
        self.generation = generation
        self.text = text


class ReplyDone(Message):
    """The reply ended: its full text and the final chunk's statistics."""

    def __init__(self, generation: int, text: str, stats: dict[str, Any]) -> None:
        super().__init__()
        self.generation = generation
        self.text = text
        self.stats = stats


class ReplyFailed(Message):
    """The reply failed (engine error or crash); nothing was stored."""

    def __init__(self, generation: int, error: str) -> None:
        super().__init__()
        self.generation = generation
        self.error = error


class ModelLoaded(Message):
    """A model finished loading (or failed to) in the background."""

    def __init__(self, model: str, info: dict[str, Any] | None, error: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.info = info
        self.error = error
