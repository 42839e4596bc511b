"""IBM Granite 3.3: with `thinking` on, the thought in <think></think> and the answer in
<response></response>."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import HasToken, ReasoningFormat, no_token, register


@register(20)
class Granite(ReasoningFormat):
    """<think>thought</think><response>answer</response>; the wrappers are not answer text."""

    name: ClassVar[str] = "granite"
    opening: ClassVar[tuple[str, ...]] = ("<think>",)
    switched_by: ClassVar[tuple[str, ...]] = ("thinking",)
    closing: ClassVar[str] = "</think>"
    answer_markers: ClassVar[tuple[str, ...]] = ("<response>", "</response>")
    answer_head: ClassVar[str] = "<response>"

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "<think></think>" in template and "<response></response>" in template
