"""The pipe between localrun and an engine worker: newline-delimited JSON, and errors that
cross it as {"type", "message", "hint"} and come back as the same LocalrunError subclass."""

from __future__ import annotations

import json
import os
import select
from collections import deque
from typing import Any

from localrun import errors
from localrun.errors import EngineError, LocalrunError


class Channel:
    """Newline-delimited JSON over a pair of raw file descriptors."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.buf = b""
        self.lines: deque[bytes] = deque()
        self.eof = False

    def send(self, obj: Any) -> None:
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.wfd, view)
            view = view[n:]

    def _fill(self, timeout: float | None) -> None:
        if timeout is not None:
            ready, _, _ = select.select([self.rfd], [], [], timeout)
            if not ready:
                return
        data = os.read(self.rfd, 1 << 16)
        if not data:
            self.eof = True
            return
        self.buf += data
        if b"\n" in self.buf:
            *complete, self.buf = self.buf.split(b"\n")
            self.lines.extend(complete)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; None on timeout or end of stream (check .eof)."""
        while not self.lines and not self.eof:
            self._fill(timeout)
            if timeout is not None:
                break
        if self.lines:
            return json.loads(self.lines.popleft())
        return None

    def recv_all(self, timeout: float | None) -> list[Any]:
        """Every message that has arrived (waiting up to timeout for one; None: until one comes)."""
        if not self.lines and not self.eof:
            self._fill(timeout)
            while timeout is None and not self.lines and not self.eof:
                self._fill(None)
        out = [json.loads(line) for line in self.lines]
        self.lines.clear()
        return out


def error_to_wire(e: BaseException) -> dict[str, Any]:
    """An exception as it crosses the pipe: its LocalrunError class by name, message and hint
    (anything else becomes an EngineError naming its type)."""
    if isinstance(e, LocalrunError):
        return {"type": type(e).__name__, "message": e.message, "hint": e.hint}
    return {"type": "EngineError", "message": f"{type(e).__name__}: {e}", "hint": None}


def error_from_wire(p: dict[str, Any]) -> LocalrunError:
    """The LocalrunError that error_to_wire sent, of the same class (EngineError if unknown), to raise here."""
    cls = getattr(errors, p.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, LocalrunError)):
        cls = EngineError
    return cls(p.get("message", "engine error"), p.get("hint"))
