"""Images attached to chat messages: read from a path (typed after /image, pasted, or picked),
named and described for their chips, kept as their files' bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from localrun import images
from localrun.errors import UsageError


@dataclass(frozen=True)
class Attachment:
    """An attached image: its file's name (for the chip) and its bytes (what the model reads)."""

    name: str
    data: bytes = field(repr=False)

    def describe(self) -> str:
        """'PNG 112x84, 3.1 KB' (or that the bytes are no image localrun reads)."""
        try:
            return images.describe(self.data)
        except UsageError:
            return "not a readable image"

    @property
    def label(self) -> str:
        """The chip's text: 'cat.png · PNG 112x84, 3.1 KB'."""
        return f"{self.name} · {self.describe()}"


def read(path: str | Path) -> Attachment:
    """The image file at path (~ expanded), checked; UsageError naming it when it is missing, is
    not an image localrun reads, or is too large."""
    p = Path(path).expanduser()
    return Attachment(p.name, images.read_file(p, f"image '{path}'"))
