"""Images that come with chat messages: how they arrive (bytes, base64, data URIs, files) and what
is checked before an engine decodes them.

An image is kept as its file's bytes from the moment it arrives until the engine decodes it. The
header is read here, without decoding: the format must be one llama.cpp's image reader takes
(PNG, JPEG, GIF, BMP), and the pixel count bounded, so that a truncated file, a file that is not an
image, or a small file that claims 30000 x 30000 pixels (a decompression bomb) is one clear error
for its request, never a crash of the engine.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import shlex
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from localrun.errors import UsageError

MAX_SIDE = 16384  # pixels per side
MAX_PIXELS = 64 * 1024 * 1024  # decoded: 192 MiB of RGB
MAX_BYTES = 64 * 1024 * 1024  # of the file
FORMATS = "PNG, JPEG, GIF or BMP"
# What a file picker lists and what a pasted path is taken for: the formats llama.cpp's reader takes.
SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".bmp")
_DATA_URI = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.S)


@dataclass(frozen=True)
class ImageFacts:
    format: str
    width: int
    height: int


def from_base64(text: str, what: str) -> bytes:
    """The bytes of an image sent as base64 (Ollama's `images`) or as a data URI (OpenAI's
    `image_url`); `what` names it in the error."""
    text = text.strip()
    if text.startswith("data:"):
        m = _DATA_URI.match(text)
        if m is None:
            raise UsageError(f"{what} is not a base64 data URI", "send data:image/png;base64,<data>")
        text = m.group("data")
    try:
        data = base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        raise UsageError(f"{what} is not valid base64", "send the image file's bytes as base64") from None
    if not data:
        raise UsageError(f"{what} is empty")
    return data


def to_base64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def read_file(path: str | Path, what: str | None = None) -> bytes:
    """An image file's bytes ('-': standard input), checked (facts())."""
    import sys

    name = what or f"image '{path}'"
    if str(path) == "-":
        data = sys.stdin.buffer.read()
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise UsageError(f"{name}: no such file", "give the path of an image file")
        if p.stat().st_size > MAX_BYTES:
            raise UsageError(f"{name} is larger than {MAX_BYTES >> 20} MiB")
        data = p.read_bytes()
    facts(data, name)
    return data


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


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(data: bytes) -> str:
    """'PNG 112x84, 3.1 KB' (for chips and listings)."""
    f = facts(data, "image")
    size = len(data)
    human = f"{size} B" if size < 1000 else f"{size / 1000:.1f} KB" if size < 1_000_000 else f"{size / 1e6:.1f} MB"
    return f"{f.format} {f.width}x{f.height}, {human}"


def facts(data: bytes, what: str = "the image") -> ImageFacts:
    """Format and size from the header; UsageError for anything llama.cpp's reader should not be given."""
    if len(data) > MAX_BYTES:
        raise UsageError(f"{what} is larger than {MAX_BYTES >> 20} MiB")
    found = _header(data)
    if found is None:
        raise UsageError(f"{what} is not an image localrun can read", f"send a {FORMATS} file")
    fmt, w, h = found
    if w <= 0 or h <= 0:
        raise UsageError(f"{what} ({fmt}) has no pixels or a damaged header")
    if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
        raise UsageError(f"{what} is {w}x{h} pixels, more than localrun decodes "
                         f"(at most {MAX_SIDE} per side and {MAX_PIXELS >> 20} megapixels)",
                         "send a smaller image")
    return ImageFacts(fmt, w, h)


def _header(d: bytes) -> tuple[str, int, int] | None:
    if d.startswith(b"\x89PNG\r\n\x1a\n") and len(d) >= 24 and d[12:16] == b"IHDR":
        w, h = struct.unpack(">II", d[16:24])
        return "PNG", w, h
    if d[:6] in (b"GIF87a", b"GIF89a") and len(d) >= 10:
        w, h = struct.unpack("<HH", d[6:10])
        return "GIF", w, h
    if d[:2] == b"BM" and len(d) >= 26:
        w, h = struct.unpack("<ii", d[18:26])
        return "BMP", w, abs(h)
    if d[:2] == b"\xff\xd8":
        return _jpeg(d)
    return None


def _jpeg(d: bytes) -> tuple[str, int, int] | None:
    """The frame size from a JPEG's first SOF marker."""
    i = 2
    while i + 4 <= len(d):
        if d[i] != 0xFF:
            return None
        marker = d[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        (length,) = struct.unpack(">H", d[i + 2:i + 4])
        if marker in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
            if i + 9 > len(d):
                return None
            h, w = struct.unpack(">HH", d[i + 5:i + 9])
            return "JPEG", w, h
        if marker == 0xDA:  # scan data before any frame header
            return None
        i += 2 + length
    return None


def fetch(url: str, what: str, timeout: float = 30.0) -> bytes:
    """An image over http(s) (only where the server was started with --allow-fetch), at most MAX_BYTES."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers={"User-Agent": "localrun"}),
                                    timeout=timeout) as resp:
            data = resp.read(MAX_BYTES + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise UsageError(f"{what}: {url[:80]} could not be fetched ({getattr(e, 'reason', e)})") from None
    if len(data) > MAX_BYTES:
        raise UsageError(f"{what}: {url[:80]} is larger than {MAX_BYTES >> 20} MiB")
    return data
