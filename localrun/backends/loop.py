"""The engine loop: one scheduler per loaded model, written once for every engine.

Requests arrive at any moment (`submit`) and wait in a queue; each step admits waiting requests
into free sequence slots (continuous batching, as llama-server's slots do), advances every
running sequence with one engine step (generating sequences and the next chunk of each new
prompt in the same forward pass), and turns sampled tokens into text. Everything above the
engine's step is here: prefix reuse across requests, stop strings, token budgets, the context
limit, incremental UTF-8, cancellation, statistics.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

from localrun.backends.base import Cancel, Engine, Sampled, engines_with
from localrun.backends.host_cache import HostCache, common_prefix, default_bytes
from localrun.chat import StopMatcher
from localrun.errors import (
    ContextOverflowError,
    EngineError,
    LocalrunError,
    ServerBusyError,
    UsageError,
)
from localrun.generation import Chunk, Request, TokenLogprob
from localrun.reasoning import Splitter
from localrun.settings import GenerationParams
from localrun.tools.lark import after_thought


class Sink(Protocol):
    """Where the loop sends what each request produces."""

    def text(self, rid: Any, text: str, logprobs: list[TokenLogprob], thinking: str = "") -> None:
        """New answer text and, for a thinking model, new thought ("" when there is none)."""
        ...

    def done(self, rid: Any, final: Chunk, text: str | None, logprobs: list[TokenLogprob] | None = None) -> None:
        """The request ended; text is the whole reply for requests submitted with stream=False
        (its thought, if any, is final.thinking; logprobs, each of its tokens' if it asked)."""
        ...

    def error(self, rid: Any, error: LocalrunError) -> None: ...

    def admitted(self, rid: Any, prompt_tokens: int, cached_tokens: int) -> None:
        """The request took a slot: its prompt's size and how much of it the KV cache held (sent
        only for requests submitted with report=True)."""
        ...




class _Job:
    """One request: queued, then running in a slot."""

    __slots__ = ("rid", "tokens", "params", "stops", "stream", "seed", "matcher", "detok", "parts", "lps",
                 "slot", "n_gen", "budget", "generated", "t0", "t1", "sampled", "reused", "lora", "split",
                 "thought", "n_thought", "closing", "drafts", "images", "cells", "report")

    def __init__(self, rid: Any, tokens: list[int], params: GenerationParams, stops: list[str], stream: bool,
                 n_ctx: int, split: Splitter | None = None, closing: str = "", cells: int | None = None) -> None:
        self.rid = rid
        self.cells = len(tokens) if cells is None else cells  # KV cells the prompt fills (an image: its embeddings)
        self.tokens = tokens
        self.params = params
        self.stops = stops
        self.stream = stream
        self.seed = params.seed if params.seed is not None else random.getrandbits(32)
        self.matcher = StopMatcher(stops)
        self.detok: Any = None
        self.parts: list[str] = []
        self.lps: list[TokenLogprob] = []
        self.slot = -1
        self.n_gen = 0
        self.budget = params.budget(n_ctx, self.cells)
        self.generated: list[int] = []
        self.t0 = self.t1 = 0.0
        self.sampled = False
        self.reused = 0
        self.lora = params.lora  # the adapters it runs with: only jobs with the same ones share a step
        self.split = split  # a thinking model's splitter: thought apart from answer
        self.thought: list[str] = []  # the whole thought, for requests submitted with stream=False
        self.n_thought = 0  # tokens generated inside the thought
        self.closing = closing  # what ends the thought at its budget ("" once inserted)
        self.drafts = (0, 0)  # speculative decoding: tokens drafted, and kept, over the reply
        self.images = 0  # images its prompt evaluation encoded (not those found in the KV cache)
        self.report = False  # tell the sink when it is admitted (Sink.admitted)


class EngineLoop:
    """Schedules requests over an engine's sequence slots; call step() while busy."""

    def __init__(self, engine: Engine, sink: Sink, max_queue: int = 0, cache_ram: int | None = None) -> None:
        """cache_ram: MiB of host memory for evicted prefixes (HostCache; None: the default, 0: none)."""
        self.engine = engine
        self.sink = sink
        self.max_queue = max_queue  # 0: unbounded
        self.queue: deque[_Job] = deque()
        self.slots: list[_Job | None] = [None] * engine.n_slots
        self.cached: list[list[int]] = [[] for _ in range(engine.n_slots)]  # tokens in each slot's KV cache
        self.cached_lora: list[Any] = [() for _ in range(engine.n_slots)]  # the adapters that cache was made with
        self.last_used = [0] * engine.n_slots  # when each slot last took a request (0: never)
        self._admitted = 0
        self.jobs: dict[Any, _Job] = {}
        self.prompt_tokens = 0  # evaluated, over the loop's life
        self.completion_tokens = 0
        # Copying a KV stream copies all of its cells: worth it only when it saves real work.
        self.min_copy_gain = max(4, engine.n_ctx // 256)
        # A slot's cache that a new request would throw away goes to host memory when at least this
        # many tokens of it would be lost (copying the state out costs less than evaluating them).
        self.min_save = 256
        limit = (default_bytes() if cache_ram is None else cache_ram << 20) if engine.can_save else 0
        self.host = HostCache(limit)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.running() > 0

    def running(self) -> int:
        return sum(j is not None for j in self.slots)

    # -- requests -------------------------------------------------------------------------
    def submit(self, rid: Any, request: Request, params: GenerationParams, stream: bool = True,
               report: bool = False) -> None:
        """Queue a request; an error (bad prompt, context overflow, full queue) goes to the sink.
        With report, the sink hears when it is admitted (its prompt's size and cached part)."""
        try:
            free = len(self.slots) - self.running()
            if self.max_queue and len(self.queue) >= self.max_queue + free:
                raise ServerBusyError(f"all {len(self.slots)} sequences are busy and {len(self.queue)} requests wait",
                                      "retry later, or start the server with a larger --parallel or --max-queue")
            if params.speculative and not self.engine.abilities.drafting:
                raise UsageError(f"speculative decoding ('{params.speculative}') is not available on this engine",
                                 f"drop --draft, or use the {' or '.join(engines_with('drafting')) or 'other'} engine")
            beyond = [t for t, _ in params.logit_bias if t >= self.engine.n_vocab]
            if beyond:
                raise UsageError(f"logit_bias names token {beyond[0]}, and the vocabulary has {self.engine.n_vocab}",
                                 f"use token ids below {self.engine.n_vocab}")
            if params.lora and not self.engine.abilities.request_adapters:
                raise UsageError("this engine applies LoRA adapters when the model loads, not per request",
                                 "load the model with the adapter (--lora when it loads), or use "
                                 f"the {' or '.join(engines_with('request_adapters')) or 'other'} engine")
            stops = list(params.stop)
            tokens = self.engine.prompt_tokens(request, stops)
            n_ctx = self.engine.n_ctx
            cells = self._cells(tokens)
            if cells >= n_ctx:
                raise ContextOverflowError(f"the prompt is {cells} tokens but the context holds {n_ctx}",
                                           "use a larger --ctx or a shorter prompt")
            split, params = self._thinking(request, tokens, params)
        except LocalrunError as e:
            self.sink.error(rid, e)
            return
        fmt = self.engine.reasoning
        closing = fmt.closing_text if split is not None and fmt is not None and params.think_budget is not None else ""
        job = _Job(rid, tokens, params, stops, stream, n_ctx, split, closing, cells)
        job.report = report
        self.jobs[rid] = job
        self.queue.append(job)

    def _cells(self, tokens: list[int]) -> int:
        """The KV cells a prompt fills: its tokens, where an image counts its embeddings (an M-RoPE
        image takes fewer positions, and placeholders, than it has embeddings)."""
        return self.engine.prompt_cells(tokens) if tokens and min(tokens) < 0 else len(tokens)

    def _thinking(self, request: Request, tokens: list[int],
                  params: GenerationParams) -> tuple[Splitter | None, GenerationParams]:
        """A thinking model's chat reply gets a splitter; a grammar without a trigger (a schema) then
        lets the model think first, unless thinking is off."""
        fmt = self.engine.reasoning
        if fmt is None:
            return None, params
        detok = self.engine.detokenizer(True)
        # the prompt's last text (an image's placeholders have no text: the vocabulary has no such ids)
        tail = "".join(detok.feed(t) for t in tokens[-16:] if t >= 0) + detok.flush()
        inside = fmt.starts_inside(tail)
        if request.prompt is not None:  # raw: split only a thought the prompt or the reply opens
            return (fmt.splitter(True) if inside else fmt.raw_splitter()), params
        thinks = inside or request.think is not False or not fmt.can_switch_off
        if params.grammar is not None and params.grammar_trigger is None and thinks and fmt.closing and fmt.opening:
            params = dataclasses.replace(params, grammar=after_thought(params.grammar, fmt.opening[0], fmt.closing,
                                                                       inside, fmt.answer_head, fmt.closing_gap))
        return fmt.splitter(inside), params

    def cancel(self, rid: Any) -> None:
        """Stop one request (queued or running); the others go on undisturbed."""
        job = self.jobs.get(rid)
        if job is not None:
            self._end(job, "cancelled")

    def cancel_all(self) -> None:
        for job in list(self.jobs.values()):
            self._end(job, "cancelled")

    def fail_all(self, error: LocalrunError) -> None:
        """The engine failed: every request gets the error, and every slot starts afresh."""
        for job in list(self.jobs.values()):
            self._drop(job)
            self.sink.error(job.rid, error)
        self.cached = [[] for _ in self.slots]
        self.host.clear()

    # -- scheduling -------------------------------------------------------------------------
    def step(self) -> None:
        """Admit what fits, run one engine step, hand out the tokens."""
        if self.queue:
            self._admit()
        if not self.running():
            return
        try:
            sampled = self.engine.step()
        except LocalrunError as e:
            self.fail_all(e)
            return
        for s in sampled:
            self._token(s)

    def _sources(self, lora: Any) -> list[tuple[int, list[int]]]:
        """Slots whose KV cache holds a known prefix made with these adapters: idle ones, and
        running ones past their prompt."""
        out = []
        for s, job in enumerate(self.slots):
            if job is None:
                if self.cached_lora[s] == lora:
                    out.append((s, self.cached[s]))
            elif job.sampled and job.lora == lora:
                out.append((s, job.tokens))
        return out

    def _cache(self, slot: int, lora: Any) -> list[int]:
        """What the slot's KV cache holds, if it was made with these adapters (else nothing usable)."""
        return self.cached[slot] if self.cached_lora[slot] == lora else []

    def _next_group(self) -> list[_Job]:
        """The queued jobs to admit now: those with the running jobs' adapters, in order.

        Sequences decoded in one step share the context's adapters. While the oldest waiting job
        needs other adapters, nothing new is admitted, so the running group drains and that job's
        group goes next (no request waits forever behind a stream of others).
        """
        running = next((j.lora for j in self.slots if j is not None), None)
        lora = self.queue[0].lora if running is None else running
        if lora != self.queue[0].lora:
            return []
        return [j for j in self.queue if j.lora == lora]

    def _best(self, tokens: list[int], own: int, sources: list[tuple[int, list[int]]], lora: Any) -> tuple[int, int]:
        """(source slot, length) of the longest cached prefix of tokens for the free slot `own`,
        preferring its own cache."""
        limit = len(tokens) - 1  # the last prompt token is always evaluated: it gives the logits
        best, best_len = own, common_prefix(self._cache(own, lora), tokens, limit)
        if not self.engine.can_copy:
            return best, best_len
        for s, cached in sources:
            if s != own:
                n = common_prefix(cached, tokens, limit)
                if n >= best_len + self.min_copy_gain:
                    best, best_len = s, n
        return best, best_len

    def _slot_for(self, job: _Job, free: list[int], lora: Any) -> int:
        """The free slot for a request: the one whose cache shares the longest prefix with its
        prompt, unless taking it would throw away most of another conversation's cache for a short
        shared start (a system prompt, a template's header); then the least recently used one
        (where that shared start is copied, see _best), so that the other conversation's next turn
        still finds its cache."""
        limit = len(job.tokens) - 1
        shared = {s: common_prefix(self._cache(s, lora), job.tokens, limit) for s in free}
        best = max(free, key=lambda s: (shared[s], -self.last_used[s]))
        held = len(self.cached[best])
        if held == 0 or shared[best] * 2 >= held:
            return best
        return min(free, key=lambda s: self.last_used[s])

    def _admit(self) -> None:
        free = [s for s, j in enumerate(self.slots) if j is None]
        wave: list[tuple[int, _Job]] = []
        group = self._next_group()
        if not group or not free:
            return
        lora = group[0].lora
        if self.engine.abilities.request_adapters:
            try:
                self.engine.set_lora(lora)
            except LocalrunError as e:  # this group's adapter cannot load: its requests fail, the others go on
                for job in group:
                    self._drop(job)
                    self.sink.error(job.rid, e)
                return
        group = [j for j in group if not self._behind(j, lora)]
        for job in group[:len(free)]:
            self.queue.remove(job)
            slot = self._slot_for(job, free, lora)
            free.remove(slot)
            self._admitted += 1
            self.last_used[slot] = self._admitted
            wave.append((slot, job))
        taken = {slot for slot, _ in wave}
        sources = [(s, c) for s, c in self._sources(lora) if s not in taken]  # a wave member's cache may be trimmed
        for slot, job in wave:
            self._restore(slot, job, sources, lora)
        plan = {slot: self._best(job.tokens, slot, sources, lora) for slot, job in wave}
        if len(wave) > 1 and self.engine.can_copy:
            # The prefix these new requests share beyond what the caches hold: evaluate it once, then copy.
            lead_slot, lead = wave[0]
            shared = min(len(j.tokens) - 1 for _, j in wave)
            for _, j in wave[1:]:
                shared = common_prefix(lead.tokens, j.tokens, shared)
            if shared >= max(n for _, n in plan.values()) + self.min_copy_gain:
                own = common_prefix(self._cache(lead_slot, lora), lead.tokens, shared)
                self._save(lead_slot, own)
                self.engine.prefill(lead_slot, lead.tokens[:shared], own)
                self.prompt_tokens += shared - own
                self.cached[lead_slot] = lead.tokens[:shared]
                self.cached_lora[lead_slot] = lora
                plan = {slot: (lead_slot, shared) for slot, _ in wave}
        now = time.perf_counter()
        # Slots that copy from the lead go first: the lead's own start trims nothing they need.
        for slot, job in sorted(wave, key=lambda w: plan[w[0]][0] == w[0]):
            src, keep = plan[slot]
            job.t0 = now
            job.detok = self.engine.detokenizer(job.params.special)
            self._save(slot, keep if src == slot else 0)
            try:
                job.reused = self.engine.start(slot, job.tokens, job.params, job.seed, src, keep)
            except LocalrunError as e:  # this request's own fault (its grammar): the others go on
                self.jobs.pop(job.rid, None)
                self.cached[slot] = []
                self.sink.error(job.rid, e)
                continue
            job.slot = slot
            if job.report:
                cached = job.reused if job.cells == len(job.tokens) else self._cells(job.tokens[:job.reused])
                self.sink.admitted(job.rid, job.cells, cached)
            self.prompt_tokens += len(job.tokens) - job.reused
            self.cached[slot] = []
            self.slots[slot] = job
            self._budget(job)

    def _behind(self, job: _Job, lora: Any) -> bool:
        """Whether the job waits for a running request whose prompt, still being evaluated, starts
        as its own does (sub-agents sent at once with one system prompt and tools): once that
        prompt is evaluated the job copies the shared prefix instead of evaluating it beside it."""
        if not self.engine.can_copy:
            return False
        limit = len(job.tokens) - 1
        ahead = max((common_prefix(j.tokens, job.tokens, limit) for j in self.slots
                     if j is not None and not j.sampled and j.lora == lora), default=0)
        if ahead < self.min_save:
            return False
        held = max((common_prefix(c, job.tokens, limit) for _, c in self._sources(lora)), default=0)
        return ahead >= max(held, self.host.find(job.tokens, lora, limit)[1]) + self.min_save

    def _save(self, slot: int, keep: int) -> None:
        """Before the slot's cache is cut back to keep tokens: keep it in host memory if that loses
        enough of it, and no other slot or host entry holds it."""
        held = self.cached[slot]
        if len(held) - keep < self.min_save or not self.host.limit:
            return
        lora = self.cached_lora[slot]
        if self.host.covers(held, lora) or any(
                s != slot and len(c) >= len(held) and c[:len(held)] == held for s, c in self._sources(lora)):
            return
        saved = self.engine.save(slot)
        if saved is not None and self.host.fits(saved[1]):
            self.host.put(held, lora, saved[0], saved[1])

    def _restore(self, slot: int, job: _Job, sources: list[tuple[int, list[int]]], lora: Any) -> None:
        """Put a saved prefix into the job's slot when host memory holds more of its prompt than
        any slot does."""
        if not self.host.entries:
            return
        entry, n = self.host.find(job.tokens, lora, len(job.tokens) - 1)
        if entry is None or n < self._best(job.tokens, slot, sources, lora)[1] + max(self.min_copy_gain, 16):
            return
        self._save(slot, 0)
        if self.engine.restore(slot, entry.state):
            self.host.touch(entry)
            self.cached[slot], self.cached_lora[slot] = list(entry.tokens), lora
        else:
            self.cached[slot] = []

    # -- tokens -> text -------------------------------------------------------------------
    def _token(self, s: Sampled) -> None:
        job = self.slots[s.slot]
        if job is None:
            return
        if not job.sampled:
            job.sampled = True
            job.t1 = time.perf_counter()
        tok = s.token
        if s.broken:  # never an invalid reply called finished
            self._drop(job)
            self.sink.error(job.rid, EngineError(
                f"the reply broke its output constraint after {job.n_gen} tokens: the grammar engine and the "
                "model's tokenizer disagree", "report this model; it answers without --schema/--grammar"))
            return
        if self.engine.is_eog(tok):
            self._end(job, "stop")
            return
        job.n_gen += 1
        self.completion_tokens += 1
        job.generated.append(tok)
        if s.logprob is not None:
            job.lps.append(s.logprob)
        text = job.detok.feed(tok)
        thinking = ""
        if job.split is not None:
            was = job.split.in_thought
            part = job.split.feed(text)
            if was and job.split.in_thought:
                job.n_thought += 1
            thinking, text = part.thinking, part.answer + part.calls
            self._budget(job)
        out, hit = job.matcher.feed(text) if job.stops else (text, False)
        if out or thinking:
            self._emit(job, out, thinking)
        if hit:
            self._end(job, "stop", flush=False)
        elif job.n_gen >= job.budget:
            self._end(job, "length")

    def _budget(self, job: _Job) -> None:
        """A thought at its budget ends: the engine's next samples are the format's closing marker."""
        limit = job.params.think_budget
        if job.closing and limit is not None and job.split is not None and job.split.in_thought \
                and job.n_thought >= limit:
            self.engine.force(job.slot, self.engine.text_tokens(job.closing))
            job.closing = ""

    def _emit(self, job: _Job, text: str, thinking: str = "") -> None:
        if job.stream:
            lps, job.lps = job.lps, []
            self.sink.text(job.rid, text, lps, thinking)
        else:
            job.parts.append(text)
            job.thought.append(thinking)

    def _drop(self, job: _Job) -> None:
        """Take a request out of the queue or its slot; the slot's KV cache stays for reuse."""
        self.jobs.pop(job.rid, None)
        if job.slot >= 0 and self.slots[job.slot] is job:
            if job.params.speculative:
                job.drafts = self.engine.drafts(job.slot)
            if job.tokens and min(job.tokens) < 0:  # image placeholders: the engine counts what it encoded
                job.images = self.engine.images_encoded(job.slot)
            n = self.engine.finish(job.slot)
            self.cached[job.slot] = (job.tokens + job.generated)[:n]
            self.cached_lora[job.slot] = job.lora
            self.slots[job.slot] = None
        else:
            try:
                self.queue.remove(job)
            except ValueError:
                pass

    def _end(self, job: _Job, finish: str, flush: bool = True) -> None:
        self._drop(job)
        if finish != "cancelled" and flush:
            tail, thinking = job.detok.flush() if job.detok else "", ""
            if job.split is not None:
                part = job.split.feed(tail) + job.split.flush()
                tail, thinking = part.answer + part.calls, part.thinking
            tail = job.matcher.feed(tail)[0] + job.matcher.flush() if job.detok else ""
            if tail or thinking or job.lps:
                self._emit(job, tail, thinking)
        t_end = time.perf_counter()
        t0 = job.t0 or t_end
        reused = job.reused if job.cells == len(job.tokens) else self._cells(job.tokens[:job.reused])
        final = Chunk.final(finish, job.cells, job.n_gen, t0, job.t1 or t_end, t_end, job.seed, reused)
        if job.split is not None:
            final = dataclasses.replace(final, thinking="" if job.stream else "".join(job.thought),
                                        thinking_tokens=job.n_thought)
        if job.drafts != (0, 0):
            final = dataclasses.replace(final, drafted_tokens=job.drafts[0], accepted_tokens=job.drafts[1])
        if job.images:
            final = dataclasses.replace(final, images_encoded=job.images)
        if finish == "stop" and job.matcher.hit in job.params.stop:  # the request's own, not the template's
            final = dataclasses.replace(final, stop_sequence=job.matcher.hit)
        if job.stream:
            self.sink.done(job.rid, final, None)
        else:
            self.sink.done(job.rid, final, "".join(job.parts), job.lps)


class _Collect:
    def __init__(self, out: list[Chunk]) -> None:
        self.out = out
        self.failure: LocalrunError | None = None

    def text(self, rid: Any, text: str, logprobs: list[TokenLogprob], thinking: str = "") -> None:
        self.out.append(Chunk(text=text, thinking=thinking, logprobs=tuple(logprobs)))

    def done(self, rid: Any, final: Chunk, text: str | None, logprobs: list[TokenLogprob] | None = None) -> None:
        self.out.append(final)

    def error(self, rid: Any, error: LocalrunError) -> None:
        self.failure = error

    def admitted(self, rid: Any, prompt_tokens: int, cached_tokens: int) -> None:
        """Not asked for here (InProcess submits without report)."""


class InProcess:
    """An engine and its loop driven in this process, one request at a time (tests, benchmarks)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.out: list[Chunk] = []
        self.sink = _Collect(self.out)
        self.loop = EngineLoop(engine, self.sink)

    def tokenize(self, request: Request) -> list[int]:
        return self.engine.prompt_tokens(request, [])

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Iterator[Chunk]:
        loop, out = self.loop, self.out
        self.sink.failure = None
        loop.submit(0, request, params)
        try:
            while True:
                if cancel is not None and cancel.is_set() and 0 in loop.jobs:
                    loop.cancel(0)
                if self.sink.failure is not None:
                    raise self.sink.failure
                while out:
                    chunk = out.pop(0)
                    yield chunk
                    if chunk.done:
                        return
                loop.step()
        finally:
            if 0 in loop.jobs:
                loop.cancel(0)
            out.clear()

    def close(self) -> None:
        self.engine.close()
