"""ByteDance Seed-OSS: <seed:think>…</seed:think>, switched off with thinking_budget 0."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import ReasoningFormat, Switch, register


@register(10)
class SeedThink(ReasoningFormat):
    """<seed:think>thought</seed:think>answer; the template's own budget is `thinking_budget`."""

    name: ClassVar[str] = "seed"
    opening: ClassVar[tuple[str, ...]] = ("<seed:think>",)
    closing: ClassVar[str] = "</seed:think>"
    closing_gap: ClassVar[str] = "\n\n"
    switched_by: ClassVar[tuple[str, ...]] = ("thinking_budget",)

    def switch(self, think: bool | str | None) -> Switch:
        if think is False and self.can_switch_off:
            return Switch(MappingProxyType({"thinking_budget": 0}))
        return Switch()
