"""Freeform tools (OpenAI's `custom` tools): a tool whose input is text, not JSON arguments, and may
be bound to a grammar (`format: {"type": "grammar", "syntax": "lark" | "regex", "definition"}`),
as Codex declares its `apply_patch` tool.

A chat template writes a call as JSON, so a freeform tool is offered to the model as a function
with one string argument, `input`; its grammar becomes that string's JSON-schema `pattern`,
which llguidance enforces on the decoded text while the escaped JSON is written. A Lark grammar
without recursion is a regular language: its rules are inlined into one regex here. A recursive
one cannot be a pattern; its input is then free text, and `pattern_of` says why.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from localrun.errors import UsageError

INPUT = "input"  # the one argument a freeform tool's call carries
# Lark's `%import common.X` terminals, as regexes
_COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS": r"[ \t\f\r\n]+", "WS_INLINE": r"[ \t]+",
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)", "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "LETTER": r"[A-Za-z]", "LCASE_LETTER": r"[a-z]", "UCASE_LETTER": r"[A-Z]", "WORD": r"[A-Za-z]+",
    "CNAME": r"[A-Za-z_][A-Za-z0-9_]*", "ESCAPED_STRING": r'"(?:[^"\\]|\\.)*"',
}
_TOKEN = re.compile(r'''
    (?P<ws>[ \t]+|\\\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imsux]*)
  | (?P<range>~\s*\d+(?:\s*\.\.\s*\d+)?)
  | (?P<name>[?!]?[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<alias>->\s*[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>[()\[\]|?*+])
''', re.X)


@dataclass(frozen=True)
class Freeform:
    """A freeform tool as the chat layer offers it: a function of one string argument."""

    name: str
    description: str
    pattern: str | None  # the regex the input matches (None: free text)
    note: str | None = None  # why a grammar could not be enforced, when it could not

    def function(self) -> dict[str, Any]:
        """The tool as a function tool: {"input": string}, the grammar as its pattern."""
        arg: dict[str, Any] = {"type": "string", "description": "the tool's input, as plain text"}
        if self.pattern is not None:
            arg["pattern"] = self.pattern
        params = {"type": "object", "properties": {INPUT: arg}, "required": [INPUT], "additionalProperties": False}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


def freeform(tool: Mapping[str, Any]) -> Freeform:
    """A `custom` tool ({"type": "custom", "name", "description", "format"}) checked and compiled."""
    name, fmt = tool.get("name"), tool.get("format") or {"type": "text"}
    if not isinstance(name, str) or not name:
        raise UsageError("a custom tool needs a name")
    desc = tool.get("description") or ""
    if not isinstance(fmt, Mapping) or fmt.get("type") not in ("text", "grammar"):
        raise UsageError(f"custom tool '{name}': format must be {{\"type\": \"text\"}} or a grammar")
    if fmt.get("type") == "text":
        return Freeform(name, str(desc), None)
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    if not isinstance(definition, str) or not definition.strip():
        raise UsageError(f"custom tool '{name}': the grammar has no definition")
    if syntax == "regex":
        _check_regex(definition, name)
        return Freeform(name, str(desc), f"^(?:{definition})$")
    if syntax != "lark":
        raise UsageError(f"custom tool '{name}': grammar syntax {syntax!r} is not supported", "use lark or regex")
    pattern, note = pattern_of(definition, name)
    return Freeform(name, str(desc), pattern, note)


def _check_regex(pattern: str, name: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise UsageError(f"custom tool '{name}': its regex does not compile ({e})") from None


def pattern_of(lark: str, name: str = "tool") -> tuple[str | None, str | None]:
    """(regex, None) for a Lark grammar without recursion; (None, why) for one that is recursive
    or uses what a regex cannot hold (%ignore). A grammar that does not parse is a UsageError."""
    rules = _rules(lark, name)
    if "start" not in rules:
        raise UsageError(f"custom tool '{name}': its Lark grammar has no start rule")
    if any(line.strip().startswith("%ignore") for line in lark.splitlines()):
        return None, f"custom tool '{name}': a grammar with %ignore is not enforced (its input is free text)"
    try:
        body = _Inliner(rules, name).rule("start", ())
    except _Recursive as e:
        return None, f"custom tool '{name}': rule '{e}' of its grammar is recursive, so its input is not enforced"
    _check_regex(body, name)
    return f"^(?:{body})$", None


class _Recursive(Exception):
    pass


def _rules(lark: str, name: str) -> dict[str, str]:
    """Rule and terminal definitions by name (continuation lines that start with | joined)."""
    rules: dict[str, str] = {}
    last: str | None = None
    for raw in lark.splitlines():
        line = re.sub(r"(?<!\S)//.*$", "", raw).rstrip()
        if not line.strip():
            continue
        stripped = line.strip()
        if stripped.startswith("%import"):
            for term in _imports(stripped, name):
                rules[term] = f"/{_COMMON[term]}/"
            continue
        if stripped.startswith("%"):
            continue
        if stripped.startswith("|") and last is not None:
            rules[last] += " " + stripped
            continue
        m = re.match(r"[?!]?([A-Za-z_][A-Za-z0-9_]*)(?:\.\d+)?\s*:(.*)$", stripped)
        if m is None:
            raise UsageError(f"custom tool '{name}': cannot read this line of its Lark grammar: {stripped!r}")
        last = m.group(1)
        rules[last] = m.group(2).strip()
    return rules


def _imports(line: str, name: str) -> list[str]:
    m = re.match(r"%import\s+common\.(?:([A-Z_]+)|\(([A-Z_,\s]+)\))\s*(?:->\s*([A-Z_]+))?$", line)
    names = [m.group(1)] if m and m.group(1) else [n.strip() for n in (m.group(2) or "").split(",")] if m else []
    unknown = [n for n in names if n not in _COMMON]
    if not names or unknown:
        raise UsageError(f"custom tool '{name}': unsupported import in its Lark grammar: {line!r}")
    return names


class _Inliner:
    """Turns rules into one regex by inlining every reference (a cycle is recursion)."""

    def __init__(self, rules: dict[str, str], name: str) -> None:
        self.rules, self.name = rules, name
        self.done: dict[str, str] = {}

    def rule(self, rule: str, stack: tuple[str, ...]) -> str:
        if rule in stack:
            raise _Recursive(rule)
        if rule not in self.done:
            if rule not in self.rules:
                raise UsageError(f"custom tool '{self.name}': its Lark grammar uses '{rule}', which it does not define")
            self.done[rule] = self.expansion(self.rules[rule], (*stack, rule))
        return self.done[rule]

    def expansion(self, text: str, stack: tuple[str, ...]) -> str:
        tokens = [(k, v) for m in _TOKEN.finditer(text) for k, v in m.groupdict().items() if v is not None and k != "ws"]
        consumed = "".join(m.group(0) for m in _TOKEN.finditer(text))
        if consumed.replace(" ", "").replace("\t", "") != text.replace(" ", "").replace("\t", ""):
            raise UsageError(f"custom tool '{self.name}': cannot read {text!r} in its Lark grammar")
        out, pos = self._alternatives(tokens, 0, stack)
        if pos != len(tokens):
            raise UsageError(f"custom tool '{self.name}': unbalanced brackets in {text!r} of its Lark grammar")
        return out

    def _alternatives(self, toks: list[tuple[str, str]], i: int, stack: tuple[str, ...]) -> tuple[str, int]:
        branches: list[str] = []
        seq: list[str] = []
        while i < len(toks):
            kind, value = toks[i]
            if kind == "alias":
                i += 1
                continue
            if kind == "op" and value in ")]":
                break
            if kind == "op" and value == "|":
                branches.append("".join(seq))
                seq, i = [], i + 1
                continue
            atom, i = self._atom(toks, i, stack)
            while i < len(toks) and (toks[i][0] == "range" or (toks[i][0] == "op" and toks[i][1] in "?*+")):
                kind, value = toks[i]
                if kind == "range":
                    counts = [n.strip() for n in value[1:].split("..")]
                    atom = f"(?:{atom}){{{counts[0]}{',' + counts[1] if len(counts) > 1 else ''}}}"
                else:
                    atom = f"(?:{atom}){value}"
                i += 1
            seq.append(atom)
        branches.append("".join(seq))
        return (branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"), i

    def _atom(self, toks: list[tuple[str, str]], i: int, stack: tuple[str, ...]) -> tuple[str, int]:
        kind, value = toks[i]
        if kind == "string":
            insensitive = value.endswith("i")
            text = _unescape(value[1:-2] if insensitive else value[1:-1])
            lit = re.escape(text)
            return (f"(?i:{lit})" if insensitive else lit), i + 1
        if kind == "regex":
            body, _, flags = value[1:].rpartition("/")
            return (f"(?{flags}:{body})" if flags else f"(?:{body})"), i + 1
        if kind == "name":
            return f"(?:{self.rule(value.lstrip('?!'), stack)})", i + 1
        if kind == "op" and value in "([":
            inner, j = self._alternatives(toks, i + 1, stack)
            close = ")" if value == "(" else "]"
            if j >= len(toks) or toks[j] != ("op", close):
                raise UsageError(f"custom tool '{self.name}': unbalanced brackets in its Lark grammar")
            return (f"(?:{inner})" if value == "(" else f"(?:{inner})?"), j + 1
        raise UsageError(f"custom tool '{self.name}': unexpected {value!r} in its Lark grammar")


def _unescape(text: str) -> str:
    """A Lark string literal's text (its escapes as in Python strings)."""
    try:
        return str(text.encode("latin-1", "backslashreplace").decode("unicode_escape"))
    except UnicodeDecodeError:
        return text


class InputStream:
    """The text of a freeform call's `input` as its JSON arguments stream in: feed() pieces of
    `{"input": "..."}`, get the decoded text that is sure so far (an escape cut in two waits)."""

    _ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}

    def __init__(self) -> None:
        self.raw = ""
        self.start: int | None = None  # where the string's text begins in raw
        self.pos = 0
        self.closed = False

    def feed(self, piece: str) -> str:
        self.raw += piece
        if self.start is None:
            m = re.search(r'"input"\s*:\s*"', self.raw)
            if m is None:
                return ""
            self.start = self.pos = m.end()
        out: list[str] = []
        raw, i = self.raw, self.pos
        while i < len(raw) and not self.closed:
            c = raw[i]
            if c == '"':
                self.closed = True
                i += 1
                break
            if c != "\\":
                out.append(c)
                i += 1
                continue
            if i + 1 >= len(raw):
                break
            e = raw[i + 1]
            if e == "u":
                if i + 6 > len(raw):
                    break
                code = int(raw[i + 2:i + 6], 16)
                if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves first
                    if i + 12 > len(raw):
                        break
                    low = int(raw[i + 8:i + 12], 16)
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    i += 12
                    continue
                out.append(chr(code))
                i += 6
                continue
            out.append(self._ESCAPES.get(e, e))
            i += 2
        self.pos = i
        return "".join(out)
