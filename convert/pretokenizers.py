"""Map a tokenizer.json pre-tokenizer definition to the `tokenizer.ggml.pre` llama.cpp implements.

llama.cpp's own converter hashes a sample tokenization and rejects every tokenizer not on its list.
Here the split regexes are read from the definition itself (Split patterns, ByteLevel's built-in
GPT-2 regex, Digits) and compared with the regex lists llama.cpp hard-codes per pre-tokenizer
(src/llama-vocab.cpp); `ignore_merges` and the detokenizer's space cleaning pick among pre-types
that split alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from convert.errors import ConvertError

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CASED = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
_CASED2 = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
GPT4O = (
    _CASED + _CONTRACTIONS + "?|" + _CASED2 + _CONTRACTIONS + "?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = _CASED + "|" + _CASED2 + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SEED_CODER = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"]
DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]


@dataclass(frozen=True)
class PreType:
    """One `tokenizer.ggml.pre` value and the behaviour llama.cpp attaches to it."""

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True


# Order matters only between entries with the same regexes: the flags decide.
PRE_TYPES: tuple[PreType, ...] = (
    PreType("gpt-2", (GPT2,)),
    PreType("starcoder", (r"\p{N}", GPT2)),
    PreType("smollm", (r"\p{N}", GPT2), clean_spaces=False),
    PreType("llama-bpe", (LLAMA3,), ignore_merges=True),
    PreType("smaug-bpe", (LLAMA3,)),
    PreType("qwen2", (QWEN2,), clean_spaces=False),
    PreType("stablelm2", (QWEN2,)),
    PreType("qwen35", (QWEN35,), clean_spaces=False),
    PreType("gpt-4o", (GPT4O,), clean_spaces=False),
    PreType("tekken", (TEKKEN,), ignore_merges=True, clean_spaces=False),
    PreType("seed-coder", (SEED_CODER,), clean_spaces=False),
    PreType("bloom", (BLOOM,)),
    PreType("viking", (BLOOM, r"\p{N}"), clean_spaces=False),
    PreType("deepseek-coder", tuple(DEEPSEEK_CODER), clean_spaces=False),
    PreType("deepseek-v3", tuple(DEEPSEEK_V3), clean_spaces=False),
)

# llama.cpp's adapted spelling of the case-insensitive contractions, and other equivalents.
_EQUIVALENT = {
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])": _CONTRACTIONS,
}


def canonical(regex: str) -> str:
    for a, b in _EQUIVALENT.items():
        regex = regex.replace(a, b)
    return regex


def split_regexes(pre: dict[str, Any] | None) -> tuple[list[str], list[str]]:
    """The regexes a tokenizer.json pre-tokenizer splits by, in order, and what is unsupported."""
    regexes: list[str] = []
    problems: list[str] = []
    if not pre:
        return regexes, problems
    kind = pre.get("type")
    if kind == "Sequence":
        for sub in pre.get("pretokenizers", []):
            r, p = split_regexes(sub)
            regexes += r
            problems += p
    elif kind == "Split":
        pattern = pre.get("pattern", {})
        if "Regex" in pattern:
            regexes.append(canonical(pattern["Regex"]))
        else:
            regexes.append(re.escape(pattern.get("String", "")))
        if pre.get("invert"):
            problems.append("an inverted Split")
        if pre.get("behavior") not in ("Isolated", None):
            problems.append(f"Split behaviour {pre.get('behavior')}")
    elif kind == "ByteLevel":
        if pre.get("use_regex", True):
            regexes.append(GPT2)
        if pre.get("add_prefix_space"):
            problems.append("ByteLevel add_prefix_space")
    elif kind == "Digits":
        regexes.append(r"\p{N}" if pre.get("individual_digits") else r"\p{N}+")
    else:
        problems.append(f"pre-tokenizer {kind}")
    return regexes, problems


def derive_pre(tokenizer_json: dict[str, Any], clean_up_spaces: bool | None) -> str:
    """The llama.cpp pre-tokenizer name for a byte-level BPE tokenizer.json, or a ConvertError."""
    regexes, problems = split_regexes(tokenizer_json.get("pre_tokenizer"))
    normalizer = tokenizer_json.get("normalizer")
    if normalizer and normalizer.get("type") not in ("NFC",):
        problems.append(f"normalizer {normalizer.get('type')}")
    ignore_merges = bool(tokenizer_json.get("model", {}).get("ignore_merges", False))
    candidates = [p for p in PRE_TYPES if p.regexes == tuple(regexes)]
    if problems or not candidates:
        shown = " + ".join(repr(r) for r in regexes) or "no split"
        extra = f" with {', '.join(problems)}" if problems else ""
        raise ConvertError(
            f"the tokenizer's pre-tokenizer ({shown}{extra}) matches none that llama.cpp implements",
            "llama.cpp would tokenize this model differently; report the tokenizer.json",
        )

    def score(p: PreType) -> tuple[int, int]:
        return (
            int(p.ignore_merges == ignore_merges),
            int(clean_up_spaces is None or p.clean_spaces == clean_up_spaces),
        )

    return max(candidates, key=score).name
