"""Lark text that call and reasoning grammars share: literals, regex-escaped text, special-token
placeholders (`<<special:TEXT>>`, one token where the vocabulary has it) and free reasoning."""

from __future__ import annotations

import re
from collections.abc import Callable

from localrun.constraint import literal

# TEXT may end in '>' (<|python_tag|>): the placeholder ends at the last '>>' of a run of '>'.
_SPECIAL = re.compile(r"<<special:(.+?)>>(?!>)", re.S)


def resolve_specials(grammar: str, lookup: Callable[[str], int | None]) -> str:
    """Replace each `<<special:TEXT>>` with `<[id]>` when lookup(TEXT) gives a token id, else
    with TEXT as a quoted literal."""

    def sub(m: re.Match[str]) -> str:
        tid = lookup(m.group(1))
        return f"<[{tid}]>" if tid is not None else literal(m.group(1))

    return _SPECIAL.sub(sub, grammar)


def special(text: str) -> str:
    """text as a special-token placeholder: one token if the vocabulary has it, else the text."""
    return f"<<special:{text}>>"


def regex_literal(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


def thought(before: str = "") -> str:
    """Rules for `thought`: reasoning up to and including </think>. The lexer is greedy, so free
    text must not be able to run past </think> as literal text (then `think_lit`, lazy, ends at it)
    nor, when the reply may skip thinking, begin with the calls' opener `before`."""
    skip = f" & ~/{regex_literal(before)}(?s:.*)/" if before else ""
    return (f"thought: THINK {special('</think>')} | think_lit\n"
            "think_lit[lazy]: THINK_LIT\n"
            f"THINK: /(?s:.*)/ & ~/(?s:.*)<\\/think>(?s:.*)/{skip}\n"
            f"THINK_LIT: /(?s:.*)<\\/think>/{skip}\n"
            "WS: /[ \\t\\r\\n]+/\n")
