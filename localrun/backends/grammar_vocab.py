"""The vocabulary a grammar masks tokens with, checked against the model's own tokenizer.

llguidance reads each token's bytes from tokenizer.json by itself, choosing between byte-level
and SentencePiece-style readings from the decoder. Where its reading differs from the model's
tokenizer, every mask is wrong and the reply is broken JSON that looks finished: transformers
4.x exports SmolLM2's byte-level vocabulary with a SentencePiece-style decoder around its
ByteLevel step, and llguidance then takes 'Ġ"' literally instead of as ' "'. So the tokenizer
llguidance builds is compared with the model's, token by token and on probe texts, before any
grammar uses it; one that disagrees is refused with the model's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from localrun.constraint import import_llguidance
from localrun.errors import BackendUnavailableError

# Texts whose tokens include pieces of multi-byte characters, spaces, JSON and code.
PROBES = (
    '{"name": "Paris", "country": "France", "population": 2102650, "ok": [true, null, -1.5e3]}',
    "  two leading spaces\n\tand a tab\r\n",
    "café, naïve, ¡Hola! 日本語のテキスト 🙂👍🏽 Ελληνικά",
    "def f(x):\n    return {'a': x}  # comment",
)


def model_texts(backend: Any) -> list[str]:
    """Each token's text as the model's tokenizer (a `tokenizers.Tokenizer`) decodes it in the
    middle of a reply: after another token, so that a SentencePiece word's leading space stays."""
    n = backend.get_vocab_size(with_added_tokens=True)
    lead = backend.encode("a", add_special_tokens=False).ids[-1:]
    head = backend.decode(lead, skip_special_tokens=False)
    pairs = backend.decode_batch([lead + [i] for i in range(n)], skip_special_tokens=False)
    return [p[len(head):] if p.startswith(head) else p for p in pairs]


def disagreement(llg_tokenizer: Any, backend: Any, n_vocab: int, emitted: Callable[[list[int]], str]) -> str | None:
    """Where llguidance's token bytes differ from the model's tokenizer, or None when they agree.

    Every token is compared (a token holding part of a character only as far as decoding shows
    it); then probe texts, tokenized by the model, must read the same through llguidance's bytes
    as through `emitted` (the engine's own detokenizer), which covers those partial tokens.
    """
    texts = model_texts(backend)
    bad = []
    for i, want in enumerate(texts[:n_vocab]):
        if llg_tokenizer.is_special_token(i):
            continue  # control tokens are matched by id, never by their text
        got = llg_tokenizer.decode_bytes([i])
        if (got.decode("utf-8", "replace") != want) if "\ufffd" in want else (got != want.encode("utf-8")):
            bad.append((i, want, got))
    if bad:  # shown: the first token that holds whole characters, when one differs
        i, want, got = next((b for b in bad if "\ufffd" not in b[1]), bad[0])
        return (f"token {i} is {want!r} to the model and {got.decode('utf-8', 'replace')!r} to the grammar engine; "
                f"{len(bad)} of {min(len(texts), n_vocab)} tokens differ")
    for text in PROBES:
        ids = backend.encode(text, add_special_tokens=False).ids
        got_text = b"".join(llg_tokenizer.decode_bytes([i]) for i in ids).decode("utf-8", "replace")
        want = emitted(ids)
        if got_text != want:
            return f"the model writes {want!r} where the grammar engine reads {got_text!r}"
    return None


def _readings(tj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """tokenizer.json as it is, then, for a decoder Sequence around a ByteLevel step, with that
    step alone (llguidance recognises a byte-level vocabulary by a ByteLevel decoder)."""
    yield tj
    dec = tj.get("decoder") or {}
    if dec.get("type") == "Sequence":
        level = [d for d in dec.get("decoders") or [] if isinstance(d, dict) and d.get("type") == "ByteLevel"]
        if level:
            yield {**tj, "decoder": level[0]}


def agreeing_tokenizer(backend: Any, n_vocab: int, eos: list[int], model: str,
                       emitted: Callable[[list[int]], str]) -> Any:
    """llguidance's tokenizer for a model's `tokenizers.Tokenizer`, in the first reading of its
    tokenizer.json that agrees with the model token for token; BackendUnavailableError naming
    the model when none does."""
    from copy import copy

    llg = import_llguidance()
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    why = None
    for tj in _readings(json.loads(backend.to_str())):
        tokenizer = llg.LLTokenizer(json.dumps(tj), n_vocab=n_vocab, eos_token=eos)
        why = disagreement(tokenizer, backend, n_vocab, emitted)
        if why is None:
            return tokenizer
    raise BackendUnavailableError(
        f"structured output is not available for '{model}': the grammar engine reads its tokenizer "
        f"differently from the model ({why})",
        "the model still runs without a schema, grammar or tools; report its tokenizer.json, or run a GGUF copy "
        "of it on llama.cpp",
    )
