"""The pipe between localrun and an engine worker: newline-delimited JSON, and errors that
cross it as {"type", "message", "hint"} and come back as the same LocalrunError subclass."""

from __future__ import annotations

import json
import os
import queue
import select
import threading
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


class Inbox:
    """A channel's incoming messages, read by a thread of its own as they come.

    The engine worker reads its parent's requests between engine steps. Read there, a message
    larger than the pipe holds (a request with an image: hundreds of KB of base64) came in 64 KB
    per step, the parent's send blocked meanwhile, and each request behind it waited for more steps
    to end (4 image requests at once: the last two reached the engine 0.65 s late, one image's
    encoding). The engine's native calls release the GIL, so this thread takes each message whole
    while a step computes.
    """

    _END = object()

    def __init__(self, chan: Channel) -> None:
        self.eof = False
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._chan = chan
        threading.Thread(target=self._read, daemon=True, name="channel-inbox").start()

    def _read(self) -> None:
        try:
            while (msg := self._chan.recv(None)) is not None:
                self._q.put(msg)
        except BaseException as e:  # noqa: BLE001 - raised where the messages are taken
            self._q.put(e)
        self._q.put(self._END)

    def recv_all(self, timeout: float | None) -> list[Any]:
        """Every message that has arrived (waiting up to timeout for one; None: until one comes);
        after the last, .eof is set. A message that could not be read is raised here."""
        out: list[Any] = []
        if self.eof:
            return out
        try:
            item = self._q.get(timeout=timeout) if timeout != 0 else self._q.get_nowait()
            while True:
                if item is self._END:
                    self.eof = True
                    break
                if isinstance(item, BaseException):
                    raise item
                out.append(item)
                item = self._q.get_nowait()
        except queue.Empty:
            pass
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
