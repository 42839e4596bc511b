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

# Near the end of a constrained reply's budget (the last _LOOKAHEAD tokens), a closing path is
# looked for at each step; when it needs all but _MARGIN of the tokens left, the likeliest
# _CANDIDATES allowed tokens are checked for room to finish after them.
_LOOKAHEAD = 512
_MARGIN = 8
_CANDIDATES = 8
# Closers outside a string (brackets before a new string or number) and inside one.
_OUTSIDE = '}]"0,:tfn-.1{[ a'
_INSIDE = '"a0}],:tfn-.1{[ '
# Then any printable character (a choice or a pattern that starts with none of the above).
_ANY = "".join(chr(c) for c in range(32, 127))
# The order of preference among characters that close equally well: plain text first.
_PLAIN = "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ._-"


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
        self._closers: tuple[list[int], list[int], list[int], int | None] | None = None

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

    def state(self, lark: str | None, trigger: str | None, budget: int | None = None) -> GrammarState | None:
        """A sequence's constraint; with a budget (the most tokens the reply may have), the reply is
        steered to a complete parse before the budget ends."""
        if lark is None:
            return None
        matcher = self.matcher(lark)  # compile now: a bad grammar fails this request before it runs
        return GrammarState(self, lark, trigger, None if trigger else matcher, budget)

    def closers(self) -> tuple[list[int], list[int], list[int], int | None]:
        """Single-character tokens tried, in order, to close a reply: outside a string, inside
        one, then any printable character, and the token of a letter (allowed almost only inside
        strings)."""
        if self._closers is None:
            tokenize = self.tokenizer.tokenize_str

            def ids(chars: str) -> list[int]:
                out = []
                for c in chars:
                    t = tokenize(c)
                    if len(t) == 1 and t[0] not in out:
                        out.append(t[0])
                return out

            letter = ids("a")
            self._closers = (ids(_OUTSIDE), ids(_INSIDE), ids(_ANY), letter[0] if letter else None)
        return self._closers

    def closing(self, matcher: Any, limit: int) -> list[int] | None:
        """A short token path from matcher's state to one where the grammar is complete, or None
        when none of at most `limit` tokens is found: the first allowed closer (a quote, a
        bracket, a digit...) at each step, else the most constraining character at each step."""
        return self._greedy_closing(matcher, limit) or self._narrowing_closing(matcher, limit)

    def _narrowing_closing(self, matcher: Any, limit: int) -> list[int] | None:
        """A closing path through grammars whose free text never ends by itself (a JSON string
        that must match a pattern: a freeform tool's patch of lines). A depth-first search over
        printable characters that tries first the one leaving the fewest characters allowed after
        it (a line's end, a section's marker), takes forced text whole, and never returns to a
        state it has passed (known by the characters it allows), so it cannot circle in a line."""
        _, _, anything, _ = self.closers()
        tokenize = self.tokenizer.tokenize_str

        def anything_by(chars: str) -> list[int]:
            return [t[0] for t in map(tokenize, chars) if len(t) == 1]

        backslash = next((t for t in anything if self.tokenizer.decode_str([t]) == "\\"), None)
        unicode = next((t for t in anything if self.tokenizer.decode_str([t]) == "u"), None)

        newline = anything_by("n")

        def signature(m: Any) -> tuple[tuple[int, ...], ...]:
            """The characters allowed next, after a backslash (in JSON text, which escapes follow)
            and after an escaped newline (what the next line may be): a state's identity here."""
            now = tuple(u for u in anything if m.validate_tokens([u]) == 1)
            if backslash is None or backslash not in now:
                return (now,)
            escaped = m.deep_copy()
            escaped.consume_token(backslash)
            after = tuple(u for u in anything if escaped.validate_tokens([u]) == 1)
            if not newline or newline[0] not in after:
                return now, after
            escaped.consume_token(newline[0])
            return now, after, tuple(u for u in anything if escaped.validate_tokens([u]) == 1)

        def advance(m: Any, path: list[int]) -> Any:
            """Take what is forced: the grammar's forced tokens, and a character that is the only one allowed."""
            while not m.is_accepting():
                forced = m.compute_ff_tokens()
                if not forced:
                    only = [u for u in anything if m.validate_tokens([u]) == 1]
                    if len(only) != 1 or only[0] == backslash:  # an escape is the search's to choose
                        break
                    forced = only
                m.consume_tokens(forced)
                path.extend(forced)
            return m

        path: list[int] = []
        state = advance(matcher.deep_copy(), path)
        seen = {signature(state)}
        stack: list[tuple[Any, list[int], list[tuple[int, int, Any, list[int]]]]] = []
        rank = {t: i for i, t in enumerate(anything_by(_PLAIN))}  # among equals: a letter, a digit...
        budget = 4096  # states looked at, at most: a search that wanders gives up
        while budget > 0:
            if state.is_accepting():
                return path
            if len(path) > limit or state.is_stopped() or state.is_error():
                options: list[tuple[int, int, Any, list[int]]] = []
            else:
                options = []
                for t in anything:
                    if state.validate_tokens([t]) != 1:
                        continue
                    budget -= 1
                    steps = [[t]]
                    if t == backslash:  # an escape is weighed by the character it writes (\uXXXX: none needed)
                        escaped = state.deep_copy()
                        escaped.consume_token(t)
                        steps = [[t, e] for e in anything if e != unicode and escaped.validate_tokens([e]) == 1]
                    for step in steps:
                        after, extra = state.deep_copy(), list(step)
                        after.consume_tokens(step)
                        advance(after, extra)
                        if after.is_accepting():
                            return path + extra
                        sig = signature(after)
                        if sig not in seen:
                            options.append((len(sig[0]), rank.get(step[-1], 99), after, extra))
                options.sort(key=lambda o: (o[0], o[1]), reverse=True)
            stack.append((state, path, options))
            while stack and not stack[-1][2]:
                stack.pop()
            if not stack:
                return None
            _, base, pending = stack[-1]
            _, _, state, extra = pending.pop()
            seen.add(signature(state))
            path = base + extra
        return None

    def _greedy_closing(self, matcher: Any, limit: int) -> list[int] | None:
        m = matcher.deep_copy()
        outside, inside, anything, letter = self.closers()
        path: list[int] = []
        while not m.is_accepting():
            if len(path) > limit or m.is_stopped() or m.is_error():
                return None
            forced = m.compute_ff_tokens()
            if forced:
                m.consume_tokens(forced)
                path.extend(forced)
                continue
            in_text = letter is not None and m.validate_tokens([letter]) == 1
            for t in [*(inside if in_text else outside), *anything]:
                if m.validate_tokens([t]) == 1:
                    m.consume_token(t)
                    path.append(t)
                    break
            else:
                return None
        return path


class GrammarState:
    """One sequence's constraint: inactive until its trigger, then a matcher that masks tokens.

    With a budget, the last tokens are kept on a path to a complete parse: near the end, only
    those of the model's likeliest allowed tokens after which the reply can still be closed in
    the tokens left stay allowed (or the first step of a closing path when none can), so a reply
    cut by its budget still parses (and still says finish_reason "length").
    """

    __slots__ = ("grammars", "lark", "trigger", "matcher", "text", "consumed", "budget", "broken", "_bits", "_path",
                 "_recheck")

    def __init__(self, grammars: Grammars, lark: str, trigger: str | None, matcher: Any,
                 budget: int | None = None) -> None:
        self.grammars = grammars
        self.lark = lark
        self.trigger = trigger
        self.matcher = matcher
        self.text = ""  # output so far, while waiting for the trigger
        self.consumed = 0  # tokens seen (the MLX processor counts with it)
        self.budget = budget
        self.broken = False  # a token the grammar refused was taken (tokenizers that disagree)
        self._bits: Any = None
        self._path: list[int] | None = None  # the closing path from the matcher's state, while known
        self._recheck = 0  # the token count before which no closing is looked for

    @property
    def active(self) -> bool:
        return self.matcher is not None

    def allowed(self, logits: Callable[[], Any] | None = None) -> Any:
        """A boolean numpy array over the vocabulary: the tokens the grammar allows next, and, near
        the end of the budget, that leave room to finish. `logits` gives this step's logits (a
        numpy vector), read only near the end."""
        import numpy as np

        if self._bits is None:
            self._bits = np.zeros((1, (self.grammars.n_vocab + 31) // 32), dtype=np.int32)
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.grammars.n_vocab].astype(bool)
        if self.budget is None or self.budget - self.consumed > _LOOKAHEAD:
            return mask
        return self._finishing(mask, self.budget - self.consumed, logits)

    def _finishing(self, mask: Any, left: int, logits: Callable[[], Any] | None) -> Any:
        import numpy as np

        grammars = self.grammars
        if self._path is None and self.consumed < self._recheck:
            return mask  # the last closing found left room: not looked for again before then
        path = self._path = self._path if self._path is not None else grammars.closing(self.matcher, left)
        if path is None or len(path) + _MARGIN < left:
            # a token lengthens a closing by a few characters at most: look again when a quarter
            # of the room is spent
            self._recheck = self.consumed + ((left - len(path) - _MARGIN) // 4 if path is not None else 16)
            self._path = None
            return mask
        keep: list[int] = []
        if logits is not None:
            scores = np.where(mask, np.asarray(logits(), dtype=np.float32)[: mask.shape[0]], -np.inf)
            top = np.argsort(-scores)[:_CANDIDATES]
            for t in (int(t) for t in top if np.isfinite(scores[t])):
                after = self.matcher.deep_copy()
                if not after.consume_token(t) or after.is_stopped():
                    keep.append(t)  # an end-of-generation token: the reply is complete
                    continue
                rest = path[1:] if path and t == path[0] else grammars.closing(after, left - 1)
                if rest is not None and len(rest) <= left - 1:
                    keep.append(t)
        if not keep:  # the first step of the closing path; when complete, the end of generation
            keep = [path[0]] if path else list(grammars.tokenizer.eos_tokens)
        out = np.zeros_like(mask)
        out[keep] = True
        return out & mask if mask[keep].any() else mask

    def breaks(self, token: int, end: bool) -> bool:
        """Whether taking token (end: an end-of-generation token, not yet fed to the grammar)
        leaves the constraint broken: a refused token, or an end before the output is complete."""
        if self.broken:
            return True
        return end and self.matcher is not None and not self.matcher.is_stopped() and not self.matcher.is_accepting()

    def mask_logits(self, logits: Any) -> None:
        """Forbid, in place, every token the grammar does not allow (a numpy float array)."""
        if self.matcher is not None:
            logits[~self.allowed(lambda: logits)] = -float("inf")

    def accept(self, token: int) -> None:
        self.consumed += 1
        if self.matcher is not None:
            # A token on the closing path leaves the rest of it as the new state's closing path.
            path, self._path = self._path, None
            if not self.matcher.is_stopped() and not self.matcher.consume_token(token):
                self.broken = True
            elif path and path[0] == token:
                self._path = path[1:]
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
