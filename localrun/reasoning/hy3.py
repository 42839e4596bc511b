"""Tencent Hy3 (HunYuan): `<think:opensource>…</think:opensource>`, switched by `reasoning_effort`
no_think (the template's default), low or high; thinking, the generation prompt opens the thought."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import HasToken, ReasoningFormat, Switch, no_token, register

# the efforts the template accepts besides no_think (it raises on any other)
EFFORTS = ("low", "high")


@register(60)
class Hy3(ReasoningFormat):
    """<think:opensource>thought</think:opensource>answer; the markers are built in the template
    from ':opensource', never spelled whole."""

    name: ClassVar[str] = "hy3"
    opening: ClassVar[tuple[str, ...]] = ("<think:opensource>",)
    closing: ClassVar[str] = "</think:opensource>"
    switched_by: ClassVar[tuple[str, ...]] = ("reasoning_effort",)

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "'<think{}>'.format(" in template or has_token(cls.opening[0])

    def switch(self, think: bool | str | None) -> Switch:
        """Off is no_think; low and high pass; on, and medium, which the template rejects, are high
        (the effort its own retry strategy thinks with)."""
        if think is None:
            return Switch()
        if think is False:
            effort = "no_think"
        elif isinstance(think, str) and think in EFFORTS:
            effort = think
        else:
            effort = "high"
        return Switch(MappingProxyType({"reasoning_effort": effort}))
