"""Map a tokenizer.json pre-tokenizer definition to the `tokenizer.ggml.pre` llama.cpp implements.

llama.cpp's own converter hashes a sample tokenization and rejects every tokenizer not on its list.
Here the split regexes are read from the definition itself (Split patterns, ByteLevel's built-in
GPT-2 regex, Digits) and compared with the regex lists llama.cpp hard-codes per pre-tokenizer
(src/llama-vocab.cpp); `ignore_merges` and the detokenizer's space cleaning pick among pre-types
that split alike.

Which kind of BPE a tokenizer.json is (byte-level or SentencePiece-style) is read from what its
pre-tokenizer, normalizer and decoder do; for SentencePiece-style files, whether llama.cpp's space
prefix reproduces them is checked by running their normalizer and pre-tokenizer on probe texts.
"""

from __future__ import annotations

import json
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
    # transformers 4.x writes "no normalizer" as an empty Sequence: only real steps count.
    problems += [f"normalizer {s.get('type')}" for s in steps(tokenizer_json.get("normalizer"))
                 if s.get("type") != "NFC"]
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


# --- what kind of BPE a tokenizer.json is -----------------------------------------------------

SPACE = "\u2581"  # SentencePiece's visible space


def steps(node: Any) -> list[dict[str, Any]]:
    """The components of a normalizer, pre-tokenizer or decoder, Sequences flattened, in order.

    An empty Sequence (nested or not) has no components: it does nothing, as null does.
    """
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        for key in ("normalizers", "pretokenizers", "decoders"):
            subs = node.get(key)
            if isinstance(subs, list):
                return [s for sub in subs for s in steps(sub)]
    return [node]


def _describe(node: Any) -> str:
    return " + ".join(str(s.get("type")) for s in steps(node)) or "none"


def _replaces(step: dict[str, Any], old: str, new: str) -> bool:
    return (
        step.get("type") == "Replace"
        and step.get("pattern") == {"String": old}
        and step.get("content") == new
    )


def is_byte_level(tj: dict[str, Any]) -> bool:
    """Whether a tokenizer.json maps bytes to tokens (a ByteLevel step in its pre-tokenizer)."""
    return any(s.get("type") == "ByteLevel" for s in steps(tj.get("pre_tokenizer")))


def tokenizer_kind(tj: dict[str, Any]) -> str:
    """'byte-level' or 'sentencepiece': what a BPE tokenizer.json does with spaces and bytes.

    Read from the pre-tokenizer, normalizer and decoder, not from the model's byte_fallback flag,
    which is inert under a ByteLevel pre-tokenizer (every byte is a token there).
    """
    pre, norm, dec = (
        steps(tj.get("pre_tokenizer")),
        steps(tj.get("normalizer")),
        steps(tj.get("decoder")),
    )
    byte_level = is_byte_level(tj)
    byte_decoder = any(s.get("type") == "ByteLevel" for s in dec)
    spaces = any(s.get("type") == "Metaspace" for s in pre) or any(
        _replaces(s, " ", SPACE) or (s.get("type") == "Prepend" and s.get("prepend") == SPACE)
        for s in norm
    )
    space_decoder = any(s.get("type") == "Metaspace" or _replaces(s, SPACE, " ") for s in dec)
    if byte_level and not spaces and (byte_decoder or not dec):
        return "byte-level"
    if spaces and not byte_level and not byte_decoder and (space_decoder or not dec):
        return "sentencepiece"
    raise ConvertError(
        "tokenizer.json's BPE is neither byte-level (a ByteLevel pre-tokenizer and decoder) nor "
        f"SentencePiece-style (spaces as {SPACE!r}): normalizer {_describe(tj.get('normalizer'))}, "
        f"pre-tokenizer {_describe(tj.get('pre_tokenizer'))}, decoder {_describe(tj.get('decoder'))}",
        "llama.cpp implements those two kinds of BPE only; report the tokenizer.json",
    )


# Texts whose ▁ prefix differs between Hugging Face's space schemes; PROBE_TOKEN stands for a
# special token, after which llama.cpp starts a new text (and adds its prefix again).
PROBE_TOKEN = "<|localrun-probe|>"
_PROBES = (
    "Hi",
    " Hi",
    "  Hi  there ",
    "\nHi",
    "Hi\n  there",
    "\t x",
    PROBE_TOKEN + "Hi",
    PROBE_TOKEN + " Hi",
    "Hi" + PROBE_TOKEN + "there",
    "Hi" + PROBE_TOKEN + "  there",
)


def _llama_spm_text(text: str, prefix: bool) -> str:
    """What llama.cpp's SentencePiece tokenizer merges: each text between special tokens with
    spaces as ▁, behind one ▁ when the vocabulary adds a space prefix."""
    parts = text.split(PROBE_TOKEN)
    lead = SPACE if prefix else ""
    return PROBE_TOKEN.join(lead + p.replace(" ", SPACE) if p else "" for p in parts)


def _hf_spm_text(tj: dict[str, Any]) -> dict[str, str]:
    """What the tokenizer.json's normalizer and pre-tokenizer give the BPE model for each probe."""
    from tokenizers import Tokenizer

    chars = sorted({c for t in _PROBES for c in t.replace(PROBE_TOKEN, "")} | {SPACE})
    vocab = {"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    probe = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": len(vocab),
                "content": PROBE_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": tj.get("normalizer"),
        "pre_tokenizer": tj.get("pre_tokenizer"),
        "post_processor": None,
        "decoder": None,
        # One token per character: the tokens spell out exactly what the model would merge.
        "model": {"type": "BPE", "vocab": vocab, "merges": [], "unk_token": "<unk>"},
    }
    try:
        tok = Tokenizer.from_str(json.dumps(probe))
    except Exception as e:  # tokenizers raises its own Exception type for bad definitions
        raise ConvertError(
            f"tokenizer.json's normalizer or pre-tokenizer is not readable: {e}"
        ) from e
    return {t: "".join(tok.encode(t, add_special_tokens=False).tokens) for t in _PROBES}


def sentencepiece_prefix(tj: dict[str, Any], want: bool | None = None) -> bool:
    """Whether llama.cpp needs its space prefix to tokenize like this SentencePiece-style
    tokenizer.json (want: the setting the architecture requires); a ConvertError where no setting
    does, as for Metaspace's prepend_scheme 'first' (no ▁ after a special token)."""
    got = _hf_spm_text(tj)
    options = (want,) if want is not None else (True, False)
    for prefix in options:
        if all(got[t] == _llama_spm_text(t, prefix) for t in _PROBES):
            return prefix
    prefix = want if want is not None else got["Hi"].startswith(SPACE)
    text = next(t for t in _PROBES if got[t] != _llama_spm_text(t, prefix))
    shown = text.replace(PROBE_TOKEN, "<special>")
    schemes = {
        str(s.get("prepend_scheme"))
        for s in steps(tj.get("pre_tokenizer"))
        if s.get("type") == "Metaspace" and s.get("prepend_scheme")
    }
    why = f"'s Metaspace (prepend_scheme {', '.join(sorted(schemes))})" if schemes else ""
    rule = (
        f"puts one {SPACE!r} before every text, one that starts with a space too, and after every "
        "special token"
        if prefix
        else f"adds no {SPACE!r} before a text"
    )
    raise ConvertError(
        f"tokenizer.json{why} makes {shown!r} into {got[text].replace(PROBE_TOKEN, '<special>')!r} "
        f"where llama.cpp's SentencePiece tokenizer makes "
        f"{_llama_spm_text(text, prefix).replace(PROBE_TOKEN, '<special>')!r}: llama.cpp would "
        "tokenize prompts differently from Hugging Face",
        f"llama.cpp {rule}; to convert with SentencePiece's own rules instead, add the model's "
        "tokenizer.model to the folder",
    )
