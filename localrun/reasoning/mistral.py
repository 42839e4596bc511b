"""Mistral's reasoning models (Magistral, Ministral 3 Reasoning): [THINK]thought[/THINK]answer."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import HasToken, ReasoningFormat, no_token, register


@register(30)
class MistralThink(ReasoningFormat):
    """[THINK]…[/THINK]; the template has no switch (the system prompt asks for the thought)."""

    name: ClassVar[str] = "mistral"
    opening: ClassVar[tuple[str, ...]] = ("[THINK]",)
    closing: ClassVar[str] = "[/THINK]"

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "[THINK]" in template or has_token("[THINK]")

    @property
    def closing_text(self) -> str:
        return self.closing

    @property
    def history_field(self) -> str | None:
        return None  # thoughts live in content blocks of type "thinking", which callers do not build
