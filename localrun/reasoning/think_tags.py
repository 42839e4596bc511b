"""<think>…</think>: Qwen3, Qwen3.5, QwQ, DeepSeek-R1 and its distills, DeepSeek-V3.1/V3.2/V4,
SmolLM3, GLM-4.6/4.7, Kimi-K2-Thinking, MiniMax-M2, Nemotron, Ling, MiniCPM5, Laguna and others."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import (
    HasToken,
    ReasoningFormat,
    Switch,
    no_token,
    register,
    thinking_switch,
)


@register(90)
class ThinkTags(ReasoningFormat):
    """The thought between <think> and </think>; some templates open <think> in the prompt."""

    name: ClassVar[str] = "think"
    opening: ClassVar[tuple[str, ...]] = ("<think>",)
    switched_by: ClassVar[tuple[str, ...]] = ("enable_thinking", "thinking")
    closing: ClassVar[str] = "</think>"
    closing_gap: ClassVar[str] = "\n\n"

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        # "</think>" alone is a template that only strips thoughts out of history
        return cls.closing in template and super().matches(template, has_token)

    def switch(self, think: bool | str | None) -> Switch:
        out = thinking_switch(self.template, think)
        if think is not None and "/no_think" in self.template:
            # SmolLM3 and Nemotron-Nano-v2 also read the mode from the system prompt
            return Switch(out.variables, "/think" if think is not False else "/no_think")
        return out
