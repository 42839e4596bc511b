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


# special-token markup: <|name|>, and Gemma 4's <|name> and <name|>
_MARKUP = re.compile(r"(<\|[^|<>]+\|?>|<[^|<>]+\|>)")


def specials(text: str) -> str:
    """text as Lark, cut at each `<|NAME|>` (or `<|NAME>`, `<NAME|>`) in it, every piece a special-token placeholder (one
    token where the vocabulary has it as one, else literal text): a harmony header is several
    special tokens with words between them."""
    return " ".join(special(p) for p in _MARKUP.split(text) if p)


def regex_literal(text: str) -> str:
    """text as a literal inside a Lark /regex/."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


# The most whitespace between a thought and what follows it: unbounded, a model (or a sampled
# reply) could spend its whole budget there and never answer.
THOUGHT_GAP = 8


def thought(before: str = "", closing: str = "</think>", name: str = "thought") -> str:
    """Rules for `name`: reasoning up to and including its closing marker, and `NAME_WS` for the
    whitespace after it. The lexer is greedy, so free text must not be able to run past the marker
    as literal text (then `name_lit`, lazy, ends at it) nor, when the reply may skip thinking,
    begin with the calls' opener `before`. `NAME_WS` is at most THOUGHT_GAP characters. Rule names
    are the caller's, so that a grammar wrapped in a thought may hold another thought of its own."""
    skip = f" & ~/{regex_literal(before)}(?s:.*)/" if before else ""
    c, up = regex_literal(closing), name.upper()
    return (f"{name}: {up} {special(closing)} | {name}_lit\n"
            f"{name}_lit[lazy]: {up}_LIT\n"
            f"{up}: /(?s:.*)/ & ~/(?s:.*){c}(?s:.*)/{skip}\n"
            f"{up}_LIT: /(?s:.*){c}/{skip}\n"
            f"{up}_WS: /[ \\t\\r\\n]{{1,{THOUGHT_GAP}}}/\n")


def after_thought(lark: str, opening: str, closing: str, inside: bool, answer_head: str = "",
                  gap: str = "") -> str:
    """A grammar that lets a thinking model think first: an optional thought between the format's
    markers (a required one when the prompt opened it), what it writes after the closing marker
    (`gap`, where that is more than whitespace, e.g. harmony's next <|start|>assistant), the text
    the format writes before its answer (`answer_head`, e.g. Granite's <response>, harmony's final
    channel header), then the original grammar. Markers are spelled with `specials`, so a header
    of several special tokens (harmony's) is those tokens."""
    body = re.sub(r"(?m)^([?!]?)start(\s*:)", r"\1answer_start\2", lark)
    after = f"REASONING_WS? {specials(gap)} " if gap.strip() else "REASONING_WS? "
    head = f"reasoning {after}" if inside else f"({specials(opening)} reasoning {after})? "
    if answer_head:
        head = f"({head}{specials(answer_head)})? " if not inside else f"{head}{specials(answer_head)} "
    return f"start: {head}answer_start\n" + thought(closing=closing, name="reasoning") + body
