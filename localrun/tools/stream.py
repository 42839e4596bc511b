"""Reading calls out of generated text, whole or as it streams: openers that start a call block,
the block's steps, and the events (content deltas, call deltas) a reply splits into."""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from localrun.reasoning.base import held
from localrun.tools.json_reader import Frag, JsonError, JsonReader

if TYPE_CHECKING:
    from localrun.tools.base import ToolFormat

ContentDelta = tuple[Literal["content"], str]
CallDelta = tuple[Literal["call"], int, str | None, str | None, str | None]
Event = ContentDelta | CallDelta

_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_ARG_KEYS = ("arguments", "parameters")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made."""

    id: str
    name: str
    arguments: dict[str, Any] = field(hash=False)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's shape: arguments as a JSON string."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}

    def to_ollama(self) -> dict[str, Any]:
        """Ollama's shape: arguments as an object."""
        return {"function": {"name": self.name, "arguments": self.arguments}}

    def to_template(self) -> dict[str, Any]:
        """The shape chat.Message.tool_calls holds (what templates read)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


# -- call blocks -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Opener:
    """Text that opens a call block, and the steps that read the block after it.

    Steps: ("ws", "") skips whitespace, ("lit", s) must match s, ("opt", s) ends the block unless s
    follows (last step only), ("json", role) reads one JSON value, ("name", end) a function name.
    No steps: the text is a wrapper token, dropped. keep: the opener is the start of the JSON.
    """

    text: str
    steps: tuple[tuple[str, str], ...] = ()
    keep: bool = False


@dataclass
class _Pending:
    name: str = ""
    named: bool = False
    arg_key: Any = None
    opened: bool = False
    bad: bool = False  # arguments that are not an object: not a call
    pieces: list[str] = field(default_factory=list)
    index: int | None = None


class _Calls:
    """The calls of one block: JSON fragments in, call events out (a call starts once it has
    both its name and the opening of its arguments, so stray JSON is never taken for a call)."""

    def __init__(self, role: str, emit: Callable[[Event], None], next_index: Callable[[], int],
                 new_id: Callable[[], str]) -> None:
        self.role, self.emit, self.next_index, self.new_id = role, emit, next_index, new_id
        self.pending: dict[tuple[Any, ...], _Pending] = {}
        self.claimed = False  # events were produced: the block was a call block

    def frag(self, f: Frag) -> None:
        # generic: the answer, or (as prepare writes past turns) the text beside the calls
        if self.role == "generic" and f.path in (("response",), ("content",)) and f.kind == "str":
            self._out(("content", f.text))
            return
        key = self._key(f.path)
        if key is None:
            return
        p = self.pending.setdefault(key, _Pending())
        rest = f.path[len(key):]
        if self.role == "args":
            self._args(p, f)
        elif rest == ("name",) and not p.named:
            if f.kind == "str":
                p.name += f.text
            elif f.kind == "str_close":
                p.named = True
                self._start(p)
        elif rest and rest[0] in _ARG_KEYS and p.arg_key in (None, rest[0]):
            p.arg_key = rest[0]
            self._args(p, f)

    def set_name(self, name: str) -> None:
        p = self.pending.setdefault((), _Pending())
        p.name, p.named = name, True

    def _key(self, path: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.role in ("call", "args"):
            return ()
        if self.role == "calls":
            return path[:1] if path and isinstance(path[0], int) else None
        if len(path) >= 2 and path[0] == "tool_calls" and isinstance(path[1], int):
            return path[:2]
        return None

    def _args(self, p: _Pending, f: Frag) -> None:
        if not p.opened:
            p.opened, p.bad = True, f.canon != "{"
        if p.bad:
            return
        if p.index is None:
            p.pieces.append(f.canon)
            self._start(p)
        else:
            self._out(("call", p.index, None, None, f.canon))

    def _start(self, p: _Pending) -> None:
        if p.index is not None or not (p.named and p.opened) or p.bad:
            return
        p.index = self.next_index()
        self._out(("call", p.index, self.new_id(), p.name, None))
        for piece in p.pieces:
            self._out(("call", p.index, None, None, piece))
        p.pieces = []

    def _out(self, event: Event) -> None:
        self.claimed = True
        self.emit(event)


class _Block:
    """One call block after its opener: its steps, read a character at a time."""

    def __init__(self, opener: Opener, calls: _Calls) -> None:
        self.steps = opener.steps
        self.calls = calls
        self.i = 0
        self.matched = 0  # characters of the current literal seen
        self.raw = "" if opener.keep else opener.text  # the block's text, for when it is not a call
        self.held = ""  # text since the last finished step: given back if the block ends here
        self.reader: JsonReader | None = None
        self.name = ""
        self.status = "open"  # open, done or failed

    def feed(self, text: str) -> str:
        """Read text; once the block has ended, return the part it did not consume."""
        for k, ch in enumerate(text):
            if not self._char(ch):
                return text[k:]
            if self.status != "open":
                return text[k + 1:]
        return ""

    def finish(self) -> None:
        """End of text: done if only optional steps are left, else failed."""
        if self.status == "open" and self.reader is not None and not self.reader.done:
            self._fed(self.reader.finish())
        if self.status == "open":
            done = all(kind in ("ws", "opt") for kind, _ in self.steps[self.i:])
            self.status = "done" if done else "failed"

    def _char(self, ch: str) -> bool:
        while self.i < len(self.steps):
            kind, arg = self.steps[self.i]
            if kind == "ws" and ch.isspace():
                self.held += ch
                return True
            if kind == "ws":
                self.i += 1
            elif kind in ("lit", "opt"):
                return self._literal(ch, kind, arg)
            elif kind == "json":
                return self._json(ch)
            else:
                return self._name(ch, arg)
        self.status = "done"
        return False

    def _literal(self, ch: str, kind: str, text: str) -> bool:
        if ch != text[self.matched]:
            self.status = "failed" if kind == "lit" else "done"
            return False
        self.matched += 1
        self.held += ch
        if self.matched == len(text):
            self._next()
        return True

    def _json(self, ch: str) -> bool:
        if self.reader is None:
            self.reader = JsonReader()
        try:
            frags = self.reader.feed(ch)
        except JsonError:
            self.status = "failed"
            return False
        self.held += ch
        self._fed(frags)
        return True

    def _fed(self, frags: list[Frag]) -> None:
        for f in frags:
            self.calls.frag(f)
        if self.reader is not None and self.reader.done:
            self._next()

    def _name(self, ch: str, end: str) -> bool:
        if ch == end and self.name:
            self.held += ch
            self.calls.set_name(self.name)
            self._next()
            return True
        if ch not in _NAME_CHARS or len(self.name) >= 64:
            self.status = "failed"
            return False
        self.name += ch
        self.held += ch
        return True

    def _next(self) -> None:
        self.raw += self.held
        self.held, self.matched, self.reader = "", 0, None
        self.i += 1
        if self.i == len(self.steps):
            self.status = "done"


# -- the streamer ----------------------------------------------------------------------------

class ToolStreamer:
    """Splits generated text, as it arrives, into content deltas and tool-call deltas.

    Text that may be the start of a call opener is held back until decided; content is stripped
    at both ends of the reply (trailing whitespace waits for more content). A call's first event
    carries its index, id and name; its arguments follow in pieces that join to
    json.dumps(arguments, ensure_ascii=False).
    """

    def __init__(self, fmt: ToolFormat, atomic: bool = False) -> None:
        self.fmt = fmt
        self.atomic = atomic  # hold a block's events until it ends; a broken block is content
        self.pending = ""
        self.block: _Block | None = None
        self.buffered: list[Event] = []
        self.out: list[Event] = []
        self.count = 0
        self.started = False
        self.space = ""
        self.plain = False  # generic: the reply did not open with JSON, so all of it is content

    def feed(self, text: str) -> list[Event]:
        """Newly generated text -> the events it decides."""
        while text:
            text = self._in_block(text) if self.block else self._scan(text)
        return self._take()

    def flush(self) -> list[Event]:
        """End of generation: what was held back."""
        if self.block is not None:
            self.block.finish()
            self.pending = self._close_block() + self.pending
        self._content(self.pending)
        self.pending = self.space = ""
        return self._take()

    def _scan(self, text: str) -> str:
        text, self.pending = self.pending + text, ""
        if self.fmt.json_at_start and not self.plain:
            body = text.lstrip()
            if not body:
                self.pending = text
                return ""
            self.plain = True  # one JSON object, at the start, or none
            if body[0] == "{":
                self._content(text[: len(text) - len(body)])
                self._open(Opener("{", (("json", "generic"),), keep=True))
                return body
        hit = _first(text, self.fmt.openers)
        if hit is None:
            keep = held(text, tuple(o.text for o in self.fmt.openers))
            self._content(text[: len(text) - keep])
            self.pending = text[len(text) - keep:]
            return ""
        at, opener = hit
        self._content(text[:at])
        if opener.steps:
            self._open(opener)
        return text[at:] if opener.keep else text[at + len(opener.text):]

    def _open(self, opener: Opener) -> None:
        role = next(arg for kind, arg in opener.steps if kind == "json")
        self.block = _Block(opener, _Calls(role, self._emit, self._index, self.fmt.new_id))

    def _in_block(self, text: str) -> str:
        assert self.block is not None
        rest = self.block.feed(text)
        if self.block.status == "open":
            return ""
        return self._close_block() + rest

    def _close_block(self) -> str:
        """The block has ended: release or drop its events; return the text to read again."""
        block, self.block = self.block, None
        assert block is not None
        held, self.buffered = self.buffered, []
        if block.status == "done" and block.calls.claimed:
            self._release(held)
            return block.held
        if block.status == "done":
            self._content(block.raw)
            return block.held
        if not (block.calls.claimed and not self.atomic):
            self._content(block.raw + block.held)
        return ""

    def _emit(self, event: Event) -> None:
        if self.atomic:
            self.buffered.append(event)
        else:
            self._release([event])

    def _release(self, events: list[Event]) -> None:
        for ev in events:
            if ev[0] == "content":
                self._content(ev[1])
            else:
                self.out.append(ev)

    def _index(self) -> int:
        self.count += 1
        return self.count - 1

    def _content(self, text: str) -> None:
        if not self.started:
            text = text.lstrip()
            if not text:
                return
            self.started = True
        body = text.rstrip()
        if not body:
            self.space += text
            return
        self.out.append(("content", self.space + body))
        self.space = text[len(body):]

    def _take(self) -> list[Event]:
        out: list[Event] = []
        for ev in self.out:
            last = out[-1] if out else None
            if last is not None and last[0] == "content" and ev[0] == "content":
                out[-1] = ("content", last[1] + ev[1])
            elif (last is not None and last[0] == "call" and ev[0] == "call" and last[1] == ev[1]
                  and last[4] is not None and ev[4] is not None):
                out[-1] = ("call", ev[1], last[2], last[3], last[4] + ev[4])
            else:
                out.append(ev)
        self.out = []
        return out


def _first(text: str, openers: Sequence[Opener]) -> tuple[int, Opener] | None:
    hits = [(i, -len(o.text), o) for o in openers if (i := text.find(o.text)) != -1]
    if not hits:
        return None
    at, _, opener = min(hits, key=lambda h: (h[0], h[1]))
    return at, opener


def assemble(events: list[Event]) -> tuple[str, list[ToolCall]]:
    """The events of a whole reply -> (content, calls)."""
    content: list[str] = []
    calls: dict[int, list[Any]] = {}
    for ev in events:
        if ev[0] == "content":
            content.append(ev[1])
            continue
        entry = calls.setdefault(ev[1], [ev[2] or "", ev[3] or "", []])
        if ev[4] is not None:
            entry[2].append(ev[4])
    out = []
    for call_id, name, pieces in calls.values():
        try:
            out.append(ToolCall(call_id, name, json.loads("".join(pieces))))
        except ValueError:  # cannot happen for a finished block; never crash on model output
            continue
    return "".join(content), out

