"""IBM Granite 3.3: with `thinking` on, the thought in <think></think> and the answer in
<response></response>."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import (
    HasToken,
    ReasoningFormat,
    Switch,
    no_token,
    reads,
    register,
    thinking_switch,
)


@register(20)
class Granite(ReasoningFormat):
    """<think>thought</think><response>answer</response>; the wrappers are not answer text."""

    name: ClassVar[str] = "granite"
    opening: ClassVar[tuple[str, ...]] = ("<think>",)
    closing: ClassVar[str] = "</think>"
    answer_markers: ClassVar[tuple[str, ...]] = ("<response>", "</response>")

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "<think></think>" in template and "<response></response>" in template

    @property
    def closing_text(self) -> str:
        return "</think><response>"

    @property
    def can_switch_off(self) -> bool:
        return reads(self.template, "thinking")

    def switch(self, think: bool | str | None) -> Switch:
        return thinking_switch(self.template, think)
