"""gpt-oss (OpenAI's harmony format): a call is a message of its own, addressed to a recipient,
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{ARGS}<|call|>`, one per
message. The reasoning splitter (localrun.reasoning.harmony) passes such a message on whole (its
header without the role), after the final channel's text; this module reads the calls out of it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from localrun.chat import Message
from localrun.constraint import literal, schema_lark
from localrun.reasoning.base import held
from localrun.tools.base import ToolFormat, one_call_per_turn, params_schema, register
from localrun.tools.lark import regex_literal, special
from localrun.tools.stream import Event, Opener, ToolCall, ToolStreamer, assemble

# Every header llama.cpp's gpt-oss cases write: the recipient in the role part or in the channel's,
# with or without a content type (`<|constrain|>json`, or the template's bare ` json`).
HEADER = re.compile(r"(?:<\|channel\|>\w+)?\s*to=([\w.\-]+)\s*(?:<\|channel\|>\w+)?\s*(?:<\|constrain\|>)?\s*(?:\w+)?\s*"
                    r"<\|message\|>")
ENDS = ("<|call|>", "<|end|>", "<|return|>")
_STARTS = ("<|channel|>", "to=", *ENDS)
_BODY = Opener("", (("json", "args"), ("ws", ""), ("opt", "<|call|>")), keep=True)
_HOLD = 256  # a possible header longer than this without <|message|> is text


@register(5)
class Harmony(ToolFormat):
    """gpt-oss: `to=functions.NAME<|channel|>commentary json<|message|>{ARGS}`, one call per message."""

    name = "harmony"
    trigger = "to=functions."

    @classmethod
    def matches(cls, template: str) -> bool:
        return "<|channel|>" in template and "to=" in template and '"functions."' in template

    def prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]],
                choice: str = "auto") -> list[Message]:
        return one_call_per_turn(messages)  # the template renders only a turn's first call

    def streamer(self) -> ToolStreamer:
        return HarmonyStreamer(self)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        s = HarmonyStreamer(self, atomic=True)
        return assemble(s.feed(text) + s.flush())

    def _prefix(self) -> tuple[str, str]:
        # The prompt ends with `<|start|>assistant`: the analysis first, then the call's own message.
        end = regex_literal("<|end|>")
        return ('analysis? " "? ',
                f'analysis: {special("<|channel|>")} "analysis" {special("<|message|>")} thought '
                f'{special("<|start|>")} "assistant"\n'
                f'thought: ANALYSIS {special("<|end|>")} | analysis_lit\n'
                "analysis_lit[lazy]: ANALYSIS_LIT\n"
                f"ANALYSIS: /(?s:.*)/ & ~/(?s:.*){end}(?s:.*)/\n"
                f"ANALYSIS_LIT: /(?s:.*){end}/\n")

    def _calls(self, tools: list[Mapping[str, Any]], parallel: bool) -> str:
        # One call per message: a harmony reply ends at <|call|>, so parallel calls are not a thing.
        rules = ['calls: "to=functions." call\n',
                 "call: " + " | ".join(f"fn_{i}" for i in range(len(tools))) + "\n"]
        head = f'{special("<|channel|>")} "commentary json" {special("<|message|>")}'
        for i, t in enumerate(tools):
            rules.append(f"fn_{i}: {literal(t['function']['name'])} {head} args_{i}\n")
            rules.append(schema_lark(params_schema(t), f"args_{i}"))
        return "".join(rules)


class HarmonyStreamer(ToolStreamer):
    """The ToolStreamer with harmony's headers for openers: a call to `functions.NAME` reads its
    JSON body; a message to any other recipient (a built-in tool the request did not offer) is
    dropped, as llama.cpp drops it; the end markers of call messages are dropped."""

    def __init__(self, fmt: ToolFormat, atomic: bool = False) -> None:
        super().__init__(fmt, atomic)
        self.skipping = False

    def flush(self) -> list[Event]:
        if self.skipping:
            self.pending = ""
        return super().flush()

    def _scan(self, text: str) -> str:
        text, self.pending = self.pending + text, ""
        if self.skipping:
            return self._skip(text)
        hits = [i for s in _STARTS if (i := text.find(s)) >= 0]
        if not hits:
            keep = held(text, _STARTS)
            self._content(text[: len(text) - keep])
            self.pending = text[len(text) - keep:]
            return ""
        i = min(hits)
        self._content(text[:i])
        rest = text[i:]
        end = next((e for e in ENDS if rest.startswith(e)), None)
        if end is not None:
            return rest[len(end):]
        m = HEADER.match(rest)
        if m is None:
            if "<|message|>" not in rest and len(rest) < _HOLD:
                self.pending = rest  # the header may still come whole
                return ""
            self._content(rest[0])
            return rest[1:]
        recipient = m.group(1)
        if recipient.startswith("functions.") and len(recipient) > len("functions."):
            self._open(_BODY)
            assert self.block is not None
            self.block.calls.set_name(recipient[len("functions."):])
        else:
            self.skipping = True
        return rest[m.end():]

    def _skip(self, text: str) -> str:
        hits = [(j, e) for e in ENDS if (j := text.find(e)) >= 0]
        if hits:
            j, e = min(hits)
            self.skipping = False
            return text[j + len(e):]
        keep = held(text, ENDS)
        self.pending = text[len(text) - keep:]
        return ""
