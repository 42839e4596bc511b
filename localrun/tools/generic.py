"""No tool syntax in the template (or no template): llama.cpp's generic format, one JSON object
forced from the start. It recognizes every template, so it is tried last."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from localrun.chat import Message, render_template
from localrun.constraint import schema_lark
from localrun.tools.base import (
    ToolFormat,
    any_of,
    array_of,
    call_schema,
    chosen,
    describe_tools,
    must,
    plain_calls,
    register,
    with_system,
)

_CALL = '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}'


@register(1000)
class Generic(ToolFormat):
    """No tool syntax in the template (or no template): tools described in the system turn, and
    the reply is one JSON object, {"tool_calls": [{"name", "arguments"}]} or {"response": "..."}
    (llama.cpp's generic format), forced by a grammar from the start."""

    name = "generic"
    native = False
    json_at_start = True

    @classmethod
    def matches(cls, template: str) -> bool:
        return True

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        out = _generic_history(messages, _renders(self.template, "tool"))
        if choice == "none" or not tools:
            return out
        answer = f"{_CALL} to call one or more tools" if choice == "auto" else _CALL
        text = (f"{describe_tools(tools)}"
                f"{must(choice)}Reply with one JSON object and nothing else: {answer}"
                + (', or {"response": "<your answer>"} to answer directly.' if choice == "auto" else "."))
        return with_system(out, text, _renders(self.template, "system"))

    def grammar(self, tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True) -> str | None:
        if choice == "none":
            return None
        calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                 "properties": {"tool_calls": array_of(any_of([call_schema(t) for t in chosen(tools, choice)]), parallel)}}
        response = {"type": "object", "additionalProperties": False, "required": ["response"],
                    "properties": {"response": {"type": "string"}}}
        return "start: body\n" + schema_lark({"anyOf": [calls, response]} if choice == "auto" else calls, "body")

    def lazy_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        grammar = self.grammar(tools, "auto", parallel)
        assert grammar is not None
        return grammar


def _generic_history(messages: Sequence[Message], tool_role: bool) -> list[Message]:
    """Calls and results as the JSON text a template without tool support can show."""
    out: list[Message] = []
    names: dict[str, str] = {}
    joined = False  # out[-1] is a user turn holding tool results: a user turn after it joins it
    for m in messages:
        result = m.role == "tool"
        if m.role == "assistant" and m.tool_calls:
            names.update({c["id"]: c["function"]["name"] for c in m.tool_calls if c.get("id")})
            obj: dict[str, Any] = {"tool_calls": plain_calls(m)}
            if m.content.strip():
                obj["content"] = m.content
            m = replace(m, content=json.dumps(obj, ensure_ascii=False), tool_calls=())  # its thought stays
        elif result:
            name = m.name or names.get(m.tool_call_id or "")
            response = {"tool": name, "content": m.content} if name else {"content": m.content}
            m = Message("tool" if tool_role else "user", json.dumps({"tool_response": response}, ensure_ascii=False))
        if joined and m.role == "user":  # for templates that insist on alternating turns (Gemma)
            out[-1] = replace(out[-1], content=f"{out[-1].content}\n\n{m.content}")
        else:
            out.append(m)
        joined = m.role == "user" and (result or joined)
    return out



@lru_cache(maxsize=32)
def _renders(template: str | None, role: str) -> bool:
    """Whether a template shows a turn of this role (probed once: refusing it counts as no)."""
    if template is None:
        return role == "system"  # chat.render_plain: system text, everything else User/Assistant
    probe = "\u2063probe\u2063"
    msgs = ([Message("system", probe), Message("user", "u")] if role == "system"
            else [Message("user", "u"), Message("assistant", "a"), Message(role, probe, tool_call_id="x", name="f")])
    try:
        return probe in render_template(template, msgs, add_generation_prompt=True)
    except Exception:  # a template that raises on the role (Gemma) does not support it
        return False

