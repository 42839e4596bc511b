"""What every tool-call family shares: the `ToolFormat` protocol with its defaults, the pieces
their grammars and prompts are made of, and the registry that picks a family for a template.

A family is one module in this package with a `ToolFormat` subclass decorated with
`@register(order)`; `detect_format` tries them by order, and `generic` (which takes any template)
comes last.
"""

from __future__ import annotations

import json
import random
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache
from typing import Any

from localrun.chat import Message
from localrun.constraint import schema_lark
from localrun.errors import UsageError
from localrun.families import Families
from localrun.tools.lark import special
from localrun.tools.request import CHOICES
from localrun.tools.stream import Opener, ToolCall, ToolStreamer, assemble

_ALNUM = string.ascii_letters + string.digits


class ToolFormat:
    """A model family's tool-call syntax: the prompt side, the grammar, and the parser."""

    name = "generic"
    native = True  # the template renders `tools` itself: pass tools= to render_template
    trigger: str | None = None  # under "auto", the lazy grammar applies from this text on
    openers: tuple[Opener, ...] = ()
    json_at_start = False
    id_length = 0  # 0: "call_" + 24 characters

    def __init__(self, template: str | None = None) -> None:
        self.template = template

    @classmethod
    def matches(cls, template: str) -> bool:
        """Whether a chat template is of this family."""
        return cls.trigger is not None and cls.trigger in template

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        """The messages, ready for this family's template."""
        return list(messages)

    def grammar(self, tools: Sequence[Mapping[str, Any]], choice: str, parallel: bool = True) -> str | None:
        """The grammar of the whole reply under "required" or a named choice; None under "none"
        and, for formats with a trigger, under "auto" (use lazy_grammar from the trigger on)."""
        if choice == "none" or (choice == "auto" and self.trigger):
            return None
        head, rules = self._prefix()
        return f"start: {head}calls\n" + self._calls(chosen(tools, choice), parallel) + rules

    def lazy_grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        """The grammar from the trigger on (it starts with the trigger)."""
        return "start: calls\n" + self._calls(chosen(tools, "auto"), parallel)

    def constraint(self, tools: Sequence[Mapping[str, Any]], choice: str,
                   parallel: bool = True) -> tuple[str, str | None] | None:
        """(grammar, trigger) for a request: the trigger is None when the grammar applies from the start."""
        if choice == "none" or not tools:
            return None
        if choice == "auto" and self.trigger:
            return self.lazy_grammar(tools, parallel), self.trigger
        grammar = self.grammar(tools, choice, parallel)
        return (grammar, None) if grammar else None

    def new_id(self) -> str:
        """A fresh call id."""
        return _random_id(self.id_length) if self.id_length else "call_" + _random_id(24)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole reply -> (content, calls); a call that is not valid JSON stays content."""
        s = ToolStreamer(self, atomic=True)
        return assemble(s.feed(text) + s.flush())

    def streamer(self) -> ToolStreamer:
        """An incremental parser for one streamed reply."""
        return ToolStreamer(self)

    def _prefix(self) -> tuple[str, str]:
        """What may come before the calls when they are the whole reply, and its rules."""
        return "", ""

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        raise NotImplementedError



FAMILIES: Families[ToolFormat] = Families("localrun.tools")
register = FAMILIES.register


@lru_cache(maxsize=32)
def detect_format(template: str | None) -> ToolFormat:
    """The tool-call family of a chat template: generic when it has no tool syntax (or is None)."""
    return FAMILIES.find(template or "")(template)


# -- grammar pieces --------------------------------------------------------------------------

def params_schema(tool: Mapping[str, Any]) -> Any:
    """A tool's arguments schema (an empty object when it takes none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def call_schema(tool: Mapping[str, Any], args_key: str = "arguments",
                extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The schema of one call object: {"name": NAME, args_key: arguments, **extra}."""
    props = {"name": {"const": tool["function"]["name"]}, args_key: params_schema(tool), **(extra or {})}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    """One of the schemas (the schema itself when there is one)."""
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def array_of(items: dict[str, Any], parallel: bool) -> dict[str, Any]:
    """A non-empty array of items; one item only unless parallel."""
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def call_array(opener: str, tools: Sequence[Mapping[str, Any]], parallel: bool,
               extra: Mapping[str, Any] | None = None) -> str:
    """Rules for `calls`: the opener, then a JSON array of call objects."""
    items = any_of([call_schema(t, extra=extra) for t in tools])
    return f"calls: {special(opener)} body\n" + schema_lark(array_of(items, parallel), "body")


def array_opener(text: str) -> Opener:
    """The opener of a JSON array of calls after text (whitespace allowed between)."""
    return Opener(text, (("ws", ""), ("json", "calls")))


def chosen(tools: Sequence[Mapping[str, Any]], choice: str) -> list[Mapping[str, Any]]:
    """The tools a choice allows: all of them, or the one it names."""
    out = list(tools) if choice in CHOICES else [t for t in tools if t["function"]["name"] == choice]
    if not out:
        raise UsageError(f"tool_choice {choice!r} names no tool given", "pass the tool in tools")
    return out


def _random_id(n: int) -> str:
    return "".join(random.choices(_ALNUM, k=n))


# -- prompt pieces ---------------------------------------------------------------------------

def one_call_per_turn(messages: Sequence[Message]) -> list[Message]:
    """Each assistant turn with several tool calls as one turn per call (the first keeps the text),
    for templates that render one call a turn."""
    out: list[Message] = []
    for m in messages:
        if m.role == "assistant" and len(m.tool_calls) > 1:
            out.extend(replace(m, content=m.content if i == 0 else "", tool_calls=(c,))
                       for i, c in enumerate(m.tool_calls))
        else:
            out.append(m)
    return out


def plain_calls(m: Message) -> list[dict[str, Any]]:
    """An assistant turn's calls as [{"name", "arguments"}]."""
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m.tool_calls]


def calls_as_text(messages: Sequence[Message], write: Callable[[list[dict[str, Any]]], str]) -> list[Message]:
    """Past calls written into their assistant turns as text, for templates that cannot show them."""
    return [replace(m, content=m.content + write(plain_calls(m)), tool_calls=()) if m.tool_calls else m
            for m in messages]


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tools as a prompt lists them for a template that takes none."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
    return f"You can call these tools (JSON schemas of their arguments):\n{listed}\n\n"


def must(choice: str) -> str:
    """The sentence a prompt adds for tool_choice "required" or a named function."""
    if choice == "required":
        return "You must call at least one tool.\n"
    return f"You must call the tool '{choice}'.\n" if choice not in CHOICES else ""


def with_system(messages: list[Message], text: str, system_ok: bool) -> list[Message]:
    """Add text to the system turn (or make one; or, where a template has none, the first user turn)."""
    if messages and messages[0].role == "system":
        return [replace(messages[0], content=f"{messages[0].content}\n\n{text}"), *messages[1:]]
    if system_ok:
        return [Message("system", text), *messages]
    for i, m in enumerate(messages):
        if m.role == "user":
            return [*messages[:i], replace(m, content=f"{text}\n\n{m.content}"), *messages[i + 1:]]
    return [Message("user", text), *messages]
