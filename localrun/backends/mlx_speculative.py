"""Speculative decoding on MLX: drafting sequences beside mlx-lm's BatchGenerator.

The generator decodes one token per sequence per step, and mlx-lm's own speculative generation
(`mlx_lm.generate.speculative_generate_step`) is a single stream with a fixed draft length and no
prompt lookup. A drafting sequence therefore runs beside the generator, with the same verification
on mlx-lm's model and cache: each engine step drafts for it (prompt lookup, or a draft model in MLX
format with the target's vocabulary), the model evaluates the sequence's next token and its drafts
in one forward pass over the sequence's own KV cache, each position is sampled as it would be
without drafts, drafts stand while the sample equals them, and the rest is cut from the cache
(`trim_prompt_cache`). Its DraftControl sizes the drafts and stops them when they do not pay.

A drafting sequence is verified in a forward pass of its own, so it drafts only while it decodes
alone: once other sequences decode too, or its drafting stops, it moves into the generator with
its KV cache, where it batches with them (--draft-always keeps it drafting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localrun.backends.base import Sampled
from localrun.backends.drafting import (
    EXPLORE_EVERY,
    DraftControl,
    PromptLookup,
    StepCost,
    worth_drafting,
)
from localrun.backends.llama_draft import DECAY, P_MIN, vocab_mismatch
from localrun.errors import BadModelFileError, UsageError
from localrun.generation import TokenLogprob

PREFILL_STEP = 2048  # prompt tokens evaluated per forward pass


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What llama.cpp's draft-model rule compares (llama_draft.vocab_mismatch), read from a
    Hugging Face tokenizer (or mlx-lm's wrapper of one)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    kind = type(backend.model).__name__ if backend is not None else type(hf).__name__
    vocab: dict[str, int] = hf.get_vocab()
    n = max(vocab.values()) + 1 if vocab else 0
    text = [b""] * n
    for piece, i in vocab.items():
        text[i] = piece.encode("utf-8", "replace")
    with_special, plain = list(hf.encode("a", add_special_tokens=True)), list(hf.encode("a", add_special_tokens=False))
    bos, eos = hf.bos_token_id, hf.eos_token_id
    return {"type": kind, "n": n, "text": text, "bos": bos, "eos": eos,
            "add_bos": bos is not None and with_special[:1] == [bos] and plain[:1] != [bos],
            "add_eos": eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos]}


@dataclass(eq=False)
class SpecSeq:
    """A sequence that drafts, outside the generator."""

    tokens: list[int]  # the prompt
    cache: list[Any]  # the model's KV cache for it
    sampler: Callable[[Any], Any]
    processors: list[Callable[[Any, Any], Any]]
    logprobs: int | None
    control: DraftControl
    room: int  # tokens the reply may still take
    seen: list[int]  # what the cache holds after the reused prefix (the logits processors' view)
    todo: int  # the next prompt position to evaluate
    pos: int  # tokens in the cache
    lookup: PromptLookup | None = None
    history: list[int] | None = None  # a draft model's: the prompt and the reply so far
    last: int = -1  # the latest sampled token, evaluated next (-1: the prompt is still evaluating)


class MLXDraftModel:
    """A draft model on MLX beside the target: one KV cache per slot, each following its sequence."""

    def __init__(self, path: str, name: str, target_tokenizer: Any, n_slots: int) -> None:
        import mlx_lm
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        self.name = name
        if not Path(path).is_dir():
            raise UsageError(f"draft model '{name}' is a GGUF file, and on MLX a draft model is an MLX folder",
                             "make an MLX copy of it with 'localrun convert MODEL --to mlx', or use --draft lookup")
        self.model: Any = None
        try:
            self.model, self.tokenizer = mlx_lm.load(path)[:2]
        except (FileNotFoundError, ValueError, KeyError, OSError) as e:
            raise BadModelFileError(f"cannot load draft model '{name}' ({path}): {e}",
                                    "an MLX model is a folder with config.json, *.safetensors and tokenizer files") from e
        reason = vocab_mismatch(tokenizer_facts(target_tokenizer), tokenizer_facts(self.tokenizer))
        if reason:
            raise UsageError(f"draft model '{name}' cannot draft for this model: {reason}",
                             "a draft model needs the target's vocabulary: pick a smaller model of the same "
                             "family, or use --draft lookup")
        if not can_trim_prompt_cache(make_prompt_cache(self.model)):
            raise UsageError(f"draft model '{name}' keeps a memory that cannot be cut back to a kept draft",
                             "pick a draft model with attention layers only, or use --draft lookup")
        self.eos = set(self.tokenizer.eos_token_ids)
        self.caches: list[list[Any] | None] = [None] * n_slots
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # the tokens in each slot's cache
        self.seconds = 0.0  # time spent drafting, and tokens drafted: recent calls count most
        self.drafted = 0.0

    def draft(self, slot: int, history: list[int], n: int) -> list[int]:
        """Up to n greedy tokens after history (whose last token the target evaluates this step);
        a draft ends at a token the draft model gives under P_MIN, or at an end-of-generation one."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

        t0 = time.perf_counter()
        cache = self.caches[slot]
        if cache is None:
            cache = self.caches[slot] = make_prompt_cache(self.model)
        held = self.held[slot]
        common, limit = 0, min(len(held), len(history) - 1)  # the last token is always evaluated, for its logits
        while common < limit and held[common] == history[common]:
            common += 1
        trim_prompt_cache(cache, len(held) - common)
        feed = history[common:]
        self.held[slot] = held = list(history[:common])
        while len(feed) > PREFILL_STEP:
            self.model(mx.array(feed[:PREFILL_STEP])[None], cache=cache)
            mx.eval([c.state for c in cache])
            held.extend(feed[:PREFILL_STEP])
            feed = feed[PREFILL_STEP:]
        if len(feed) > 4:
            t0 = time.perf_counter()  # a prompt: once per conversation, not a cost of drafting
        out: list[int] = []
        while feed:
            logits = self.model(mx.array(feed)[None], cache=cache)[0, -1].astype(mx.float32)
            held.extend(feed)
            logprobs = logits - mx.logsumexp(logits)
            tok: int = mx.argmax(logprobs).item()  # type: ignore[assignment]
            p: float = mx.exp(logprobs[tok]).item()  # type: ignore[assignment]
            if tok in self.eos or p < P_MIN:
                break
            out.append(tok)
            feed = [tok] if len(out) < n else []
        self.seconds = self.seconds * DECAY + time.perf_counter() - t0
        self.drafted = self.drafted * DECAY + len(out)
        return out

    def close(self) -> None:
        self.caches = []
        self.model = None


class MLXDrafting:
    """MLXEngine's drafting half: the sequences that draft, each in a forward pass of its own."""

    mx: Any
    model: Any
    gen: Any
    n_ctx: int
    uids: dict[int, int]
    slot_uid: list[int | None]
    spec: dict[int, SpecSeq]
    spec_counts: list[tuple[int, int]]
    drafter: MLXDraftModel | None
    _cost: StepCost
    _drafting_steps: int
    _gen_step: float
    is_eog: Callable[[int], bool]
    _logprob: Callable[[Any, int, int], TokenLogprob]

    def drafts(self, slot: int) -> tuple[int, int]:
        """Tokens drafted for the slot's reply so far, and how many of them the model kept."""
        q = self.spec.get(slot)
        return (q.control.drafted, q.control.accepted) if q is not None else self.spec_counts[slot]

    def _spec_step(self) -> list[Sampled]:
        """One forward pass for each drafting sequence: its next token and its drafts (mlx_speculative)."""
        from mlx_lm.models.cache import trim_prompt_cache

        mx = self.mx
        out: list[Sampled] = []
        decoding = len(self.uids) + sum(q.last >= 0 for q in self.spec.values())
        for slot, q in list(self.spec.items()):
            if q.last < 0:  # the prompt, a chunk per step, all but its last token (evaluated with the drafts)
                end = min(len(q.tokens) - 1, q.todo + PREFILL_STEP)
                if end > q.todo:
                    self.model(mx.array(q.tokens[q.todo:end])[None], cache=q.cache)
                    mx.eval([c.state for c in q.cache])
                    q.todo = q.pos = end
                if end < len(q.tokens) - 1:
                    continue
                q.last = q.tokens[-1]
            # A sequence goes on in the generator (batched, pipelined) when its drafting stops, when
            # other sequences decode, or when drafts could not pay even if all were kept (on a CPU a
            # pass costs about as much per token as it evaluates: they never pay there).
            q.control.min_rate = self._min_rate(q.history is not None)
            if not q.control.always and (q.control.off or decoding > 1
                                         or not worth_drafting(q.control.min_rate, q.control.draft_max)):
                self._to_generator(slot, q)
                continue
            self._drafting_steps += 1  # a pass without drafts now and then keeps the measure of both sizes
            explore = self._drafting_steps % EXPLORE_EVERY == 0 and not q.control.always
            want = 0 if explore else q.control.wanted(min(q.room - 1, self.n_ctx - q.pos - 2))
            draft: list[int] = []
            if want and q.lookup is not None:
                draft = q.lookup.draft(want, q.control.ngram_min)
            elif want and q.history is not None and self.drafter is not None:
                draft = self.drafter.draft(slot, q.history, want)
            if len(draft) < q.control.draft_min:
                draft = []
            inputs = [q.last, *draft]
            t0 = time.perf_counter()
            logits = self.model(mx.array(inputs)[None], cache=q.cache)[0]
            if q.processors:  # each position sees the tokens before it, drafts included
                rows = []
                for i in range(len(inputs)):
                    row, context = logits[i:i + 1], mx.array(q.seen + inputs[:i + 1])
                    for process in q.processors:
                        row = process(context, row)
                    rows.append(row)
                logits = mx.concatenate(rows, axis=0)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = [int(t) for t in q.sampler(logprobs).tolist()]
            self._cost.record(len(inputs), time.perf_counter() - t0)
            # each position is sampled as without drafts; a draft stands while the sample equals it
            accepted = 0
            while accepted < len(draft) and sampled[accepted] == draft[accepted] and not self.is_eog(sampled[accepted]):
                accepted += 1
            kept = sampled[:accepted + 1]
            trim_prompt_cache(q.cache, len(draft) - accepted)
            q.seen.extend(inputs[:accepted + 1])
            q.pos += accepted + 1
            for i, tok in enumerate(kept):
                out.append(Sampled(slot, tok, self._logprob(logprobs[i], tok, q.logprobs) if q.logprobs is not None else None))
            if draft:
                q.control.record(len(draft), accepted)
            if q.lookup is not None:
                q.lookup.extend(kept)
            elif q.history is not None:
                q.history.extend(kept)
            q.room -= len(kept)
            q.last = kept[-1]
        return out

    def _min_rate(self, model: bool) -> float:
        """The share of its drafted tokens a sequence must keep for drafting (with the draft model,
        or by lookup) to pay. It is verified alone, in a pass of its own (StepCost): a drafted token
        costs that pass's time per position, plus the draft model's time for it, and a kept one
        saves a step of the generator (or, before one is measured, of such a pass)."""
        d = self.drafter
        per_token = d.seconds / d.drafted if model and d is not None and d.drafted else 0.0
        fitted = self._cost.fit()
        if fitted is None or not self._gen_step:
            return self._cost.min_rate(1, per_token, 0.6 if model else 0.3)
        return (fitted[1] + per_token) / self._gen_step

    def _to_generator(self, slot: int, q: SpecSeq) -> None:
        """A sequence that stops drafting goes on in the generator, with its KV cache."""
        del self.spec[slot]
        self.spec_counts[slot] = (q.control.drafted, q.control.accepted)
        (uid,) = self.gen.insert([[q.last]], max_tokens=[max(1, self.n_ctx - q.pos - 1)], caches=[q.cache],
                                 all_tokens=[q.seen], samplers=[q.sampler], logits_processors=[q.processors])
        self.uids[uid] = slot
        self.slot_uid[slot] = uid

