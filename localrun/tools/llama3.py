"""Llama 3.1+: one {"name", "parameters"} object per reply, optionally after <|python_tag|>."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from localrun.chat import Message
from localrun.constraint import schema_lark
from localrun.tools.base import ToolFormat, any_of, call_schema, one_call_per_turn, register
from localrun.tools.lark import special
from localrun.tools.stream import Opener


@register(50)
class Llama3(ToolFormat):
    """Llama 3.1+: one {"name", "parameters"} object per reply, optionally after <|python_tag|>.

    The trigger is the text '{"name"' (what the model writes first, the grammar's compact style
    fixes it), not <|python_tag|>, which the model often leaves out; a tag before it is dropped.
    """

    name = "llama3"
    trigger = '{"name"'
    openers = (Opener("<|python_tag|>"), Opener('{"name"', (("json", "call"),), keep=True))

    @classmethod
    def matches(cls, template: str) -> bool:
        return "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template)

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        return one_call_per_turn(messages)  # the template refuses more than one call per turn

    def _prefix(self) -> tuple[str, str]:
        return f"{special('<|python_tag|>')}? ", ""

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        return schema_lark(any_of([call_schema(t, "parameters") for t in tools]), "calls")
