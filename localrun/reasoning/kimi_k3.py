"""Moonshot Kimi K3: sections written as tags, `<|open|>TAG<|sep|>…<|close|>TAG<|sep|>`. A reply
is a `think` section, a `response` section, an optional `tools` section, then the message closer.
The generation prompt opens `think` (or, with `thinking` off, `response`), so the reply starts
inside it; as llama.cpp's parser does, the thought also ends where the model opens its response
without closing the thought."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import (
    HasToken,
    MarkerSplitter,
    ReasoningFormat,
    Splitter,
    Switch,
    no_token,
    register,
)

RESPONSE, RESPONSE_END = "<|open|>response<|sep|>", "<|close|>response<|sep|>"
MESSAGE_END, END_OF_MSG = "<|close|>message<|sep|>", "<|end_of_msg|>"
# the efforts the template accepts (it names "medium" in its prompt but raises on it)
EFFORTS = ("low", "high", "max")


@register(35)
class KimiK3(ReasoningFormat):
    """<|open|>think<|sep|>thought<|close|>think<|sep|><|open|>response<|sep|>answer…; switched
    by `thinking` (on by default), with `thinking_effort` low|high|max (max by default)."""

    name: ClassVar[str] = "kimi-k3"
    opening: ClassVar[tuple[str, ...]] = ("<|open|>think<|sep|>",)
    closing: ClassVar[str] = "<|close|>think<|sep|>"
    answer_head: ClassVar[str] = RESPONSE
    answer_markers: ClassVar[tuple[str, ...]] = (RESPONSE, RESPONSE_END, MESSAGE_END, END_OF_MSG)
    switched_by: ClassVar[tuple[str, ...]] = ("thinking",)

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        # the markers are built by the template's open_tag/close_tag macros, never spelled whole
        return all(m in template for m in ("<|open|>", "<|close|>", END_OF_MSG, "open_tag('think'"))

    def switch(self, think: bool | str | None) -> Switch:
        """on/off set `thinking`; low and high also set `thinking_effort` (medium, which the
        template rejects, keeps its default, max)."""
        if think is None:
            return Switch()
        names: dict[str, object] = {"thinking": think is not False}
        if isinstance(think, str) and think in EFFORTS:
            names["thinking_effort"] = think
        return Switch(MappingProxyType(names))

    def splitter(self, start_inside: bool = False) -> Splitter:
        return MarkerSplitter(self.opening, self.closing, self.answer_markers, start_inside, ends=(RESPONSE,))
