"""Cohere Command R7B and Command A reasoning: <|START_THINKING|>…<|END_THINKING|>."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import HasToken, ReasoningFormat, no_token, register


@register(40)
class CommandR(ReasoningFormat):
    """<|START_THINKING|>thought<|END_THINKING|>, then <|START_RESPONSE|>answer<|END_RESPONSE|>."""

    name: ClassVar[str] = "command-r"
    opening: ClassVar[tuple[str, ...]] = ("<|START_THINKING|>",)
    switched_by: ClassVar[tuple[str, ...]] = ("enable_thinking", "thinking")
    closing: ClassVar[str] = "<|END_THINKING|>"
    answer_markers: ClassVar[tuple[str, ...]] = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return cls.opening[0] in template  # the template alone, not the vocabulary
