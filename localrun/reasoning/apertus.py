"""Swiss AI Apertus: the thought between `<|inner_prefix|>` and `<|inner_suffix|>`, switched by
`enable_thinking` ("Deliberation: enabled" in the developer turn)."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import ReasoningFormat, register


@register(45)
class Apertus(ReasoningFormat):
    """<|inner_prefix|>thought<|inner_suffix|>answer; off by default."""

    name: ClassVar[str] = "apertus"
    opening: ClassVar[tuple[str, ...]] = ("<|inner_prefix|>",)
    closing: ClassVar[str] = "<|inner_suffix|>"
    switched_by: ClassVar[tuple[str, ...]] = ("enable_thinking",)

    @property
    def history_field(self) -> str | None:
        return None  # thoughts live in content blocks of type "thoughts", which callers do not build
