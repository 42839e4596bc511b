"""A draft model for speculative decoding on llama.cpp: a smaller model with the target's vocabulary.

It has its own context with one KV stream per target sequence; each stream follows its sequence's
tokens (prompt, then reply), so a step feeds the draft model only the tokens that are new since the
last draft (the accepted ones and the latest sample) and then drafts greedily, one batched decode
per drafted position for every sequence that drafts. The target verifies the drafts
(llama_cpp.LlamaCppEngine.step); a sequence's stream is cut back to what the target kept at the
next draft (the common prefix of what it holds and the sequence's tokens).
"""

from __future__ import annotations

import time
from typing import Any

from localrun.backends.llama_loader import last_log_error, load_model, new_context
from localrun.errors import EngineError, UsageError

# llama.cpp's rule for a draft model (common/speculative.cpp): the same vocabulary type, the same
# BOS/EOS use and ids, at most this many tokens more or fewer, and the same text for every token
# from this id on (the first few are special tokens some conversions order differently)
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START = 5
DECAY = 0.97  # the weight of a draft call's cost against the next one's
P_MIN = 0.1  # a draft stops at a token the draft model gives less than this probability


def vocab_facts(ll: Any, vocab: Any) -> dict[str, Any]:
    """What llama.cpp's compatibility rule compares, read from a loaded vocabulary."""
    n = ll.llama_vocab_n_tokens(vocab)
    return {"type": ll.llama_vocab_type(vocab), "add_bos": bool(ll.llama_vocab_get_add_bos(vocab)),
            "bos": ll.llama_vocab_bos(vocab), "add_eos": bool(ll.llama_vocab_get_add_eos(vocab)),
            "eos": ll.llama_vocab_eos(vocab), "n": n,
            "text": [ll.llama_vocab_get_text(vocab, i) or b"" for i in range(n)]}


def vocab_mismatch(target: dict[str, Any], draft: dict[str, Any]) -> str | None:
    """Why a draft model's vocabulary cannot draft for the target's (None: it can), as llama.cpp rules."""
    if target["type"] != draft["type"]:
        return "its tokenizer is of another type"
    for mark in ("bos", "eos"):
        if target[f"add_{mark}"] != draft[f"add_{mark}"]:
            return (f"{'it' if draft[f'add_{mark}'] else 'the target'} adds a {mark.upper()} token to a prompt "
                    f"and {'the target' if draft[f'add_{mark}'] else 'it'} does not")
        if target[f"add_{mark}"] and target[mark] != draft[mark]:
            return f"its {mark.upper()} token is {draft[mark]} and the target's {target[mark]}"
    if abs(target["n"] - draft["n"]) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"its vocabulary has {draft['n']} tokens and the target's {target['n']}"
    for i in range(VOCAB_CHECK_START, min(target["n"], draft["n"])):
        if target["text"][i] != draft["text"][i]:
            shown = [t["text"][i].decode("utf-8", "replace") for t in (target, draft)]
            return f"token {i} differs (target {shown[0]!r}, draft {shown[1]!r})"
    return None


class DraftModel:
    """A draft model loaded beside a target: n_slots KV streams of n_ctx tokens each."""

    def __init__(self, ll: Any, path: str, name: str, target_vocab: dict[str, Any], n_ctx: int, n_slots: int,
                 threads: int, gpu_layers: int, n_batch: int) -> None:
        self.ll = ll
        self.name = name
        params = ll.llama_model_default_params()
        params.n_gpu_layers = gpu_layers
        self.model = load_model(path, name, params)
        self.ctx: Any = None
        self.batch: Any = None
        try:
            self.vocab = ll.llama_model_get_vocab(self.model)
            reason = vocab_mismatch(target_vocab, vocab_facts(ll, self.vocab))
            if reason:
                raise UsageError(f"draft model '{name}' cannot draft for this model: {reason}",
                                 "a draft model needs the target's vocabulary: pick a smaller model of the same "
                                 "family, or use --draft lookup")
            self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = n_ctx * n_slots
            cparams.n_batch = min(n_batch, cparams.n_ctx)
            cparams.n_ubatch = min(cparams.n_batch, 512)
            cparams.n_seq_max = n_slots
            cparams.n_threads = cparams.n_threads_batch = threads
            cparams.no_perf = True
            cparams.kv_unified = False
            self.ctx = new_context(self.model, cparams, f"a context for draft model '{name}'",
                                   "try a smaller --ctx or --parallel, or a smaller draft model")
            self.n_batch = cparams.n_batch
            self.batch = ll.llama_batch_init(max(self.n_batch, n_slots), 0, 1)
            self.mem = ll.llama_get_memory(self.ctx)
        except BaseException:
            self.close()
            raise
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # the tokens in each stream's KV cache
        self.seconds = 0.0  # time spent drafting, and tokens drafted (the engine weighs them against its steps)
        self.drafted = 0.0

    def copy(self, source: int, slot: int) -> None:
        """The slot's stream becomes a copy of source's (a conversation continued in another slot)."""
        if source == slot:
            return
        self.ll.llama_memory_seq_rm(self.mem, slot, -1, -1)
        self.ll.llama_memory_seq_cp(self.mem, source, slot, -1, -1)
        self.held[slot] = list(self.held[source])

    def forget(self, slot: int) -> None:
        """Empty the slot's stream (the target's was replaced from host memory)."""
        self.ll.llama_memory_seq_rm(self.mem, slot, -1, -1)
        self.held[slot] = []

    def draft(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """Greedy drafts for several sequences at once: slot -> (its tokens so far, the last of which
        the target evaluates this step; how many tokens to draft at most) -> slot -> drafted tokens."""
        import numpy as np

        t0 = time.perf_counter()
        ll, mem = self.ll, self.mem
        out: dict[int, list[int]] = {s: [] for s in wants}
        pending: list[tuple[int, int, int, bool]] = []
        for s, (history, _) in wants.items():
            held = self.held[s]
            common = 0
            limit = min(len(held), len(history) - 1)  # the last token is always evaluated, for its logits
            while common < limit and held[common] == history[common]:
                common += 1
            ll.llama_memory_seq_rm(mem, s, common, -1)
            pending.extend((history[i], i, s, i == len(history) - 1) for i in range(common, len(history)))
            self.held[s] = list(history)
        catching_up = len(pending) > 4 * len(wants)  # a prompt: once per conversation, not a cost of drafting
        picked: dict[int, int] = {}  # slot -> the draft model's next token, read right after the decode that made it

        def pick(entries: list[tuple[int, int, int, bool]]) -> None:
            for i, (_, _, s, logits) in enumerate(entries):
                if not logits:
                    continue
                row = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                tok = int(row.argmax())
                if 1.0 / float(np.exp(row - row[tok]).sum()) >= P_MIN and not ll.llama_vocab_is_eog(self.vocab, tok):
                    picked[s] = tok  # confident enough to draft (a token under P_MIN ends the draft)

        while pending:  # the new tokens of every stream, n_batch at a time
            chunk, pending = pending[:self.n_batch], pending[self.n_batch:]
            self._decode(chunk)
            pick(chunk)
        if catching_up:
            t0 = time.perf_counter()
        position = {s: len(h) for s, (h, _) in wants.items()}
        while picked:
            entries = []
            for s, tok in picked.items():
                out[s].append(tok)
                if len(out[s]) < wants[s][1]:
                    entries.append((tok, position[s], s, True))
                    self.held[s].append(tok)
                    position[s] += 1
            picked = {}
            if not entries:
                break
            self._decode(entries)
            pick(entries)
        # recent calls count most: drafting for one sequence costs more per token than for several
        self.seconds = self.seconds * DECAY + time.perf_counter() - t0
        self.drafted = self.drafted * DECAY + sum(len(d) for d in out.values())
        return out

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            for s in {e[2] for e in entries}:
                self.held[s] = []  # what the failed decode left in the stream is unknown: start it over
                self.ll.llama_memory_seq_rm(self.mem, s, -1, -1)
            reason = last_log_error()
            raise EngineError(f"the draft model's llama_decode failed (code {rc}){': ' + reason if reason else ''}")

    def close(self) -> None:
        ll = self.ll
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            ll.llama_model_free(self.model)
            self.model = None

