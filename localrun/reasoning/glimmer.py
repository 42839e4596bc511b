"""Muse Glimmer (ATEM): like harmony, a reply is messages `<|start|>assistant to=RECIPIENT<|message|>
BODY` ended by `<|eom|>` (more follow) or `<|eot|>` (end of turn); the generation prompt is
`<|start|>assistant`, so the reply starts at its first recipient. `to=self` is thinking, `to=user`
(or no recipient) the answer, any other recipient a tool call, which goes whole into `Split.calls`
(its `<atem:function_calls>` body is for the tool parser). Reasoning strength is
`reasoning_strength` (high by default); there is no way to switch it off."""

from __future__ import annotations

from types import MappingProxyType
from typing import ClassVar

from localrun.reasoning.base import (
    EFFORTS,
    HasToken,
    ReasoningFormat,
    Splitter,
    Switch,
    no_token,
    register,
)
from localrun.reasoning.harmony import MESSAGE, START, HarmonySplitter

EOM, EOT = "<|eom|>", "<|eot|>"


@register(5)
class Glimmer(ReasoningFormat):
    """Recipients instead of markers: to=self thinks, to=user answers."""

    name: ClassVar[str] = "glimmer"
    opening: ClassVar[tuple[str, ...]] = (" to=self" + MESSAGE,)
    closing: ClassVar[str] = EOM
    # after the thought the next message starts; the answer is the message to the user (a grammar
    # on the answer takes both as their special tokens and words, as harmony's)
    closing_gap: ClassVar[str] = START + "assistant"
    answer_head: ClassVar[str] = " to=user" + MESSAGE

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return "<atem:function_calls>" in template and "assistant to=self" + MESSAGE in template

    def switch(self, think: bool | str | None) -> Switch:
        """An effort level sets reasoning_strength; on, off and None keep the template's (high)."""
        if isinstance(think, str) and think in EFFORTS:
            return Switch(MappingProxyType({"reasoning_strength": think}))
        return Switch()

    def splitter(self, start_inside: bool = False) -> Splitter:
        return GlimmerSplitter(start_inside)


class GlimmerSplitter(HarmonySplitter):
    """A harmony splitter whose headers name a recipient instead of a channel."""

    ends: ClassVar[tuple[str, ...]] = (EOM, EOT, START)
    heads: ClassVar[tuple[str, ...]] = (START, " to=", "to=", MESSAGE)

    def _kind_of(self, head: str) -> str:
        recipient = head.split("to=", 1)[1].strip() if "to=" in head else ""
        if recipient == "self":
            return "thinking"
        return "answer" if recipient in ("", "user") else "calls"
