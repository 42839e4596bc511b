"""ServiceNow Apriel 1.5 and 1.6 Thinker: "Here are my reasoning steps:", the thought in plain text,
then the answer after `[BEGIN FINAL RESPONSE]` (Apriel 1.5 also ends it with `[END FINAL RESPONSE]`,
as its system prompt asks). Apriel 1.6's generation prompt writes the opening, so its reply starts
inside the thought; Apriel 1.5's opens nothing, so its thought is split when the reply starts with
the same opening, and any other reply is all answer, as in llama.cpp (which splits no thought for
Apriel 1.5). Neither template has a switch: the model always reasons."""

from __future__ import annotations

from typing import ClassVar

from localrun.reasoning.base import (
    HasToken,
    MarkerSplitter,
    ReasoningFormat,
    Splitter,
    no_token,
    register,
)

BEGIN, END = "[BEGIN FINAL RESPONSE]", "[END FINAL RESPONSE]"


@register(50)
class Apriel(ReasoningFormat):
    """Here are my reasoning steps: thought [BEGIN FINAL RESPONSE] answer [END FINAL RESPONSE]."""

    name: ClassVar[str] = "apriel"
    opening: ClassVar[tuple[str, ...]] = ("Here are my reasoning steps:",)
    closing: ClassVar[str] = BEGIN
    closing_gap: ClassVar[str] = "\n"

    @classmethod
    def matches(cls, template: str, has_token: HasToken = no_token) -> bool:
        return BEGIN in template

    def splitter(self, start_inside: bool = False) -> Splitter:
        # Apriel 1.6 is not asked for the end marker, and llama.cpp keeps it in the answer
        markers = (END,) if END in self.template else ()
        return MarkerSplitter(self.opening, self.closing, markers, start_inside)
