"""Upstage Solar Open: each part of a reply is a message after `<|begin|>assistant`, the thought
`<|think|>…<|end|>`, the answer `<|content|>…<|end|>` (tool calls `<|tool_calls|>…<|calls|>`).
`reasoning_effort` low or minimal turns the thought off: the prompt then holds an empty one."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import HasToken, ReasoningFormat, Switch, no_token, register

HEADER = "<|begin|>assistant"


@register(55)
class SolarOpen(ReasoningFormat):
    """<|think|>thought<|end|><|begin|>assistant<|content|>answer<|end|>; thinks by default (high)."""

    name: ClassVar[str] = "solar-open"
    opening: ClassVar[tuple[str, ...]] = ("<|think|>",)
    closing: ClassVar[str] = "<|end|>"
    answer_head: ClassVar[str] = HEADER + "<|content|>"
    answer_markers: ClassVar[tuple[str, ...]] = (HEADER, "<|content|>", "<|end|>")
    switched_by: ClassVar[tuple[str, ...]] = ("reasoning_effort",)

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return HEADER + "<|think|>" in template

    @property
    def history_field(self) -> str | None:
        return "reasoning"  # the template reads message.reasoning, not reasoning_content

    def switch(self, think: bool | str | None) -> Switch:
        """reasoning_effort as given (low turns the thought off, as the template has it); on is the
        template's default, high; off is minimal."""
        if think is None:
            return Switch()
        effort = think if isinstance(think, str) else "high" if think else "minimal"
        return Switch(MappingProxyType({"reasoning_effort": effort}))
