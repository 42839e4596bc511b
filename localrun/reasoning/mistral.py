"""Mistral's reasoning models (Magistral, Ministral 3 Reasoning): [THINK]thought[/THINK]answer."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import ReasoningFormat, register


@register(30)
class MistralThink(ReasoningFormat):
    """[THINK]…[/THINK]; the template has no switch (the system prompt asks for the thought)."""

    name: ClassVar[str] = "mistral"
    opening: ClassVar[tuple[str, ...]] = ("[THINK]",)
    closing: ClassVar[str] = "[/THINK]"

    @property
    def history_field(self) -> str | None:
        return None  # thoughts live in content blocks of type "thinking", which callers do not build
