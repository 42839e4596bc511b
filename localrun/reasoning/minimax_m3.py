"""MiniMax-M3: `<mm:think>…</mm:think>`, switched by `thinking_mode` enabled|disabled|adaptive. In
adaptive mode (the template's default) the model decides: it opens a thought, or writes the
closing marker alone and answers; enabled, the generation prompt opens the thought; disabled, it
holds the closing marker."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import MarkerSplitter, ReasoningFormat, Splitter, Switch, register


@register(65)
class MiniMaxM3(ReasoningFormat):
    """<mm:think>thought</mm:think>answer, or </mm:think>answer when the model does not think."""

    name: ClassVar[str] = "minimax-m3"
    opening: ClassVar[tuple[str, ...]] = ("<mm:think>",)
    closing: ClassVar[str] = "</mm:think>"
    switched_by: ClassVar[tuple[str, ...]] = ("thinking_mode",)

    def switch(self, think: bool | str | None) -> Switch:
        """On (or an effort) is enabled, off disabled; None keeps the template's adaptive mode."""
        if think is None:
            return Switch()
        return Switch(MappingProxyType({"thinking_mode": "disabled" if think is False else "enabled"}))

    def splitter(self, start_inside: bool = False) -> Splitter:
        return MarkerSplitter(self.opening, self.closing, start_inside=start_inside, bare_closing=True)
