"""Granite 3.x: <|tool_call|> and a JSON array of calls."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from localrun.chat import Message
from localrun.tools.base import ToolFormat, array_opener, call_array, calls_as_text, register


@register(30)
class Granite(ToolFormat):
    """Granite 3.x: <|tool_call|>[{"name", "arguments"}, ...]. The template does not show past
    calls, so prepare writes them into the assistant turn as the model would have."""

    name = "granite"
    trigger = "<|tool_call|>"
    openers = (array_opener("<|tool_call|>"),)

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        return calls_as_text(messages, lambda calls: "<|tool_call|>" + json.dumps(calls, ensure_ascii=False))

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        return call_array("<|tool_call|>", tools, parallel)
