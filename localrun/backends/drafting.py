"""Speculative decoding's drafts: tokens guessed cheaply, then verified by the model in one batch.

Prompt lookup drafts the tokens that followed the latest earlier occurrence of the sequence's last
n-gram in its own prompt and reply (code edits and rewrites repeat their input). The engine
evaluates the drafts after the sequence's next token in the same batched decode as the other
sequences' steps, samples each position as it would without drafts, and keeps drafts while the
sample equals them: the reply is the one the model gives without speculation (a draft that is one
token, not a distribution, needs no other acceptance rule).

Each sequence's `DraftControl` sizes its drafts from the acceptance it measures and stops drafting
when drafts cost more than they save, so a reply that does not repeat its input decodes as fast
as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass

NGRAM_MAX = 4  # the longest n-gram looked up; shorter ones are tried when it is not found
NGRAM_MIN = 2
# Until a sequence has kept a draft, lookup drafts only after a match this long (llama.cpp's n-gram
# drafter always asks for 3): two tokens seen before ("of the", "a message") recur all through
# prose, where what followed them once rarely follows again; a rewrite matches longer n-grams at once.
TRIAL_NGRAM = 3
WINDOW = 8192  # tokens of history searched (the most recent)
EXPLORE_EVERY = 8  # while sequences draft, every 8th step drafts nothing (StepCost then sees steps of both sizes)
MIN_GAIN = 1.2  # drafting starts only where drafts, all kept, would decode this much faster


def worth_drafting(min_rate: float, draft_max: int) -> bool:
    """Whether drafts of draft_max tokens, all kept, would decode MIN_GAIN times as fast as
    without drafts, when a drafted token costs min_rate of what a kept one saves: a step then
    gives 1 + draft_max tokens for the cost of 1 + min_rate x draft_max. Where drafts cost nearly
    what they save (min_rate near 1), the best case gains little and the usual case loses."""
    return 1 + draft_max >= MIN_GAIN * (1 + min_rate * draft_max)


def lookup(history: list[int], n_max: int, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> list[int]:
    """Up to n_max tokens that followed the latest earlier occurrence of history's last n-gram
    (the longest n from ngram_max down to ngram_min that occurs); [] when none does."""
    size = len(history)
    if n_max <= 0 or size <= ngram_min:
        return []
    start = max(0, size - WINDOW)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        tail = history[size - n:]
        first = tail[0]
        # the latest match whose continuation is inside the history, searched backwards
        i = size - n - 1
        while i >= start:
            if history[i] == first and history[i:i + n] == tail:
                follow = history[i + n:i + n + n_max]
                if follow:
                    return follow
            i -= 1
    return []


class PromptLookup:
    """lookup() over a growing history, indexed: each n-gram's latest end position is kept as the
    history grows, so a draft costs a few dictionary reads however long the prompt."""

    def __init__(self, history: list[int] | None = None, ngram_max: int = NGRAM_MAX, ngram_min: int = NGRAM_MIN) -> None:
        self.history: list[int] = []
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> end position (exclusive) of its latest occurrence
        self._before: dict[int, int] = {}  # n -> where the history's last n-gram occurred before, if it did
        self.extend(history or [])

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        for tok in tokens:
            h.append(tok)
            end = len(h)
            before = self._before
            before.clear()
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                gram = tuple(h[end - n:])
                prev = self._last.get(gram)
                if prev is not None:
                    before[n] = prev
                self._last[gram] = end

    def draft(self, n_max: int, ngram_min: int | None = None) -> list[int]:
        """As lookup(self.history, n_max), from a match of at least ngram_min tokens (default: the
        lookup's own minimum)."""
        if n_max <= 0:
            return []
        for n in range(self.ngram_max, max(self.ngram_min, ngram_min or 0) - 1, -1):
            prev = self._before.get(n)
            if prev is not None:
                return self.history[prev:prev + n_max]
        return []


@dataclass
class DraftControl:
    """One sequence's drafting: how many tokens to draft next, from the acceptance measured so far.

    Drafts start at `start` tokens, double after a step whose draft was wholly accepted and shrink
    to what was accepted plus one (at least draft_min) after one that was not. A drafted token
    costs the model a position in its batch (and a draft model's decode); `min_rate` is the share
    of drafted tokens that must be kept to pay for that (the engine updates it from measured step
    costs). The sequence stops drafting when fewer were kept over its last `window` drafted
    tokens, or fewer than half that share as soon as it has drafted a quarter of a window (at
    least 4), so a reply that does not repeat its input decodes about as fast as without speculation.
    """

    draft_max: int = 8
    draft_min: int = 1
    min_rate: float = 0.3
    window: int = 16
    start: int = 4
    always: bool = False  # draft whatever it costs (the length still follows acceptance)
    size: int = 0  # the next draft's length (0: start)
    drafted: int = 0  # over the reply
    accepted: int = 0
    recent_drafted: int = 0
    recent_accepted: int = 0
    off: bool = False

    def __post_init__(self) -> None:
        self.size = self.size or max(self.draft_min, min(self.start, self.draft_max))

    @property
    def ngram_min(self) -> int | None:
        """The shortest match prompt lookup may draft from now: TRIAL_NGRAM until the sequence
        has kept a draft, then the lookup's own minimum (None)."""
        return None if self.accepted else TRIAL_NGRAM

    def wanted(self, room: int) -> int:
        """How many tokens to draft now, within room (the reply's budget and the context left)."""
        if self.off:
            return 0
        n = min(self.size, room)
        return n if n >= self.draft_min else 0

    def record(self, drafted: int, accepted: int) -> None:
        """A verified draft: how many tokens were drafted and how many of them the model kept."""
        if drafted <= 0:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.recent_drafted += drafted
        self.recent_accepted += accepted
        if accepted == drafted:
            self.size = min(self.draft_max, self.size * 2)
        else:
            self.size = max(self.draft_min, accepted + 1)
        early = max(4, self.window // 4)
        if self.always:
            pass
        elif self.recent_drafted >= early and self.recent_accepted < self.min_rate * self.recent_drafted / 2:
            self.off = True  # clearly not paying: no need to wait for the whole window
        elif self.recent_drafted >= self.window:
            if self.recent_accepted < self.min_rate * self.recent_drafted:
                self.off = True
            self.recent_drafted = self.recent_accepted = 0


class DraftRecord:
    """What drafting gave the engine's recent sequences, for one drafter: a new sequence does not
    pay a trial draft where the sequences before it found that drafting does not pay.

    A draft model's trial is not free (its first drafts, and its KV cache catching up with the
    prompt) and its acceptance says more about the two models and the machine than about the
    prompt, so after `failures` sequences in a row turned their drafting off (DraftControl.off),
    only every 2**failures-th new sequence (at most every BACKOFF_MAX-th) drafts, to measure again:
    costs change with the load and replies differ. A sequence whose drafting lasted a window
    without turning off starts the count over; one too short to tell changes nothing."""

    BACKOFF_MAX = 16

    def __init__(self) -> None:
        self.failures = 0
        self.skipped = 0  # new sequences that did not draft since the last one that did

    def starts(self) -> bool:
        """Whether a new sequence drafts (the record counts the answer)."""
        if self.failures and self.skipped + 1 < min(2 ** self.failures, self.BACKOFF_MAX):
            self.skipped += 1
            return False
        self.skipped = 0
        return True

    def finished(self, control: DraftControl) -> None:
        """A sequence that drafted has finished (or stopped drafting): what its drafting showed."""
        if control.always or control.drafted == 0:
            return
        if control.off:
            self.failures = min(self.failures + 1, 8)
        elif control.drafted >= control.window:
            self.failures = 0


class StepCost:
    """What a step of the model costs, fitted as seconds = a + b x positions over its recent steps
    without prompt tokens (a: reading the weights once; b: each position in the batch), so that
    drafting can be weighed: a sequence's drafted token costs b in the model's step (plus the draft
    model's time for it, if any) and saves a step's share of one sequence, (a + b n) / n, when kept."""

    DECAY = 0.97  # each step's weight in the fit against the next one's: about the last 30 steps count

    def __init__(self) -> None:
        self.w = self.sp = self.st = self.spp = self.spt = 0.0
        self.slope: float | None = None  # b as last measured: kept while the recent steps are all one size

    def record(self, positions: int, seconds: float) -> None:
        k = self.DECAY
        self.w, self.sp, self.st = self.w * k + 1, self.sp * k + positions, self.st * k + seconds
        self.spp, self.spt = self.spp * k + positions * positions, self.spt * k + positions * seconds
        if self.w >= 3:
            mp, mt = self.sp / self.w, self.st / self.w
            var = self.spp / self.w - mp * mp
            if var > 0.25:  # steps of different sizes: the slope is measured
                self.slope = min(max((self.spt / self.w - mp * mt) / var, 0.0), mt / max(mp, 1))

    def fit(self) -> tuple[float, float] | None:
        """(a, b), or None before there are steps to fit."""
        if self.w < 3:
            return None
        mp, mt = self.sp / self.w, self.st / self.w
        # Recent steps of one size do not tell the slope: it is the one measured last (drafted steps
        # long gone from the window still cost what they cost), or, never measured, a tenth of a
        # step per position.
        b = min(self.slope if self.slope is not None else mt / max(mp, 1) / 10, mt / max(mp, 1))
        return max(mt - b * mp, 0.0), b

    def min_rate(self, sequences: int, draft_seconds: float, default: float) -> float:
        """The share of drafted tokens that must be kept for drafting to pay, for one of `sequences`
        decoding together whose drafted tokens each take draft_seconds to make (0 for lookup)."""
        fitted = self.fit()
        if fitted is None:
            return default
        a, b = fitted
        n = max(1, sequences)
        return (b + draft_seconds) * n / max(a + b * n, 1e-9)
