"""Images attached to chat messages: read from a path (typed after /image, pasted, or picked),
named and described for their chips, kept as their files' bytes."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from localrun import images
from localrun.errors import UsageError

# What the file picker lists and what a pasted path is taken for: the formats llama.cpp's reader takes.
SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp")


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


def unquoted(text: str) -> str:
    """A path as terminals and file managers paste it: quoted ('~/my cat.png'), with escaped
    spaces (~/my\\ cat.png) or as a file:// URI, without the quoting."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.startswith("file://"):
        return unquote(urlparse(t).path)
    if "\\" in t:
        try:
            parts = shlex.split(t)
        except ValueError:
            return t
        if len(parts) == 1:
            return parts[0]
    return t


def pasted_image(text: str) -> Path | None:
    """The image file that `text` names when the whole of it is one path to an existing file with
    an image suffix (absolute, or from ~ or ./); None for anything else, which is sent as text."""
    if "\n" in text.strip():
        return None
    raw = unquoted(text)
    if not raw.startswith(("/", "~", "./", "../")):
        return None
    p = Path(raw).expanduser()
    try:
        return p if p.suffix.lower() in SUFFIXES and p.is_file() else None
    except OSError:  # a name too long for the file system is text
        return None
