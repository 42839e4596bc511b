"""Llama 3.1+: one {"name", "parameters"} object per reply, optionally after <|python_tag|>."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from localrun.chat import Message
from localrun.constraint import schema_lark
from localrun.tools.base import ToolFormat, any_of, call_schema, register
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
        # The template refuses more than one call per turn: one turn per call.
        out: list[Message] = []
        for m in messages:
            if m.role == "assistant" and len(m.tool_calls) > 1:
                out.extend(replace(m, content=m.content if i == 0 else "", tool_calls=(c,))
                           for i, c in enumerate(m.tool_calls))
            else:
                out.append(m)
        return out

    def _prefix(self) -> tuple[str, str]:
        return f"{special('<|python_tag|>')}? ", ""

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        return schema_lark(any_of([call_schema(t, "parameters") for t in tools]), "calls")
