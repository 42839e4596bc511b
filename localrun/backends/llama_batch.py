"""Batched generation on llama.cpp: many rows as parallel sequences of one context.

Every step is one llama_decode over the next token of each generating sequence plus the prompt
tokens of newly admitted rows (batched prompt processing, as llama-server does). A prompt prefix
already in the KV cache of any sequence (a system prompt, the chat template's header) is copied
with llama_memory_seq_cp instead of being evaluated again; the prefix shared by a wave of new rows
is evaluated once. Each sequence has its own native sampler chain, seeded per row.
"""

from __future__ import annotations

import codecs
import random
import time
from collections import deque
from collections.abc import Generator, Iterator
from typing import Any

from localrun.backends.base import Cancel
from localrun.chat import StopMatcher
from localrun.generation import GenerationParams, Request

PROGRESS_EVERY_S = 0.25
MIN_COPY_GAIN = 4  # copying a KV stream costs about as much as evaluating a few tokens


def _lcp(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of a and b, at most limit."""
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class _Row:
    """One row being generated in one sequence (slot)."""

    __slots__ = ("key", "tokens", "params", "stops", "sampler", "seed", "matcher", "utf8", "parts", "todo",
                 "n_gen", "budget", "last")

    def __init__(self, key: Any, tokens: list[int], params: GenerationParams, stops: list[str], n_ctx: int) -> None:
        self.key = key
        self.tokens = tokens
        self.params = params
        self.stops = stops
        self.sampler: Any = None
        self.seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.matcher = StopMatcher(stops)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.parts: list[str] = []
        self.todo = 0  # index of the next prompt token to evaluate
        self.n_gen = 0
        self.budget = params.max_tokens if params.max_tokens is not None else n_ctx
        self.last = -1  # the sampled token that the next step evaluates

    def result(self, finish: str) -> dict[str, Any]:
        tail = self.matcher.flush() + self.utf8.decode(b"", final=True)
        text = "".join(self.parts) + tail
        return {"id": self.key, "text": text, "finish_reason": finish, "prompt_tokens": len(self.tokens),
                "completion_tokens": self.n_gen, "seed": self.seed}


class BatchScheduler:
    """Runs rows through an Engine's parallel sequences; yields events as rows finish."""

    def __init__(self, engine: Any) -> None:
        self.e = engine
        self.ll = engine.ll
        self.n_slots = 0
        self.n_batch = 0
        self.cached: list[list[int]] = []  # the tokens in each sequence's KV cache
        self.active: list[_Row | None] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.reused_tokens = 0

    def run(self, rows: list[dict[str, Any]], defaults: dict[str, Any], cancel: Cancel | None) -> Iterator[dict[str, Any]]:
        """rows: {"id", "request", "params"?}; yields {"row": ...}, {"progress": ...}, then {"done": ...}."""
        t0 = time.perf_counter()
        queue: deque[_Row] = deque()
        for raw in rows:
            row = self._prepare(raw, defaults)
            if isinstance(row, dict):
                yield {"row": row}
            else:
                queue.append(row)
        cancelled = False
        if queue:
            self._setup(list(queue))
            cancelled = yield from self._loop(queue, cancel)
        yield {"done": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                        "reused_tokens": self.reused_tokens, "parallel": self.n_slots, "cancelled": cancelled,
                        "seconds": time.perf_counter() - t0}}

    def _setup(self, rows: list[_Row]) -> None:
        """Size the context to the batch: no more sequences than rows (or than half the free RAM
        holds), each no longer than its rows can grow."""
        from localrun.errors import EngineError

        e = self.e
        need = max(min(len(r.tokens) + r.budget, e.n_ctx) for r in rows)
        size = min(e.n_ctx, -(-need // 256) * 256)
        n_slots = min(e.options.n_parallel, len(rows), self._slots_in_ram(size))
        while e.ctx is None or e.n_parallel != n_slots or e.seq_ctx != size:
            try:
                e.make_context(size, n_slots)
            except EngineError:
                if n_slots == 1:
                    raise
                n_slots //= 2  # not enough memory for that many sequences: fewer at once
        self.ll.llama_memory_clear(e.mem, True)
        self.n_slots, self.n_batch = n_slots, e.n_batch
        self.cached = [[] for _ in range(n_slots)]
        self.active = [None] * n_slots

    def _slots_in_ram(self, size: int) -> int:
        """How many sequences of size tokens an f16 KV cache fits in half the available RAM."""
        from localrun.system import ram_bytes

        e, ll = self.e, self.ll
        available = ram_bytes()[1]
        if not available or e.gpu_layers != 0:
            return 1 << 30  # on a GPU a failed allocation makes _setup retry with fewer
        n_head = max(1, ll.llama_model_n_head(e.model))
        per_token = 2 * 2 * ll.llama_model_n_layer(e.model) * ll.llama_model_n_embd(e.model) \
            * ll.llama_model_n_head_kv(e.model) // n_head
        return max(1, available // 2 // max(1, per_token * size))

    def _loop(self, queue: deque[_Row], cancel: Cancel | None) -> Generator[dict[str, Any], None, bool]:
        last_tick = time.perf_counter()
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    return True
                free = [s for s in range(self.n_slots) if self.active[s] is None]
                admitted = [(free[i], queue.popleft()) for i in range(min(len(free), len(queue)))]
                if admitted:
                    self._admit(admitted)
                if not any(self.active):
                    return False
                yield from self._step()
                now = time.perf_counter()
                if now - last_tick >= PROGRESS_EVERY_S:
                    last_tick = now
                    yield {"progress": {"prompt_tokens": self.prompt_tokens,
                                        "completion_tokens": self.completion_tokens}}
        finally:
            for s, row in enumerate(self.active):
                if row is not None and row.sampler is not None:
                    self.ll.llama_sampler_free(row.sampler)
                self.active[s] = None

    # -- admission --------------------------------------------------------------------------
    def _prepare(self, raw: dict[str, Any], defaults: dict[str, Any]) -> _Row | dict[str, Any]:
        """Tokenize one row; a row that cannot run becomes an error record."""
        from localrun.errors import LocalrunError

        key = raw.get("id")
        try:
            params = GenerationParams.from_dict(raw["params"] if raw.get("params") is not None else defaults)
            stops = list(params.stop)
            tokens = self.e.prompt_tokens(Request.from_dict(raw["request"]), stops) or [self.e.bos]
        except LocalrunError as err:
            return {"id": key, "error": str(err)}
        n_ctx = self.e.n_ctx
        if len(tokens) >= n_ctx:
            return {"id": key, "error": f"the prompt is {len(tokens)} tokens but the context holds {n_ctx}; "
                                        "use a larger --ctx or a shorter prompt"}
        return _Row(key, tokens, params, stops, n_ctx)

    def _best_source(self, slot: int, tokens: list[int]) -> tuple[int, int]:
        """(sequence, length) of the longest prefix of tokens in a KV cache, preferring slot's own."""
        limit = len(tokens) - 1  # the last prompt token is always evaluated: it gives the logits
        best, best_len = slot, _lcp(self.cached[slot], tokens, limit)
        for s, cached in enumerate(self.cached):
            if s != slot:
                n = _lcp(cached, tokens, limit)
                if n >= best_len + MIN_COPY_GAIN and n > 0:
                    best, best_len = s, n
        return best, best_len

    def _place(self, slot: int, row: _Row) -> None:
        """Make slot's sequence hold the longest prefix of row.tokens found in any KV cache."""
        mem, ll = self.e.mem, self.ll
        src, keep = self._best_source(slot, row.tokens)
        if src != slot:
            # Sequences live in separate KV streams, which llama.cpp copies only whole.
            ll.llama_memory_seq_rm(mem, slot, -1, -1)
            ll.llama_memory_seq_cp(mem, src, slot, -1, -1)
        ll.llama_memory_seq_rm(mem, slot, keep, -1)
        self.cached[slot] = row.tokens[:keep]
        row.todo = keep
        self.reused_tokens += keep

    def _admit(self, admitted: list[tuple[int, _Row]]) -> None:
        if len(admitted) > 1:
            # The prefix these new rows share beyond what the caches hold: evaluate it once, then copy.
            lead_slot, lead = admitted[0]
            shared = min(len(r.tokens) - 1 for _, r in admitted)
            for _, r in admitted[1:]:
                shared = _lcp(lead.tokens, r.tokens, shared)
            if shared >= max(self._best_source(s, r.tokens)[1] for s, r in admitted) + MIN_COPY_GAIN:
                self._place(lead_slot, lead)
                entries = [(lead.tokens[i], i, lead_slot, False) for i in range(lead.todo, shared)]
                for i in range(0, len(entries), self.n_batch):
                    self.e.decode(entries[i:i + self.n_batch])
                self.prompt_tokens += len(entries)
                self.cached[lead_slot] = lead.tokens[:shared]
                lead.todo = shared
        for slot, row in admitted:
            if row.todo == 0:
                self._place(slot, row)
            row.sampler = self.e.make_sampler(row.params, row.seed)
            self.active[slot] = row

    # -- one decode step ------------------------------------------------------------------
    def _step(self) -> Iterator[dict[str, Any]]:
        entries: list[tuple[int, int, int, bool]] = []
        owners: list[tuple[int, int]] = []  # (slot, batch index) of each entry that gives logits
        for s, row in enumerate(self.active):
            if row is not None and row.n_gen > 0:
                pos = len(row.tokens) + row.n_gen - 1
                owners.append((s, len(entries)))
                entries.append((row.last, pos, s, True))
                self.cached[s].append(row.last)
        room = self.n_batch - len(entries)
        for s, row in enumerate(self.active):
            if room <= 0:
                break
            if row is None or row.todo >= len(row.tokens):
                continue
            end = min(len(row.tokens), row.todo + room)
            last = len(row.tokens) - 1
            entries.extend((row.tokens[i], i, s, i == last) for i in range(row.todo, end))
            if end == len(row.tokens):
                owners.append((s, len(entries) - 1))
            self.cached[s].extend(row.tokens[row.todo:end])
            self.prompt_tokens += end - row.todo
            room -= end - row.todo
            row.todo = end
        self.e.decode(entries)
        yield from self._sample(owners)

    def _sample(self, owners: list[tuple[int, int]]) -> Iterator[dict[str, Any]]:
        ll, e = self.ll, self.e
        ctx, vocab = e.ctx, e.vocab
        for s, idx in owners:
            row = self.active[s]
            assert row is not None
            tok = ll.llama_sampler_sample(row.sampler, ctx, idx)
            finish = None
            if ll.llama_vocab_is_eog(vocab, tok):
                finish = "stop"
            else:
                row.n_gen += 1
                self.completion_tokens += 1
                text = row.utf8.decode(e.piece(tok))
                out, hit = row.matcher.feed(text) if row.stops else (text, False)
                if out:
                    row.parts.append(out)
                if hit:
                    finish = "stop"
                elif row.n_gen >= row.budget or len(row.tokens) + row.n_gen >= e.n_ctx:
                    finish = "length"
            if finish is None:
                row.last = tok
                continue
            ll.llama_sampler_free(row.sampler)
            row.sampler = None
            self.active[s] = None
            yield {"row": row.result(finish)}
