"""DeepSeek-R1 distills: calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each a
name and a fenced JSON block; the template takes no tools, so the prompt describes them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from localrun.chat import Message
from localrun.constraint import literal, schema_lark
from localrun.tools.base import (
    ToolFormat,
    calls_as_text,
    describe_tools,
    must,
    params_schema,
    register,
    with_system,
)
from localrun.tools.lark import special, thought
from localrun.tools.stream import Opener

_DS = {k: f"<｜{k.replace('_', '▁')}｜>" for k in (
    "tool_calls_begin", "tool_calls_end", "tool_call_begin", "tool_call_end", "tool_sep")}


@register(10)
class DeepSeekR1(ToolFormat):
    """DeepSeek-R1 distills: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json ... ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>. The template takes no tools, so
    prepare describes them (and this syntax) in the system turn and writes past calls as text."""

    name = "deepseek_r1"
    native = False
    trigger = _DS["tool_calls_begin"]
    openers = (
        Opener(_DS["tool_calls_begin"]), Opener(_DS["tool_calls_end"]),
        Opener(_DS["tool_call_begin"], (("lit", "function"), ("lit", _DS["tool_sep"]), ("name", "\n"),
                                        ("lit", "```json"), ("ws", ""), ("json", "args"), ("ws", ""),
                                        ("lit", "```"), ("ws", ""), ("opt", _DS["tool_call_end"]))),
    )

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        out = calls_as_text(messages, _ds_calls)
        if choice == "none" or not tools:
            return out
        example = _ds_calls([{"name": "TOOL_NAME", "arguments": "ARGUMENTS_AS_JSON"}], raw=True)
        text = (f"{describe_tools(tools)}"
                f"To call tools, reply with:\n{example}\n(one {_DS['tool_call_begin']}...{_DS['tool_call_end']} "
                f"per call, on separate lines)\n{must(choice)}")
        return with_system(out, text.rstrip("\n"), True)

    def _prefix(self) -> tuple[str, str]:
        # The prompt ends inside <think>: the reply may finish that thought first.
        return "(thought THOUGHT_WS?)? ", thought(_DS["tool_calls_begin"])

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        many = ' ("\\n" call)*' if parallel else ""
        rules = [f"calls: {special(_DS['tool_calls_begin'])} call{many} {special(_DS['tool_calls_end'])}\n",
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools))) + "\n"]
        for i, t in enumerate(tools):
            head = literal(t["function"]["name"] + "\n```json\n")
            rules.append(f'fn_{i}: {special(_DS["tool_call_begin"])} "function" {special(_DS["tool_sep"])} {head} '
                         f'args_{i} "\\n```" {special(_DS["tool_call_end"])}\n')
            rules.append(schema_lark(params_schema(t), f"args_{i}"))
        return "".join(rules)


def _ds_calls(calls: list[dict[str, Any]], raw: bool = False) -> str:
    parts = [f"{_DS['tool_call_begin']}function{_DS['tool_sep']}{c['name']}\n```json\n"
             f"{c['arguments'] if raw else json.dumps(c['arguments'], ensure_ascii=False)}\n```{_DS['tool_call_end']}"
             for c in calls]
    return _DS["tool_calls_begin"] + "\n".join(parts) + _DS["tool_calls_end"]
