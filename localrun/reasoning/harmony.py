"""gpt-oss (OpenAI's harmony format): each message of a reply is a header and a body,
`<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY<|end|>`, the next one after
`<|start|>assistant`. `analysis` is thinking, `final` the answer, `commentary` with a recipient
(`to=functions.NAME`) a tool call, which goes whole (header, body, `<|call|>`) into `Split.calls`
for the tool parser; `commentary` without one is a preamble to the user (answer)."""

from __future__ import annotations

import re
from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import (
    EFFORTS,
    HasToken,
    ReasoningFormat,
    Split,
    Splitter,
    SteppingSplitter,
    Switch,
    held,
    no_token,
    register,
)

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)
HEADS = ("<|channel|>", START, " to=", "to=")


@register(0)
class Harmony(ReasoningFormat):
    """Channels instead of markers: reasoning effort low|medium|high, no way to switch it off."""

    name: ClassVar[str] = "harmony"
    opening: ClassVar[tuple[str, ...]] = ("<|channel|>analysis<|message|>",)
    closing: ClassVar[str] = "<|end|>"
    # after the analysis message the next one starts; the answer is the final channel's message
    closing_gap: ClassVar[str] = "<|start|>assistant"
    answer_head: ClassVar[str] = "<|channel|>final<|message|>"

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "<|channel|>" in template and "analysis" in template

    @property
    def history_field(self) -> str | None:
        return "thinking"

    def switch(self, think: bool | str | None) -> Switch:
        """An effort level sets reasoning_effort; on, off and None keep the template's default
        (medium): gpt-oss always reasons (`can_switch_off` is False)."""
        if isinstance(think, str) and think in EFFORTS:
            return Switch(MappingProxyType({"reasoning_effort": think}))
        return Switch()

    def splitter(self, start_inside: bool = False) -> Splitter:
        return HarmonySplitter(start_inside)


class HarmonySplitter(SteppingSplitter):
    """Streams a harmony reply: headers are held until `<|message|>`, bodies until a possible end
    marker is decided; text that starts with no header at all is plain answer. A subclass for a
    like format (muse-glimmer) says its own `ends`, `heads` and how a header names its `kind`."""

    ends: ClassVar[tuple[str, ...]] = ENDS
    heads: ClassVar[tuple[str, ...]] = HEADS

    def __init__(self, start_inside: bool = False) -> None:
        self._buf = ""
        self._state = "body" if start_inside else "header"
        self._kind = "thinking" if start_inside else ""
        self._head = ""
        self._opened = start_inside
        self._closed = False

    @property
    def in_thought(self) -> bool:
        return self._state == "body" and self._kind == "thinking"

    def flush(self) -> Split:
        """The end of the reply: a cut body is given out as its channel's text; a cut header is dropped."""
        buf, self._buf = self._buf, ""
        if self._state == "body":
            return self._emit(buf)
        if self._state == "plain":
            return Split(answer=buf)
        return Split()

    def _step(self) -> Split | None:
        if self._state == "header":
            return self._header()
        if self._state == "plain":
            text, self._buf = self._buf, ""
            return Split(answer=text) if text else None
        return self._body()

    def _header(self) -> Split | None:
        i = self._buf.find(MESSAGE)
        if i < 0:
            text = self._buf.lstrip()
            if text and not any(text.startswith(h) or h.startswith(text) for h in self.heads):
                self._state = "plain"  # no channels: the model answered in plain text
                self._buf = text
                return Split()
            return None
        head, self._buf = self._buf[:i], self._buf[i + len(MESSAGE):]
        head = re.sub(r"^\s*<\|start\|>assistant", "", head)  # the role, not part of a call
        self._head = head + MESSAGE
        self._kind = self._kind_of(head)
        self._opened = self._opened or self._kind == "thinking"
        self._state = "body"
        return Split(calls=self._head) if self._kind == "calls" else Split()

    def _kind_of(self, head: str) -> str:
        """What a message's body is, by its header: thinking, answer or calls."""
        channel = head.rsplit("<|channel|>", 1)[1] if "<|channel|>" in head else ""
        channel = channel.split(" ", 1)[0].split("<|", 1)[0]
        recipient = re.search(r"(?:^|\s)to=([^\s<]+)", head)
        # a message to the assistant itself is no call (llama.cpp's edge cases: the channel that
        # follows in the same header says what it is)
        if recipient and recipient.group(1) != "assistant":
            return "calls"
        return "thinking" if channel == "analysis" else "answer"

    def _body(self) -> Split | None:
        ends = [(j, e) for e in self.ends if (j := self._buf.find(e)) >= 0]
        if ends:
            j, end = min(ends)
            body = self._buf[:j]
            self._buf = self._buf[j + (0 if end == START else len(end)):]
            out = self._emit(body)
            if self._kind == "calls" and end != START:
                out += Split(calls=end)
            if self._kind == "thinking":
                self._closed = True
            self._state, self._kind = "header", ""
            return out
        keep = held(self._buf, self.ends)
        ready, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return self._emit(ready) if ready else None

    def _emit(self, text: str) -> Split:
        if self._kind == "thinking":
            return Split(thinking=text)
        if self._kind == "calls":
            return Split(calls=text)
        return Split(answer=text)
