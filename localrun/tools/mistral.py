"""Mistral Nemo: [TOOL_CALLS] and a JSON array of calls, each with a 9-character id."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from localrun.chat import Message
from localrun.tools.base import ToolFormat, array_opener, call_array, register


@register(20)
class Mistral(ToolFormat):
    """Mistral Nemo: [TOOL_CALLS][{"name", "arguments", "id"}, ...] with 9-character ids."""

    name = "mistral"
    trigger = "[TOOL_CALLS]"
    openers = (array_opener("[TOOL_CALLS]"),)
    id_length = 9
    _ID = {"id": {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}}

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        # The template requires 9-character alphanumeric ids: others are mapped to one, stably.
        out: list[Message] = []
        unanswered: list[str] = []
        for i, m in enumerate(messages):
            if m.role == "assistant" and m.tool_calls:
                calls = tuple({**c, "id": _mistral_id(c.get("id") or f"{i}.{j}")} for j, c in enumerate(m.tool_calls))
                unanswered.extend(c["id"] for c in calls)
                out.append(replace(m, tool_calls=calls))
            elif m.role == "tool":
                cid = _mistral_id(m.tool_call_id) if m.tool_call_id else (unanswered[0] if unanswered else _mistral_id(str(i)))
                if cid in unanswered:
                    unanswered.remove(cid)
                out.append(replace(m, tool_call_id=cid))
            else:
                out.append(m)
        return out

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        return call_array("[TOOL_CALLS]", tools, parallel, extra=self._ID)


def _mistral_id(raw: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9]{9}", raw):
        return raw
    return hashlib.sha256(raw.encode()).hexdigest()[:9]
