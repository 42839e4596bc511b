"""Images as messages carry them: the ways they arrive and what is refused before an engine sees them."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import pytest

from localrun import images
from localrun.chat import parse_messages
from localrun.errors import UsageError
from localrun.generation import Request


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 60)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def bomb(width: int = 30000, height: int = 30000) -> bytes:
    """A valid PNG of one colour that claims width x height pixels: a few hundred KB on the wire,
    2.7 GB once decoded."""
    row = b"\x00" + b"\x00" * (3 * width)
    data = zlib.compress(row * 64, 9)  # only the first rows: the header alone tells the size

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP"])
def test_the_header_gives_format_and_size_without_decoding(fmt: str) -> None:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (37, 21), (1, 2, 3)).save(buf, fmt)
    f = images.facts(buf.getvalue())
    assert (f.format, f.width, f.height) == (fmt, 37, 21)
    assert images.describe(buf.getvalue()).startswith(f"{fmt} 37x21, ")


def test_base64_and_data_uris_decode_and_bad_ones_say_which_image() -> None:
    data = png(8, 8)
    b64 = base64.b64encode(data).decode()
    assert images.from_base64(b64, "image 1") == data
    assert images.from_base64(f"data:image/png;base64,{b64}", "image 1") == data
    assert images.from_base64(b64[:40] + "\n" + b64[40:], "image 1") == data  # line-wrapped base64
    with pytest.raises(UsageError, match="message 0: image 2 is not valid base64"):
        images.from_base64("not base64!", "message 0: image 2")
    with pytest.raises(UsageError, match="is not a base64 data URI"):
        images.from_base64("data:image/png,rawbytes", "image 1")


def test_what_is_not_a_readable_image_is_refused_before_decoding() -> None:
    with pytest.raises(UsageError, match="is not an image localrun can read"):
        images.facts(b"%PDF-1.7 not an image")
    with pytest.raises(UsageError, match="is not an image localrun can read"):
        images.facts(b"\x00\x00\x00")
    with pytest.raises(UsageError, match=r"is 30000x30000 pixels, more than localrun decodes"):
        images.facts(bomb())
    assert images.facts(bomb(4000, 3000)).width == 4000  # large photos pass


def test_messages_carry_images_as_bytes_and_requests_cross_to_the_engine_whole(tmp_path) -> None:
    data = png(16, 12)
    msgs = parse_messages([{"role": "user", "content": "what is this?", "images": [base64.b64encode(data).decode()]}])
    assert msgs[0].images == (data,) and msgs[0].content == "what is this?"
    assert "images" not in msgs[0].to_dict()  # a chat template never sees the bytes
    req = Request(messages=tuple(msgs))
    assert req.images == 1
    back = Request.from_dict(req.to_dict())
    assert back.messages[0].images == (data,)
    with pytest.raises(UsageError, match="message 0: image 1 is not an image localrun can read"):
        parse_messages([{"role": "user", "content": "x", "images": [base64.b64encode(b"hello").decode()]}])
    with pytest.raises(UsageError, match="images must be a list"):
        parse_messages([{"role": "user", "content": "x", "images": "abc"}])
    path = tmp_path / "a.png"
    path.write_bytes(data)
    assert images.read_file(path) == data
    with pytest.raises(UsageError, match="no such file"):
        images.read_file(tmp_path / "missing.png")
