"""What every reasoning format shares: the `ReasoningFormat` class with its defaults, the values a
caller gets (`Split`, `Switch`), the streaming `MarkerSplitter` that marker-delimited formats use,
and the registry that picks a format for a model.

A format is one module in this package with a `ReasoningFormat` subclass decorated with
`@register(order)`; `detect` tries them by order. A format is chosen from the chat template and
the vocabulary, never from the model's name.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from localrun.families import Families

HasToken = Callable[[str], bool]


def no_token(text: str) -> bool:
    """A vocabulary that has no special tokens (detection from the template alone)."""
    return False


@dataclass(frozen=True)
class Split:
    """Text of a reply sorted into its parts: the thought, the answer, and (harmony) raw tool calls."""

    thinking: str = ""
    answer: str = ""
    calls: str = ""

    def __add__(self, other: Split) -> Split:
        return Split(self.thinking + other.thinking, self.answer + other.answer, self.calls + other.calls)

    def __bool__(self) -> bool:
        return bool(self.thinking or self.answer or self.calls)


@dataclass(frozen=True)
class Switch:
    """How to turn thinking on or off for one request: template variables and, where a template
    reads it from the system prompt, a flag to add there (SmolLM3's `/think`, `/no_think`)."""

    variables: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    system_flag: str | None = None


EFFORTS = ("low", "medium", "high")


class Splitter(Protocol):
    """An incremental reader of one streamed reply."""

    def feed(self, text: str) -> Split: ...
    def flush(self) -> Split: ...
    @property
    def in_thought(self) -> bool: ...
    @property
    def opened(self) -> bool: ...
    @property
    def closed(self) -> bool: ...


class ReasoningFormat:
    """A model family's way of writing its thought apart from its answer.

    Marker formats set `opening` / `closing` (and `answer_markers`, wrappers removed from the
    answer); harmony overrides `splitter`. A format is recognised by its opening marker unless it
    overrides `matches`. `history_field` names the message field the template reads earlier turns'
    thoughts from (None: drop them from earlier assistant turns).
    """

    name: ClassVar[str] = ""
    opening: ClassVar[tuple[str, ...]] = ()
    closing: ClassVar[str] = ""
    answer_markers: ClassVar[tuple[str, ...]] = ()
    # the template variables that turn thinking off, in the order they are looked for
    switched_by: ClassVar[tuple[str, ...]] = ()
    # what the model writes right after the closing marker, such as "\n\n" (harmony: the next
    # message's start), and then before its answer (Granite's <response>, harmony's final header);
    # a grammar on the answer holds after both
    closing_gap: ClassVar[str] = ""
    answer_head: ClassVar[str] = ""

    def __init__(self, template: str = "") -> None:
        self.template = template

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        """Whether a model with this chat template and vocabulary writes its thought this way: by
        default, the template has the opening marker or the vocabulary has it as one token."""
        return any(o in template or has_token(o) for o in cls.opening)

    @property
    def closing_text(self) -> str:
        """What to insert to end a thought (a thinking budget), so the model then answers."""
        return self.closing + self.closing_gap + self.answer_head

    @property
    def history_field(self) -> str | None:
        """The message field earlier turns' thoughts go in, or None to drop them."""
        return "reasoning_content" if "reasoning_content" in self.template else None

    @property
    def can_switch_off(self) -> bool:
        """Whether the template honours thinking off."""
        return any(reads(self.template, v) for v in self.switched_by)

    def starts_inside(self, prompt: str) -> bool:
        """Whether the rendered prompt already opened the thought (the reply starts inside it)."""
        return any(prompt.rstrip().endswith(o) for o in self.opening)

    def switch(self, think: bool | str | None) -> Switch:
        """The template variables (and system flag) for thinking on, off, or an effort level."""
        return thinking_switch(self.template, think) if self.switched_by else Switch()

    def splitter(self, start_inside: bool = False) -> Splitter:
        """An incremental splitter for one reply (start_inside: the prompt opened the thought)."""
        return MarkerSplitter(self.opening, self.closing, self.answer_markers, start_inside)

    def raw_splitter(self) -> Splitter:
        """A raw completion's splitter: only a reply that opens a thought itself is split."""
        return RawSplitter(self.opening, self.splitter())

    def split(self, text: str, start_inside: bool = False) -> Split:
        """A whole reply split at once."""
        s = self.splitter(start_inside)
        return s.feed(text) + s.flush()


def reads(template: str, variable: str) -> bool:
    """Whether a template reads a variable (as a name, not inside a string or another name)."""
    return re.search(rf"(?<![\w.'\"]){re.escape(variable)}(?![\w'\"])", template) is not None


def held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at text's end could begin one of the markers (to hold back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class SteppingSplitter:
    """What every splitter shares: a buffer fed in pieces and decided by `_step` (None: wait for
    more text), and whether a thought was opened and closed."""

    _buf: str
    _opened: bool
    _closed: bool

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def closed(self) -> bool:
        return self._closed

    def feed(self, text: str) -> Split:
        """The new thinking and answer text that this piece decides."""
        self._buf += text
        out = Split()
        while True:
            step = self._step()
            if step is None:
                return out
            out += step

    def _step(self) -> Split | None:
        raise NotImplementedError


class MarkerSplitter(SteppingSplitter):
    """Streams a reply of the form [ws] OPEN thought CLOSE [ws] answer.

    As llama.cpp's parsers do: a thought is recognised only at the start of the reply, whitespace
    around it and right after the closing marker is trimmed, and a reply that starts with anything
    else is all answer. A marker cut across feeds is held back until it is decided. `ends` are
    more markers that end a thought (Kimi K3's answer opener, when the model skips the closer);
    with `bare_closing` a reply may start with the closing marker alone, an empty thought
    (MiniMax-M3 writes one when it decides not to think).
    """

    def __init__(self, opening: tuple[str, ...], closing: str, answer_markers: tuple[str, ...] = (),
                 start_inside: bool = False, ends: tuple[str, ...] = (), bare_closing: bool = False) -> None:
        self._opening, self._closing, self._answer_markers = opening, closing, answer_markers
        self._ends = (closing, *ends)
        self._bare_closing = bare_closing
        self._phase = "thought" if start_inside else "before"
        self._buf = ""
        self._lead = True  # trim whitespace at the start of the current part
        self._reopen = start_inside  # an opening marker the model repeats is swallowed once
        self._opened = start_inside
        self._closed = False

    @property
    def in_thought(self) -> bool:
        return self._phase == "thought"

    def flush(self) -> Split:
        """The end of the reply: everything held is given out (a cut thought stays thinking)."""
        buf, self._buf = self._buf, ""
        if self._phase == "thought":
            return Split(thinking=buf.rstrip() if not self._lead else buf.strip())
        if self._phase == "answer" and self._answer_markers:
            buf = self._drop_markers(buf)
        return Split(answer=buf.lstrip() if self._lead else buf)

    def _step(self) -> Split | None:
        if self._lead:
            stripped = self._buf.lstrip()
            if not stripped:
                return None
            if self._phase != "before":
                self._buf, self._lead = stripped, False
        if self._phase == "before":
            return self._before()
        if self._phase == "thought":
            return self._thought()
        return self._answer()

    def _before(self) -> Split | None:
        text = self._buf.lstrip()
        for o in self._opening:
            if text.startswith(o):
                self._buf, self._phase, self._opened, self._lead = text[len(o):], "thought", True, True
                return Split()
            if o.startswith(text):
                return None
        if self._bare_closing:
            if text.startswith(self._closing):
                self._buf, self._phase, self._lead = text[len(self._closing):], "answer", True
                self._opened = self._closed = True
                return Split()
            if self._closing.startswith(text):
                return None
        self._phase, self._lead = "answer", True
        return Split()

    def _thought(self) -> Split | None:
        if self._reopen:
            for o in self._opening:
                if self._buf.startswith(o):
                    self._buf, self._reopen, self._lead = self._buf[len(o):], False, True
                    return Split()
                if o.startswith(self._buf):
                    return None
            self._reopen = False
        found = [(i, e) for e in self._ends if (i := self._buf.find(e)) >= 0]
        if found:
            i, end = min(found)
            thought, self._buf = self._buf[:i].rstrip(), self._buf[i + len(end):]
            self._phase, self._closed, self._lead = "answer", True, True
            return Split(thinking=thought)
        keep = held(self._buf, self._ends)
        body = self._buf[: len(self._buf) - keep]
        ready = body.rstrip()  # trailing whitespace waits: it is trimmed if the closing follows
        if not ready:
            return None
        self._buf = self._buf[len(ready):]
        return Split(thinking=ready)

    def _answer(self) -> Split | None:
        if not self._buf:
            return None
        if not self._answer_markers:
            text, self._buf = self._buf, ""
            return Split(answer=text)
        text = self._drop_markers(self._buf)
        keep = held(text, self._answer_markers)
        self._buf = text[len(text) - keep:] if keep else ""
        ready = text[: len(text) - keep]
        return Split(answer=ready) if ready else None

    def _drop_markers(self, text: str) -> str:
        for m in self._answer_markers:
            text = text.replace(m, "")
        return text


FORMATS: Families[ReasoningFormat] = Families("localrun.reasoning")
register = FORMATS.register


def thinking_switch(template: str, think: bool | str | None) -> Switch:
    """The variables a template reads to turn thinking on or off (enable_thinking, thinking,
    reasoning_effort), as its authors named them."""
    if think is None:
        return Switch()
    on = think is not False
    names: dict[str, Any] = {}
    if reads(template, "enable_thinking"):
        names["enable_thinking"] = on
    elif reads(template, "thinking"):
        names["thinking"] = on
    if isinstance(think, str) and reads(template, "reasoning_effort"):
        names["reasoning_effort"] = think
    return Switch(MappingProxyType(names))


class RawSplitter:
    """A raw completion's splitter: the reply goes through the format's splitter only when it
    starts with the format's opening marker; any other reply passes through untouched (leading
    whitespace included, which the chat splitters trim)."""

    def __init__(self, opening: tuple[str, ...], inner: Splitter) -> None:
        # the reply is matched with its leading whitespace trimmed, so the opening is too (glimmer's
        # starts with a space)
        self.opening, self.inner = tuple(o.lstrip() for o in opening), inner
        self.buf = ""
        self.mode = "undecided"  # then "split" or "plain"

    @property
    def in_thought(self) -> bool:
        return self.mode == "split" and self.inner.in_thought

    @property
    def opened(self) -> bool:
        return self.mode == "split" and self.inner.opened

    @property
    def closed(self) -> bool:
        return self.mode == "split" and self.inner.closed

    def feed(self, text: str) -> Split:
        if self.mode == "split":
            return self.inner.feed(text)
        if self.mode == "plain":
            return Split(answer=text)
        self.buf += text
        head = self.buf.lstrip()
        if not head or any(o.startswith(head) for o in self.opening):
            return Split()  # still undecided
        buf, self.buf = self.buf, ""
        if any(head.startswith(o) for o in self.opening):
            self.mode = "split"
            return self.inner.feed(buf)
        self.mode = "plain"
        return Split(answer=buf)

    def flush(self) -> Split:
        if self.mode == "split":
            return self.inner.flush()
        buf, self.buf = self.buf, ""
        return Split(answer=buf) if buf else Split()
