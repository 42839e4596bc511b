"""Incremental JSON: one value read a character at a time and reported as canonical fragments, so
a call's arguments stream out as they are generated, spelled as json.dumps spells them."""

from __future__ import annotations

import json
import re
import string
from typing import Any, NamedTuple


class Frag(NamedTuple):
    """One piece of a JSON value as json.dumps spells it."""

    kind: str  # open close key sep str_open str str_close scalar
    path: tuple[Any, ...]  # the value it belongs to (key and sep: their object or array)
    canon: str  # how json.dumps spells this piece
    text: str = ""  # a string value's decoded characters


class JsonError(ValueError):
    """Generated text that is not JSON."""


_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class JsonReader:
    """One JSON value, read a character at a time and reported as canonical fragments: joined,
    a subtree's fragments spell json.dumps(value, ensure_ascii=False) of that subtree."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []  # [opener, key or index, items so far]
        self.state = "value"
        self.token = ""  # a number, literal or \u escape being read
        self.key: str | None = None  # the object key being read (None: a string value)
        self.high = 0  # a UTF-16 high surrogate waiting for its pair
        self.done = False

    def feed(self, ch: str) -> list[Frag]:
        out: list[Frag] = []
        self._char(ch, out)
        return out

    def finish(self) -> list[Frag]:
        """End of text: completes a bare top-level number."""
        out: list[Frag] = []
        if self.state == "num" and not self.frames:
            self._number(out)
        return out

    def _path(self) -> tuple[Any, ...]:
        return tuple(f[1] for f in self.frames)

    def _char(self, ch: str, out: list[Frag]) -> None:
        if self.state in ("str", "esc", "uni"):
            self._string(ch, out)
        elif self.state in ("num", "lit"):
            self._scalar(ch, out)
        elif ch in " \t\r\n":
            return
        elif self.state == "value":
            self._value(ch, out)
        elif self.state == "key" and ch == '"':
            self.key, self.state = "", "str"
        elif self.state == "colon" and ch == ":":
            self.state = "value"
        elif self.state == "after" and ch == ",":
            frame = self.frames[-1]
            out.append(Frag("sep", self._path()[:-1], ", "))
            if frame[0] == "[":
                frame[1] += 1
            self.state = "value" if frame[0] == "[" else "key"
        elif self._closes(ch):
            self._close(out)
        else:
            raise JsonError(ch)

    def _closes(self, ch: str) -> bool:
        if not self.frames or self.state not in ("after", "key", "value"):
            return False
        opener, _, items = self.frames[-1]
        if ch != {"{": "}", "[": "]"}[opener]:
            return False
        return self.state == "after" or (items == 0 and self.frames[-1][1] in (None, 0))

    def _value(self, ch: str, out: list[Frag]) -> None:
        path = self._path()
        if ch in "{[":
            out.append(Frag("open", path, ch))
            self.frames.append([ch, None if ch == "{" else 0, 0])
            self.state = "key" if ch == "{" else "value"
        elif ch == '"':
            out.append(Frag("str_open", path, '"'))
            self.key, self.state = None, "str"
        elif ch in "-0123456789":
            self.token, self.state = ch, "num"
        elif ch in "tfn":
            self.token, self.state = ch, "lit"
        elif self._closes(ch):
            self._close(out)
        else:
            raise JsonError(ch)

    def _close(self, out: list[Frag]) -> None:
        opener = self.frames.pop()[0]
        out.append(Frag("close", self._path(), "}" if opener == "{" else "]"))
        self._end()

    def _end(self) -> None:
        if not self.frames:
            self.done, self.state = True, "done"
        else:
            self.frames[-1][2] += 1
            self.state = "after"

    def _string(self, ch: str, out: list[Frag]) -> None:
        if self.state == "esc":
            if ch == "u":
                self.token, self.state = "", "uni"
                return
            if ch not in _ESCAPES:
                raise JsonError(ch)
            self.state = "str"
            self._piece(_ESCAPES[ch], out)
        elif self.state == "uni":
            if ch not in string.hexdigits:
                raise JsonError(ch)
            self.token += ch
            if len(self.token) == 4:
                self.state = "str"
                self._code(int(self.token, 16), out)
        elif ch == "\\":
            self.state = "esc"
        elif ch == '"':
            self._flush_high(out)
            self._string_end(out)
        elif ord(ch) < 0x20:
            raise JsonError(ch)
        else:
            self._piece(ch, out)

    def _code(self, code: int, out: list[Frag]) -> None:
        if self.high and 0xDC00 <= code < 0xE000:
            pair, self.high = chr(0x10000 + ((self.high - 0xD800) << 10) + (code - 0xDC00)), 0
            self._piece(pair, out)
        elif 0xD800 <= code < 0xDC00:
            self._flush_high(out)
            self.high = code
        else:
            self._piece(chr(code), out)

    def _flush_high(self, out: list[Frag]) -> None:
        if self.high:
            high, self.high = self.high, 0
            self._piece(chr(high), out)

    def _piece(self, c: str, out: list[Frag]) -> None:
        if self.high:
            self._flush_high(out)
        if self.key is not None:
            self.key += c
        else:
            out.append(Frag("str", self._path(), json.dumps(c, ensure_ascii=False)[1:-1], c))

    def _string_end(self, out: list[Frag]) -> None:
        if self.key is None:
            out.append(Frag("str_close", self._path(), '"'))
            self._end()
            return
        self.frames[-1][1] = self.key
        out.append(Frag("key", self._path()[:-1], json.dumps(self.key, ensure_ascii=False) + ": "))
        self.key, self.state = None, "colon"

    def _scalar(self, ch: str, out: list[Frag]) -> None:
        if self.state == "num":
            if ch in "0123456789+-.eE":
                self.token += ch
                return
            self._number(out)
            self._char(ch, out)  # the character that ended the number
            return
        token = self.token + ch
        if not any(lit.startswith(token) for lit in _LITERALS):
            raise JsonError(token)
        self.token = token
        if token in _LITERALS:
            out.append(Frag("scalar", self._path(), token))
            self._end()

    def _number(self, out: list[Frag]) -> None:
        if not _NUM.fullmatch(self.token):
            raise JsonError(self.token)
        out.append(Frag("scalar", self._path(), json.dumps(json.loads(self.token))))
        self._end()

