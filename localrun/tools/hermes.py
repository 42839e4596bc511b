"""Qwen 2.5 / Qwen 3 and Hermes 2 Pro: each call in its own <tool_call> block."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from localrun.constraint import schema_lark
from localrun.tools.base import ToolFormat, any_of, call_schema, register
from localrun.tools.lark import special, thought
from localrun.tools.stream import Opener


@register(40)
class Hermes(ToolFormat):
    """Qwen 2.5 / Qwen 3 (and Hermes 2 Pro): <tool_call>\\n{"name", "arguments"}\\n</tool_call> per call."""

    name = "hermes"
    trigger = "<tool_call>"
    openers = (Opener("<tool_call>", (("ws", ""), ("json", "call"), ("ws", ""), ("opt", "</tool_call>"))),)

    def _prefix(self) -> tuple[str, str]:
        if not self.template or "<think>" not in self.template:
            return "", ""
        return "think? ", f"think: {special('<think>')} thought THOUGHT_WS?\n" + thought()

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        many = ' ("\\n" call)*' if parallel else ""
        return (f"calls: call{many}\n"
                f'call: {special("<tool_call>")} "\\n" body "\\n" {special("</tool_call>")}\n'
                + schema_lark(any_of([call_schema(t) for t in tools]), "body"))
