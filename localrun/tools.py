"""Tool calling: OpenAI/Ollama tools in, each model family's own call syntax out and back.

The family is read from the chat template (`detect_format`). A template that renders `tools`
itself gets them (`ToolFormat.native`); otherwise, and for history turns a template cannot show,
`prepare` writes tools and calls as text. `grammar` / `lazy_grammar` force the family's call syntax
with every function's arguments checked against its schema (llguidance Lark, with
`<<special:TEXT>>` where the opener may be one token), and `parse` / `streamer` read the calls back.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any, Literal, NamedTuple

from localrun.chat import Message, render_template
from localrun.constraint import check_schema, schema_lark
from localrun.errors import UsageError

CHOICES = ("auto", "required", "none")
ContentDelta = tuple[Literal["content"], str]
CallDelta = tuple[Literal["call"], int, str | None, str | None, str | None]
Event = ContentDelta | CallDelta

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_.-")
_ALNUM = string.ascii_letters + string.digits
_ARG_KEYS = ("arguments", "parameters")
# The house JSON style (as in localrun.constraint): compact separators, no free whitespace.
# TEXT may end in '>' (<|python_tag|>): the placeholder ends at the last '>>' of a run of '>'.
_SPECIAL = re.compile(r"<<special:(.+?)>>(?!>)", re.S)


# -- tools and tool_choice -----------------------------------------------------------------

def parse_tools(raw: Any) -> list[dict[str, Any]]:
    """Validate an OpenAI (or Ollama) tools list into [{"type": "function", "function": {...}}]."""
    if raw is None:
        return []
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        raise UsageError('tools must be a list of {"type": "function", "function": {"name": ...}} objects')
    out = [_tool(i, t) for i, t in enumerate(raw)]
    names = [t["function"]["name"] for t in out]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"tools: the function name '{name}' is used twice", "give each tool its own name")
    return out


def _tool(i: int, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise UsageError(f'tools[{i}] must be an object {{"type": "function", "function": {{...}}}}')
    if raw.get("type", "function") != "function":
        raise UsageError(f"tools[{i}] has type {raw.get('type')!r}", "only 'function' tools are supported")
    fn = raw.get("function")
    if not isinstance(fn, Mapping):
        raise UsageError(f"tools[{i}] needs a 'function' object with a 'name'")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UsageError(f"tools[{i}]: function name {name!r} is invalid",
                         "use 1 to 64 letters, digits, '_', '-' or '.'")
    out: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise UsageError(f"tool '{name}': 'description' must be a string")
    if desc is not None:
        out["description"] = desc
    params = fn.get("parameters")
    if params is not None:
        out["parameters"] = _parameters(name, params)
    return {"type": "function", "function": out}


def _parameters(name: str, params: Any) -> dict[str, Any]:
    if not isinstance(params, Mapping) or params.get("type", "object") != "object":
        raise UsageError(f"tool '{name}': 'parameters' must be a JSON schema of type object",
                         'for example {"type": "object", "properties": {"city": {"type": "string"}}}')
    try:
        params = json.loads(json.dumps(params))
    except (TypeError, ValueError) as e:
        raise UsageError(f"tool '{name}': 'parameters' is not JSON ({e})") from e
    check_schema(params, f"parameters of tool '{name}'")
    return params


def normalize_choice(raw: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """tool_choice as "auto", "required", "none" or the name of the function it forces."""
    names = [t["function"]["name"] for t in tools]
    if raw is None:
        return "auto"
    if isinstance(raw, Mapping):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else raw.get("name")  # Responses API: flat
        if raw.get("type", "function") != "function" or not isinstance(name, str):
            raise UsageError(f"invalid tool_choice {raw!r}", 'use {"type": "function", "function": {"name": ...}}')
        if name not in names:
            raise UsageError(f"tool_choice names the function '{name}', which is not in tools",
                             f"tools: {', '.join(names) or 'none given'}")
        return name
    if raw not in CHOICES:
        raise UsageError(f"invalid tool_choice {raw!r}",
                         'use "auto", "required", "none" or {"type": "function", "function": {"name": ...}}')
    if raw == "required" and not names:
        raise UsageError("tool_choice 'required' needs at least one tool")
    return str(raw)


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


# -- incremental JSON ------------------------------------------------------------------------

class _Frag(NamedTuple):
    kind: str  # open close key sep str_open str str_close scalar
    path: tuple[Any, ...]  # the value it belongs to (key and sep: their object or array)
    canon: str  # how json.dumps spells this piece
    text: str = ""  # a string value's decoded characters


class _JsonError(ValueError):
    """Generated text that is not JSON."""


_NUM = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _JsonReader:
    """One JSON value, read a character at a time and reported as canonical fragments: joined,
    a subtree's fragments spell json.dumps(value, ensure_ascii=False) of that subtree."""

    def __init__(self) -> None:
        self.frames: list[list[Any]] = []  # [opener, key or index, items so far]
        self.state = "value"
        self.token = ""  # a number, literal or \u escape being read
        self.key: str | None = None  # the object key being read (None: a string value)
        self.high = 0  # a UTF-16 high surrogate waiting for its pair
        self.done = False

    def feed(self, ch: str) -> list[_Frag]:
        out: list[_Frag] = []
        self._char(ch, out)
        return out

    def finish(self) -> list[_Frag]:
        """End of text: completes a bare top-level number."""
        out: list[_Frag] = []
        if self.state == "num" and not self.frames:
            self._number(out)
        return out

    def _path(self) -> tuple[Any, ...]:
        return tuple(f[1] for f in self.frames)

    def _char(self, ch: str, out: list[_Frag]) -> None:
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
            out.append(_Frag("sep", self._path()[:-1], ", "))
            if frame[0] == "[":
                frame[1] += 1
            self.state = "value" if frame[0] == "[" else "key"
        elif self._closes(ch):
            self._close(out)
        else:
            raise _JsonError(ch)

    def _closes(self, ch: str) -> bool:
        if not self.frames or self.state not in ("after", "key", "value"):
            return False
        opener, _, items = self.frames[-1]
        if ch != {"{": "}", "[": "]"}[opener]:
            return False
        return self.state == "after" or (items == 0 and self.frames[-1][1] in (None, 0))

    def _value(self, ch: str, out: list[_Frag]) -> None:
        path = self._path()
        if ch in "{[":
            out.append(_Frag("open", path, ch))
            self.frames.append([ch, None if ch == "{" else 0, 0])
            self.state = "key" if ch == "{" else "value"
        elif ch == '"':
            out.append(_Frag("str_open", path, '"'))
            self.key, self.state = None, "str"
        elif ch in "-0123456789":
            self.token, self.state = ch, "num"
        elif ch in "tfn":
            self.token, self.state = ch, "lit"
        elif self._closes(ch):
            self._close(out)
        else:
            raise _JsonError(ch)

    def _close(self, out: list[_Frag]) -> None:
        opener = self.frames.pop()[0]
        out.append(_Frag("close", self._path(), "}" if opener == "{" else "]"))
        self._end()

    def _end(self) -> None:
        if not self.frames:
            self.done, self.state = True, "done"
        else:
            self.frames[-1][2] += 1
            self.state = "after"

    def _string(self, ch: str, out: list[_Frag]) -> None:
        if self.state == "esc":
            if ch == "u":
                self.token, self.state = "", "uni"
                return
            if ch not in _ESCAPES:
                raise _JsonError(ch)
            self.state = "str"
            self._piece(_ESCAPES[ch], out)
        elif self.state == "uni":
            if ch not in string.hexdigits:
                raise _JsonError(ch)
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
            raise _JsonError(ch)
        else:
            self._piece(ch, out)

    def _code(self, code: int, out: list[_Frag]) -> None:
        if self.high and 0xDC00 <= code < 0xE000:
            pair, self.high = chr(0x10000 + ((self.high - 0xD800) << 10) + (code - 0xDC00)), 0
            self._piece(pair, out)
        elif 0xD800 <= code < 0xDC00:
            self._flush_high(out)
            self.high = code
        else:
            self._piece(chr(code), out)

    def _flush_high(self, out: list[_Frag]) -> None:
        if self.high:
            high, self.high = self.high, 0
            self._piece(chr(high), out)

    def _piece(self, c: str, out: list[_Frag]) -> None:
        if self.high:
            self._flush_high(out)
        if self.key is not None:
            self.key += c
        else:
            out.append(_Frag("str", self._path(), json.dumps(c, ensure_ascii=False)[1:-1], c))

    def _string_end(self, out: list[_Frag]) -> None:
        if self.key is None:
            out.append(_Frag("str_close", self._path(), '"'))
            self._end()
            return
        self.frames[-1][1] = self.key
        out.append(_Frag("key", self._path()[:-1], json.dumps(self.key, ensure_ascii=False) + ": "))
        self.key, self.state = None, "colon"

    def _scalar(self, ch: str, out: list[_Frag]) -> None:
        if self.state == "num":
            if ch in "0123456789+-.eE":
                self.token += ch
                return
            self._number(out)
            self._char(ch, out)  # the character that ended the number
            return
        token = self.token + ch
        if not any(lit.startswith(token) for lit in _LITERALS):
            raise _JsonError(token)
        self.token = token
        if token in _LITERALS:
            out.append(_Frag("scalar", self._path(), token))
            self._end()

    def _number(self, out: list[_Frag]) -> None:
        if not _NUM.fullmatch(self.token):
            raise _JsonError(self.token)
        out.append(_Frag("scalar", self._path(), json.dumps(json.loads(self.token))))
        self._end()


# -- call blocks -----------------------------------------------------------------------------

@dataclass(frozen=True)
class _Opener:
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

    def frag(self, f: _Frag) -> None:
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

    def _args(self, p: _Pending, f: _Frag) -> None:
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

    def __init__(self, opener: _Opener, calls: _Calls) -> None:
        self.steps = opener.steps
        self.calls = calls
        self.i = 0
        self.matched = 0  # characters of the current literal seen
        self.raw = "" if opener.keep else opener.text  # the block's text, for when it is not a call
        self.held = ""  # text since the last finished step: given back if the block ends here
        self.reader: _JsonReader | None = None
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
            self.reader = _JsonReader()
        try:
            frags = self.reader.feed(ch)
        except _JsonError:
            self.status = "failed"
            return False
        self.held += ch
        self._fed(frags)
        return True

    def _fed(self, frags: list[_Frag]) -> None:
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
                self._open(_Opener("{", (("json", "generic"),), keep=True))
                return body
        hit = _first(text, self.fmt.openers)
        if hit is None:
            keep = _held_prefix(text, self.fmt.openers)
            self._content(text[: len(text) - keep])
            self.pending = text[len(text) - keep:]
            return ""
        at, opener = hit
        self._content(text[:at])
        if opener.steps:
            self._open(opener)
        return text[at:] if opener.keep else text[at + len(opener.text):]

    def _open(self, opener: _Opener) -> None:
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


def _first(text: str, openers: Sequence[_Opener]) -> tuple[int, _Opener] | None:
    hits = [(i, -len(o.text), o) for o in openers if (i := text.find(o.text)) != -1]
    if not hits:
        return None
    at, _, opener = min(hits, key=lambda h: (h[0], h[1]))
    return at, opener


def _held_prefix(text: str, openers: Sequence[_Opener]) -> int:
    """Length of the longest end of text that could begin an opener."""
    longest = max((len(o.text) for o in openers), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        if any(o.text.startswith(text[-k:]) for o in openers):
            return k
    return 0


def _assemble(events: list[Event]) -> tuple[str, list[ToolCall]]:
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


# -- grammar pieces --------------------------------------------------------------------------

def resolve_specials(grammar: str, lookup: Callable[[str], int | None]) -> str:
    """Replace each `<<special:TEXT>>` with `<[id]>` when lookup(TEXT) gives a token id, else
    with TEXT as a quoted literal."""

    def sub(m: re.Match[str]) -> str:
        tid = lookup(m.group(1))
        return f"<[{tid}]>" if tid is not None else _lit(m.group(1))

    return _SPECIAL.sub(sub, grammar)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _sp(text: str) -> str:
    return f"<<special:{text}>>"


def _rx(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def _thought(before: str = "") -> str:
    """Rules for `thought`: reasoning up to and including </think>. The lexer is greedy, so free
    text must not be able to run past </think> as literal text (then `think_lit`, lazy, ends at it)
    nor, when the reply may skip thinking, begin with the calls' opener `before`."""
    skip = f" & ~/{_rx(before)}(?s:.*)/" if before else ""
    return (f"thought: THINK {_sp('</think>')} | think_lit\n"
            "think_lit[lazy]: THINK_LIT\n"
            f"THINK: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/{skip}\n"
            f"THINK_LIT: /(?s:.*)<\\/think>/{skip}\n"
            "WS: /[ \\t\\r\\n]+/\n")


def _params(tool: Mapping[str, Any]) -> Any:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call_schema(tool: Mapping[str, Any], args_key: str = "arguments",
                 extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    props = {"name": {"const": tool["function"]["name"]}, args_key: _params(tool), **(extra or {})}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _any(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _array(items: dict[str, Any], parallel: bool) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def _chosen(tools: Sequence[Mapping[str, Any]], choice: str) -> list[Mapping[str, Any]]:
    chosen = list(tools) if choice in CHOICES else [t for t in tools if t["function"]["name"] == choice]
    if not chosen:
        raise UsageError(f"tool_choice {choice!r} names no tool given", "pass the tool in tools")
    return chosen


def _new_id(n: int) -> str:
    return "".join(random.choices(_ALNUM, k=n))


def _plain_calls(m: Message) -> list[dict[str, Any]]:
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m.tool_calls]


def _tool_list(tools: Sequence[Mapping[str, Any]]) -> str:
    return json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)


def _must(choice: str) -> str:
    if choice == "required":
        return "You must call at least one tool.\n"
    return f"You must call the tool '{choice}'.\n" if choice not in CHOICES else ""


# -- the formats -----------------------------------------------------------------------------

class ToolFormat:
    """A model family's tool-call syntax: the prompt side, the grammar, and the parser."""

    name = "generic"
    native = True  # the template renders `tools` itself: pass tools= to render_template
    trigger: str | None = None  # under "auto", the lazy grammar applies from this text on
    openers: tuple[_Opener, ...] = ()
    json_at_start = False
    id_length = 0  # 0: "call_" + 24 characters

    def __init__(self, template: str | None = None) -> None:
        self.template = template

    @classmethod
    def matches(cls, template: str) -> bool:
        """Whether a chat template is of this family."""
        return cls.trigger is not None and cls.trigger in template

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        """The messages, ready for this family's template."""
        return list(messages)

    def grammar(self, tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True) -> str | None:
        """The grammar of the whole reply under "required" or a named choice; None under "none"
        and, for formats with a trigger, under "auto" (use lazy_grammar from the trigger on)."""
        if choice == "none" or (choice == "auto" and self.trigger):
            return None
        head, rules = self._prefix()
        return f"start: {head}calls\n" + self._calls(_chosen(tools, choice), parallel) + rules

    def lazy_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        """The grammar from the trigger on (it starts with the trigger)."""
        return "start: calls\n" + self._calls(_chosen(tools, "auto"), parallel)

    def constraint(self, tools: Sequence[Mapping[str, Any]], choice: str,
                   parallel: bool = True) -> tuple[str, str | None] | None:
        """(grammar, trigger) for a request: the trigger is None when the grammar applies from the start."""
        if choice == "none" or not tools:
            return None
        if choice == "auto" and self.trigger:
            return self.lazy_grammar(tools, parallel), self.trigger
        grammar = self.grammar(tools, choice, parallel)
        return (grammar, None) if grammar else None

    def new_id(self) -> str:
        """A fresh call id."""
        return _new_id(self.id_length) if self.id_length else "call_" + _new_id(24)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply -> (content, calls); a call that is not valid JSON stays content."""
        s = ToolStreamer(self, atomic=True)
        return _assemble(s.feed(text) + s.flush())

    def streamer(self) -> ToolStreamer:
        """An incremental parser for one streamed reply."""
        return ToolStreamer(self)

    def _prefix(self) -> tuple[str, str]:
        """What may come before the calls when they are the whole reply, and its rules."""
        return "", ""

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        raise NotImplementedError


class Hermes(ToolFormat):
    """Qwen 2.5 / Qwen 3 (and Hermes 2 Pro): <tool_call>\\n{"name", "arguments"}\\n</tool_call> per call."""

    name = "hermes"
    trigger = "<tool_call>"
    openers = (_Opener("<tool_call>", (("ws", ""), ("json", "call"), ("ws", ""), ("opt", "</tool_call>"))),)

    def _prefix(self) -> tuple[str, str]:
        if not self.template or "<think>" not in self.template:
            return "", ""
        return "think? ", f"think: {_sp('<think>')} thought WS?\n" + _thought()

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        many = ' ("\\n" call)*' if parallel else ""
        return (f"calls: call{many}\n"
                f'call: {_sp("<tool_call>")} "\\n" body "\\n" {_sp("</tool_call>")}\n'
                + schema_lark(_any([_call_schema(t) for t in tools]), "body"))


class Llama3(ToolFormat):
    """Llama 3.1+: one {"name", "parameters"} object per reply, optionally after <|python_tag|>.

    The trigger is the text '{"name"' (what the model writes first, the grammar's compact style
    fixes it), not <|python_tag|>, which the model often leaves out; a tag before it is dropped.
    """

    name = "llama3"
    trigger = '{"name"'
    openers = (_Opener("<|python_tag|>"), _Opener('{"name"', (("json", "call"),), keep=True))

    @classmethod
    def matches(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template)

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        # The template refuses more than one call per turn: one turn per call.
        out: list[Message] = []
        for m in messages:
            if m.role == "assistant" and len(m.tool_calls) > 1:
                out.extend(replace(m, content=m.content if i == 0 else "", tool_calls=(c,))
                           for i, c in enumerate(m.tool_calls))
            else:
                out.append(m)
        return out

    def _prefix(self) -> tuple[str, str]:
        return f"{_sp('<|python_tag|>')}? ", ""

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        return schema_lark(_any([_call_schema(t, "parameters") for t in tools]), "calls")


class Mistral(ToolFormat):
    """Mistral Nemo: [TOOL_CALLS][{"name", "arguments", "id"}, ...] with 9-character ids."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    openers = (_Opener("[TOOL_CALLS]", (("ws", ""), ("json", "calls"))),)
    id_length = 9
    _ID = {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        # The template requires 9-character alphanumeric ids: others are mapped to one, stably.
        out: list[Message] = []
        unanswered: list[str] = []
        for i, m in enumerate(messages):
            if m.role == "assistant" and m.tool_calls:
                calls = tuple({**c, "id": _mistral_id(c.get("id") or f"{i}.{j}")} for j, c in enumerate(m.tool_calls))
                unanswered.extend(c["id"] for c in calls)
                out.append(replace(m, tool_calls=calls))
            elif m.role == "tool":
                cid = _mistral_id(m.tool_call_id) if m.tool_call_id else (unanswered[0] if unanswered else _mistral_id(str(i)))
                if cid in unanswered:
                    unanswered.remove(cid)
                out.append(replace(m, tool_call_id=cid))
            else:
                out.append(m)
        return out

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        items = _any([_call_schema(t, extra=self._ID) for t in tools])
        return f"calls: {_sp('[TOOL_CALLS]')} body\n" + schema_lark(_array(items, parallel), "body")


def _mistral_id(raw: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9]{9}", raw):
        return raw
    return hashlib.sha256(raw.encode()).hexdigest()[:9]


class Granite(ToolFormat):
    """Granite 3.x: <|tool_call|>[{"name", "arguments"}, ...]. The template does not show past
    calls, so prepare writes them into the assistant turn as the model would have."""

    name = "granite"
    trigger = "<|tool_call|>"
    openers = (_Opener("<|tool_call|>", (("ws", ""), ("json", "calls"))),)

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        return [replace(m, content=m.content + "<|tool_call|>" + json.dumps(_plain_calls(m), ensure_ascii=False),
                        tool_calls=()) if m.tool_calls else m for m in messages]

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        items = _any([_call_schema(t) for t in tools])
        return f"calls: {_sp('<|tool_call|>')} body\n" + schema_lark(_array(items, parallel), "body")


_DS = {k: f"<｜{k.replace('_', '▁')}｜>" for k in (
    "tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end", "tool_sep")}


class DeepSeekR1(ToolFormat):
    """DeepSeek-R1 distills: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json ... ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>. The template takes no tools, so
    prepare describes them (and this syntax) in the system turn and writes past calls as text."""

    name = "deepseek_r1"
    native = False
    trigger = _DS["tool_calls_begin"]
    openers = (
        _Opener(_DS["tool_calls_begin"]), _Opener(_DS["tool_calls_end"]),
        _Opener(_DS["tool_call_begin"], (("lit", "function"), ("lit", _DS["tool_sep"]), ("name", "\n"),
                                         ("lit", "```json"), ("ws", ""), ("json", "args"), ("ws", ""),
                                         ("lit", "```"), ("ws", ""), ("opt", _DS["tool_call_end"]))),
    )

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        out = [replace(m, content=m.content + _ds_calls(_plain_calls(m)), tool_calls=()) if m.tool_calls else m
               for m in messages]
        if choice == "none" or not tools:
            return out
        example = _ds_calls([{"name": "TOOL_NAME", "arguments": "ARGUMENTS_AS_JSON"}], raw=True)
        text = (f"You can call these tools (JSON schemas of their arguments):\n{_tool_list(tools)}\n\n"
                f"To call tools, reply with:\n{example}\n(one {_DS['tool_call_begin']}...{_DS['tool_call_end']} "
                f"per call, on separate lines)\n{_must(choice)}")
        return _with_system(out, text.rstrip("\n"), True)

    def _prefix(self) -> tuple[str, str]:
        # The prompt ends inside <think>: the reply may finish that thought first.
        return "(thought WS?)? ", _thought(_DS["tool_calls_begin"])

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        many = ' ("\\n" call)*' if parallel else ""
        rules = [f"calls: {_sp(_DS['tool_calls_begin'])} call{many} {_sp(_DS['tool_calls_end'])}\n",
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools))) + "\n"]
        for i, t in enumerate(tools):
            head = _lit(t["function"]["name"] + "\n```json\n")
            rules.append(f'fn_{i}: {_sp(_DS["tool_call_begin"])} "function" {_sp(_DS["tool_sep"])} {head} '
                         f'args_{i} "\\n```" {_sp(_DS["tool_call_end"])}\n')
            rules.append(schema_lark(_params(t), f"args_{i}"))
        return "".join(rules)


def _ds_calls(calls: list[dict[str, Any]], raw: bool = False) -> str:
    parts = [f"{_DS['tool_call_begin']}function{_DS['tool_sep']}{c['name']}\n```json\n"
             f"{c['arguments'] if raw else json.dumps(c['arguments'], ensure_ascii=False)}\n```{_DS['tool_call_end']}"
             for c in calls]
    return _DS["tool_calls_begin"] + "\n".join(parts) + _DS["tool_calls_end"]


class Generic(ToolFormat):
    """No tool syntax in the template (or no template): tools described in the system turn, and
    the reply is one JSON object, {"tool_calls": [{"name", "arguments"}]} or {"response": "..."}
    (llama.cpp's generic format), forced by a grammar from the start."""

    name = "generic"
    native = False
    json_at_start = True

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        out = _generic_history(messages, _renders(self.template, "tool"))
        if choice == "none" or not tools:
            return out
        answer = ('{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]} to call one or more tools'
                  if choice == "auto" else '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}')
        text = (f"You can call these tools (JSON schemas of their arguments):\n{_tool_list(tools)}\n\n"
                f"{_must(choice)}Reply with one JSON object and nothing else: {answer}"
                + (', or {"response": "<your answer>"} to answer directly.' if choice == "auto" else "."))
        return _with_system(out, text, _renders(self.template, "system"))

    def grammar(self, tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True) -> str | None:
        if choice == "none":
            return None
        calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                 "properties": {"tool_calls": _array(_any([_call_schema(t) for t in _chosen(tools, choice)]), parallel)}}
        response = {"type": "object", "additionalProperties": False, "required": ["response"],
                    "properties": {"response": {"type": "string"}}}
        return "start: body\n" + schema_lark({"anyOf": [calls, response]} if choice == "auto" else calls, "body")

    def lazy_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        grammar = self.grammar(tools, "auto", parallel)
        assert grammar is not None
        return grammar


def _generic_history(messages: Sequence[Message], tool_role: bool) -> list[Message]:
    """Calls and results as the JSON text a template without tool support can show."""
    out: list[Message] = []
    names: dict[str, str] = {}
    joined = False  # out[-1] is a user turn holding tool results: a user turn after it joins it
    for m in messages:
        result = m.role == "tool"
        if m.role == "assistant" and m.tool_calls:
            names.update({c["id"]: c["function"]["name"] for c in m.tool_calls if c.get("id")})
            obj: dict[str, Any] = {"tool_calls": _plain_calls(m)}
            if m.content.strip():
                obj["content"] = m.content
            m = Message("assistant", json.dumps(obj, ensure_ascii=False))
        elif result:
            name = m.name or names.get(m.tool_call_id or "")
            response = {"tool": name, "content": m.content} if name else {"content": m.content}
            m = Message("tool" if tool_role else "user", json.dumps({"tool_response": response}, ensure_ascii=False))
        if joined and m.role == "user":  # for templates that insist on alternating turns (Gemma)
            out[-1] = replace(out[-1], content=f"{out[-1].content}\n\n{m.content}")
        else:
            out.append(m)
        joined = m.role == "user" and (result or joined)
    return out


def _with_system(messages: list[Message], text: str, system_ok: bool) -> list[Message]:
    """Add text to the system turn (or make one; or, where a template has none, the first user turn)."""
    if messages and messages[0].role == "system":
        return [replace(messages[0], content=f"{messages[0].content}\n\n{text}"), *messages[1:]]
    if system_ok:
        return [Message("system", text), *messages]
    for i, m in enumerate(messages):
        if m.role == "user":
            return [*messages[:i], replace(m, content=f"{text}\n\n{m.content}"), *messages[i + 1:]]
    return [Message("user", text), *messages]


@lru_cache(maxsize=32)
def _renders(template: str | None, role: str) -> bool:
    """Whether a template shows a turn of this role (probed once: refusing it counts as no)."""
    if template is None:
        return role == "system"  # chat.render_plain: system text, everything else User/Assistant
    probe = "\u2063probe\u2063"
    msgs = ([Message("system", probe), Message("user", "u")] if role == "system"
            else [Message("user", "u"), Message("assistant", "a"), Message(role, probe, tool_call_id="x", name="f")])
    try:
        return probe in render_template(template, msgs, add_generation_prompt=True)
    except Exception:  # a template that raises on the role (Gemma) does not support it
        return False


@lru_cache(maxsize=32)
def detect_format(template: str | None) -> ToolFormat:
    """The tool-call family of a chat template: generic when it has no tool syntax (or is None)."""
    if template:
        for cls in (DeepSeekR1, Mistral, Granite, Hermes, Llama3):
            if cls.matches(template):
                return cls(template)
    return Generic(template)


# -- a request with tools --------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolPlan:
    """How one request uses its tools on one model: the prompt, the constraint, the parser."""

    format: ToolFormat
    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = False

    @classmethod
    def make(cls, template: str | None, raw_tools: Any, raw_choice: Any = None, parallel: bool = False) -> ToolPlan | None:
        """The plan for a request's tools on a model with this chat template; None without tools."""
        if not raw_tools:
            if raw_choice not in (None, "none", "auto"):
                raise UsageError("tool_choice needs tools", "send the tools, or drop tool_choice")
            return None
        tools = parse_tools(raw_tools)
        return cls(detect_format(template), tuple(tools), normalize_choice(raw_choice, tools), parallel)

    def request(self, messages: Sequence[Message]) -> Any:
        """The Request: messages prepared for the template, tools passed where it renders them."""
        from localrun.generation import Request

        prepared = self.format.prepare(list(messages), list(self.tools), self.choice)
        return Request(messages=tuple(prepared), tools=self.tools if self.format.native else ())

    def params(self, params: Any) -> Any:
        """The generation settings with the call grammar (lazy under "auto" on native formats)."""
        import dataclasses

        # A named function is one call of it; more calls only when asked for and the choice allows.
        c = self.format.constraint(list(self.tools), self.choice, self.parallel and self.choice in ("auto", "required"))
        if c is not None and params.grammar is not None:
            raise UsageError("a response format cannot be combined with tools",
                             "drop response_format/format, or set tool_choice to none")
        if c is None:
            return dataclasses.replace(params, special=True)
        return dataclasses.replace(params, grammar=c[0], grammar_trigger=c[1], special=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.choice == "none":
            return text, []
        return self.format.parse(text)

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """A result record (run --json, batch) with the reply's calls parsed out of its text."""
        content, calls = self.parse(record.get("text", ""))
        out = {**record, "text": content, "tool_calls": [c.to_openai() for c in calls]}
        if calls:
            out["finish_reason"] = "tool_calls"
        return out

    def streamer(self) -> ToolStreamer | None:
        """The incremental parser for a streamed reply; None when no call can come (choice none)."""
        return None if self.choice == "none" else self.format.streamer()
