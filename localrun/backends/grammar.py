"""Constrained decoding for both engines: one llguidance matcher per constrained sequence.

Each sequence in a batched step has its own matcher, so rows with different schemas run in the
same batch. A step asks each active matcher for its token mask (tens of microseconds with a
49k vocabulary, against milliseconds for llama.cpp's own grammar sampler, measured in
benchmarks/bench_structured.py) and sets the logits of every token the grammar forbids to -inf
before the engine's own sampler chain runs; the sampled token then advances the matcher.

A lazy grammar (tool calls under tool_choice "auto") waits for its trigger text in the output and
applies from there on: the trigger is fed to the matcher, then every later token is constrained.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from localrun.constraint import import_llguidance
from localrun.errors import UsageError
from localrun.tools import resolve_specials


class Grammars:
    """An engine's grammar compiler: its llguidance tokenizer (built once, on first use) and a
    cache of compiled grammars (a fresh matcher per grammar text, copied for each sequence)."""

    def __init__(self, make_tokenizer: Callable[[], Any], special_id: Callable[[str], int | None],
                 n_vocab: int, piece: Callable[[int], str]) -> None:
        self._make_tokenizer = make_tokenizer
        self._tokenizer: Any = None
        self.special_id = special_id
        self.n_vocab = n_vocab
        self.piece = piece  # a token's text, control tokens included (for triggers)
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def matcher(self, lark: str) -> Any:
        """A new matcher at the start of the grammar; UsageError if it does not compile."""
        llg = import_llguidance()
        fresh = self._compiled.get(lark)
        if fresh is None:
            fresh = llg.LLMatcher(self.tokenizer, resolve_specials(lark, self.special_id), log_level=0)
            if fresh.is_error():
                raise UsageError(f"invalid grammar: {fresh.get_error().strip()}")
            self._compiled[lark] = fresh
            if len(self._compiled) > 64:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(lark)
        return fresh.deep_copy()

    def state(self, lark: str | None, trigger: str | None) -> GrammarState | None:
        if lark is None:
            return None
        matcher = self.matcher(lark)  # compile now: a bad grammar fails this request before it runs
        return GrammarState(self, lark, trigger, None if trigger else matcher)


class GrammarState:
    """One sequence's constraint: inactive until its trigger, then a matcher that masks tokens."""

    __slots__ = ("grammars", "lark", "trigger", "matcher", "text", "consumed", "_bits")

    def __init__(self, grammars: Grammars, lark: str, trigger: str | None, matcher: Any) -> None:
        self.grammars = grammars
        self.lark = lark
        self.trigger = trigger
        self.matcher = matcher
        self.text = ""  # output so far, while waiting for the trigger
        self.consumed = 0  # tokens seen (the MLX processor counts with it)
        self._bits: Any = None

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def allowed(self) -> Any:
        """A boolean numpy array over the vocabulary: the tokens the grammar allows next."""
        import numpy as np

        if self._bits is None:
            self._bits = np.zeros((1, (self.grammars.n_vocab + 31) // 32), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.grammars.n_vocab].astype(bool)

    def mask_logits(self, logits: Any) -> None:
        """Forbid, in place, every token the grammar does not allow (a numpy float array)."""
        if self.matcher is not None:
            logits[~self.allowed()] = -float("inf")

    def accept(self, token: int) -> None:
        self.consumed += 1
        if self.matcher is not None:
            if not self.matcher.is_stopped():
                self.matcher.consume_token(token)
            return
        assert self.trigger is not None
        self.text += self.grammars.piece(token)
        at = self.text.find(self.trigger)
        if at < 0:
            self.text = self.text[-4 * len(self.trigger):]
            return
        matcher = self.grammars.matcher(self.lark)
        tid = self.grammars.special_id(self.trigger)
        tail = self.text[at:]
        if tid is not None and tid == token:
            tokens: Iterable[int] = [token]
        else:
            tokens = self.grammars.tokenizer.tokenize_str(tail)
        if not matcher.consume_tokens(list(tokens)):
            raise UsageError(f"the grammar does not start with its trigger {self.trigger!r}: {matcher.get_error()}")
        self.matcher = matcher
