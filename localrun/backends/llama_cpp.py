"""The llama.cpp engine, driven through llama-cpp-python's low-level API.

The high-level `Llama` wrapper spends about 0.4 ms of Python per token; this engine's step
calls llama_decode over every running sequence and the native sampler chains directly.
The engine loop (loop.py) decides what runs; this module only holds sequences and steps them.
The engine's other parts are mixins beside it: its context and memory (llama_context.py), text
and tokens (llama_tokens.py), samplers (llama_sampling.py), LoRA adapters (llama_adapters.py),
embeddings (llama_embeddings.py) and drafting (llama_speculative.py).
It runs inside the engine worker process (see worker.py), so a native abort cannot take
localrun down.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

from localrun.backends.base import Abilities, Sampled
from localrun.backends.drafting import (
    EXPLORE_EVERY,
    DraftControl,
    DraftRecord,
    PromptLookup,
    StepCost,
    worth_drafting,
)
from localrun.backends.grammar import Grammars, GrammarState
from localrun.backends.llama_adapters import LlamaAdapters
from localrun.backends.llama_context import LlamaContext, cpu_moe_overrides
from localrun.backends.llama_draft import DraftModel
from localrun.backends.llama_embeddings import LlamaEmbeddings
from localrun.backends.llama_loader import LOG, KvCacheReport, last_log_error, library, load_model
from localrun.backends.llama_sampling import LlamaSampling
from localrun.backends.llama_speculative import LlamaSpeculative
from localrun.backends.llama_tokens import LlamaTokens
from localrun.backends.llama_vision import Vision, image_start
from localrun.errors import EngineError, LocalrunError, UsageError
from localrun.fit import context_for
from localrun.settings import GenerationParams, LoadOptions, default_threads
from localrun.store import ModelInfo


def system_info() -> dict[str, Any]:
    """Build facts of llama.cpp: version, CPU features, GPU offload."""
    llama_cpp = library()
    features = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    from importlib.metadata import version

    return {
        "llama_cpp_python": version("llama-cpp-python"),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "mmap": bool(llama_cpp.llama_supports_mmap()),
        "system_info": features,
    }


ABILITIES = Abilities(request_adapters=True, expert_offload=True, embeddings=True, structured_output=True,
                      drafting=True, images=True)


class LlamaCppBackend:
    """GGUF models on llama.cpp (CPU, CUDA or Metal, as the build supports)."""

    name = "llama.cpp"
    title = "llama.cpp"
    formats = ("gguf",)
    install_hint = "pip install llama-cpp-python, then run 'localrun doctor'"
    packages = ("llama-cpp-python",)
    abilities = ABILITIES
    copies_from = ("safetensors",)
    copy_hint = "convert it to GGUF with 'localrun convert {path}'"

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("llama_cpp") is not None

    def warm(self) -> None:
        library()

    def load(self, model: ModelInfo, options: LoadOptions) -> LlamaCppEngine:
        return LlamaCppEngine(model, options)

    def system_info(self) -> dict[str, Any]:
        return system_info()

    @staticmethod
    def describe(facts: dict[str, Any]) -> list[tuple[str, str]]:
        return [("version", f"llama-cpp-python {facts.get('llama_cpp_python')}"),
                ("gpu offload", "yes" if facts.get("gpu_offload") else "no (CPU build)"),
                ("build", str(facts.get("system_info")))]


class _Seq:
    """What the engine holds for one slot: its prompt, where its KV cache ends, its sampler."""

    __slots__ = ("tokens", "todo", "pos", "last", "sampler", "logprobs", "grammar", "forced", "lookup", "control",
                 "room", "history", "images")

    def __init__(self, tokens: list[int], keep: int, sampler: Any, logprobs: int | None,
                 grammar: GrammarState | None) -> None:
        self.tokens = tokens
        self.todo = keep  # next prompt token to evaluate
        self.pos = keep  # tokens in this slot's KV cache
        self.last = -1  # sampled token that the next step evaluates (-1: still in the prompt)
        self.sampler = sampler  # None: greedy alone (make_sampler)
        self.logprobs = logprobs
        self.grammar = grammar
        self.forced: list[int] = []  # tokens the next samples must be (a thinking budget's closing marker)
        self.lookup: PromptLookup | None = None  # speculative decoding's drafter (prompt lookup), if on
        self.control: DraftControl | None = None
        self.room = 0  # tokens the reply may still have (its budget)
        self.history: list[int] | None = None  # a draft model's: the prompt and the reply so far
        self.images = 0  # images its prompt evaluation encoded (those in the KV cache are not)


class LlamaCppEngine(LlamaContext, LlamaTokens, LlamaSampling, LlamaAdapters, LlamaEmbeddings,
                     LlamaSpeculative):
    """A loaded model and one context of n_slots sequences: the engine loop's step operations."""

    abilities = ABILITIES
    can_copy = True
    can_save = True  # not for a recurrent state, which cannot be cut back to a prefix (set at load)

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        ll = library()
        self.ll = ll
        self.model_info = model
        self.options = options
        mparams = ll.llama_model_default_params()
        self.cpu_moe_layers, host_bytes = 0, 0
        self._overrides: Any = None  # the override array and its patterns live as long as the model
        if options.cpu_moe:
            self._overrides, self.cpu_moe_layers, host_bytes = cpu_moe_overrides(ll, model, options.cpu_moe)
            mparams.tensor_buft_overrides = ctypes.addressof(self._overrides[0])
        self.gpu_layers = self._gpu_layers(options, host_bytes)
        mparams.n_gpu_layers = self.gpu_layers
        self.model = load_model(model.path, model.name, mparams)
        self.offloaded = LOG.offloaded
        self.host_tensors = tuple(name for name, _ in LOG.overridden)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        self.n_train = ll.llama_model_n_ctx_train(self.model)
        self.n_ctx = context_for(model, options, self.n_train).tokens  # the trained context, if memory holds it
        self.threads = options.n_threads or default_threads()
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self.bos = ll.llama_vocab_bos(self.vocab)
        self.eos = ll.llama_vocab_eos(self.vocab)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}
        self.ctx: Any = None
        self.batch: Any = None
        self._embed_ctx: Any = None
        self.n_slots = 0
        self.kv_caches: list[KvCacheReport] = []  # llama.cpp's report of the context's KV cache
        slots = min(options.n_parallel, self._slots_in_ram(self.n_ctx))
        while True:
            try:
                self.make_context(self.n_ctx, slots)
                break
            except UsageError:
                self.close()
                raise
            except EngineError:
                if slots == 1:
                    self.close()
                    raise
                slots //= 2  # not enough memory for that many sequences: fewer at once
        self.seqs: list[_Seq | None] = [None] * self.n_slots
        self._adapters: dict[str, Any] = {}  # adapter file -> llama_adapter_lora, loaded on first use
        self.lora: tuple[tuple[str, float], ...] = ()  # the adapters set on the context now
        self._template = self.meta("tokenizer.chat_template")
        from localrun.reasoning import detect

        self.reasoning = detect(self._template, lambda t: self.special_id(t) is not None)
        self.grammars = Grammars(self._llg_tokenizer, self.special_id, self.n_vocab, self.token_text)
        self.drafter: DraftModel | None = None  # speculative decoding's draft model (--draft MODEL), if loaded
        self.draft_refused: str | None = None  # why the draft model asked for does not draft (draft_optional)
        self._cost = StepCost()  # what this model's steps cost, to weigh drafts against
        self._drafting_steps = 0
        self._model_record = DraftRecord()  # whether the draft model's drafts paid in recent sequences
        # Rejected drafts are cut from the KV cache; a recurrent state (Mamba, and the hybrid models
        # that mix it with attention) holds no positions to cut, so such a model decodes without drafts.
        self.no_drafts: str | None = None
        if ll.llama_model_is_recurrent(self.model) or ll.llama_model_is_hybrid(self.model):
            self.can_save = False
            self.no_drafts = ("speculative decoding is off for this model: its recurrent state cannot be cut "
                              "back to drop rejected drafts")
        if options.draft and self.no_drafts is None:
            self._load_drafter(options)
        self.vision: Vision | None = None  # the projector that reads images, for a vision model
        self.vision_missing: str | None = None  # a recorded projector that is not there (runs as text)
        mmproj = options.mmproj or model.details.get("mmproj")
        if mmproj:
            if os.path.isfile(mmproj):
                try:
                    self.vision = Vision(mmproj, self.model, self.threads, self.gpu_layers != 0,
                                         options.flash_attn)
                except LocalrunError:
                    self.close()
                    raise
            elif options.mmproj:
                self.close()
                raise UsageError(f"vision projector '{mmproj}': no such file", "give the path of an mmproj GGUF file")
            else:
                self.vision_missing = f"its vision projector '{mmproj}' is missing: it reads no images"

    def info(self) -> dict[str, Any]:
        return {
            "engine": "llama.cpp",
            "n_ctx": self.n_ctx,
            "n_ctx_train": self.n_train,
            "n_parallel": self.n_slots,
            "kv_type": self.options.kv_type,
            # K and V of every sequence, as llama.cpp reported the caches it allocated
            "kv_bytes": round(sum(c.k_mib + c.v_mib for c in self.kv_caches) * (1 << 20)),
            "kv_cache": [c.to_dict() for c in self.kv_caches],
            "n_threads": self.threads,
            "gpu_layers": self.gpu_layers,
            "offloaded": self.offloaded,
            "cpu_moe_layers": self.cpu_moe_layers,  # layers whose experts --cpu-moe keeps in host memory
            "host_tensors": list(self.host_tensors),  # the tensors llama.cpp placed there by override
            "n_layers": self.ll.llama_model_n_layer(self.model),
            "n_embd": self.ll.llama_model_n_embd(self.model),
            "n_vocab": self.n_vocab,
            "chat_template": self._template is not None,
            **({"draft_model": self.drafter.name} if self.drafter is not None else {}),
            **({"draft_refused": self.draft_refused} if self.draft_refused else {}),
            **({"no_drafts": self.no_drafts} if self.no_drafts else {}),
            **({"mmproj": self.vision.path, "images_encoded": self.vision.encoded} if self.vision is not None else {}),
            **({"warning": warning} if (warning := self.vision_missing or (self.vision and self.vision.warning)) else {}),
        }

    # -- the engine loop's operations -----------------------------------------------------
    def force(self, slot: int, tokens: list[int]) -> None:
        q = self.seqs[slot]
        if q is not None:
            q.forced = list(tokens)

    def start(self, slot: int, tokens: list[int], params: GenerationParams, seed: int, source: int, keep: int) -> int:
        ll, mem = self.ll, self.mem
        if source != slot:
            # Sequences live in separate KV streams, which llama.cpp copies only whole.
            ll.llama_memory_seq_rm(mem, slot, -1, -1)
            ll.llama_memory_seq_cp(mem, source, slot, -1, -1)
            if self.drafter is not None:
                self.drafter.copy(source, slot)
        grammar = self.grammars.state(params.grammar, params.grammar_trigger, params.budget(self.n_ctx, len(tokens)))
        keep = image_start(tokens, keep)  # an image is evaluated whole
        ll.llama_memory_seq_rm(mem, slot, keep, -1)
        q = self.seqs[slot] = _Seq(tokens, keep, self.make_sampler(params, seed), params.logprobs, grammar)
        speculative = None if self.no_drafts else params.speculative  # a recurrent model drafts nothing
        if speculative == "model" and self.drafter is None and not self.options.draft_optional:
            raise UsageError(f"no draft model is loaded with '{self.model_info.name}'"
                             + (f" ({self.draft_refused})" if self.draft_refused else ""),
                             "load one with --draft MODEL, or use --draft lookup")
        # A grammar's state follows one token at a time; a server's draft model that cannot draft
        # for this model (draft_optional) gives no drafts, and info() says why.
        by_model = speculative == "model" and self.drafter is not None
        has_images = bool(tokens) and min(tokens) < 0  # drafters read tokens, not images
        if grammar is None and not has_images and (by_model or speculative == "lookup"):
            if by_model:
                q.history = list(tokens)  # a draft model's tokens cost a decode each: start with short drafts
            else:
                q.lookup = PromptLookup(tokens)
            q.control = DraftControl(draft_max=params.draft_max, draft_min=params.draft_min,
                                     min_rate=0.6 if by_model else 0.3, start=2 if by_model else 4,
                                     always=params.draft_always)
            # a lookup draft costs a few batch positions; a draft model's trial costs its decodes
            if by_model and not params.draft_always and not self._model_record.starts():
                q.control.off = True
            q.room = params.budget(self.n_ctx, len(tokens))
        return keep

    def save(self, slot: int) -> tuple[Any, int] | None:
        ll = self.ll
        size = ll.llama_state_seq_get_size(self.ctx, slot)
        if not size:
            return None
        state = (ctypes.c_uint8 * size)()
        if ll.llama_state_seq_get_data(self.ctx, state, size, slot) != size:
            return None
        return state, size

    def restore(self, slot: int, state: Any) -> bool:
        ok = bool(self.ll.llama_state_seq_set_data(self.ctx, state, len(state), slot))
        if not ok:
            self.ll.llama_memory_seq_rm(self.mem, slot, -1, -1)
        if self.drafter is not None:
            self.drafter.forget(slot)  # its stream catches up from the tokens at the next draft
        return ok

    def prompt_cells(self, tokens: list[int]) -> int:
        """KV cells a prompt fills: an image counts its embeddings, not its positions."""
        return self.vision.cells(tokens) if self.vision is not None else len(tokens)

    def images_encoded(self, slot: int) -> int:
        """Images the slot's prompt evaluation encoded (not those found in the KV cache)."""
        q = self.seqs[slot]
        return q.images if q is not None else 0

    def prefill(self, slot: int, tokens: list[int], start: int) -> None:
        self.ll.llama_memory_seq_rm(self.mem, slot, start, -1)
        n_batch = self.n_batch
        i = start
        while i < len(tokens):
            if tokens[i] < 0:
                i += self._image(slot, tokens, i)
                continue
            end = i
            while end < len(tokens) and end - i < n_batch and tokens[end] >= 0:
                end += 1
            self.decode([(tokens[j], j, slot, False) for j in range(i, end)])
            i = end

    def _image(self, slot: int, tokens: list[int], at: int) -> int:
        """Evaluate the image whose placeholders start at `at` into the slot; the positions it took."""
        assert self.vision is not None, "image placeholders come only from a projector's tokenization"
        n, encoded = self.vision.eval(self.ctx, tokens[at], at, slot, self.n_batch)
        q = self.seqs[slot]
        if q is not None and encoded:
            q.images += 1
        return n

    def step(self) -> list[Sampled]:
        entries: list[tuple[int, int, int, bool]] = []
        owners: list[tuple[int, int]] = []  # (slot, batch index) of each entry that gives logits
        drafted: dict[int, list[int]] = {}  # slot -> the tokens drafted after its next one, in this batch
        seqs = self.seqs
        decoding = sum(q is not None and q.last >= 0 for q in seqs)
        spare = self.n_batch - decoding  # batch positions left for drafts
        model_rate = lookup_rate = 1.0
        if any(q is not None and q.control is not None and not q.control.off for q in seqs):
            self._drafting_steps += 1
            if self._drafting_steps % EXPLORE_EVERY == 0:
                spare = 0  # a step without drafts now and then: what drafted steps are measured against
            # Drafts that could not pay well even if all were kept (at this many sequences, a drafted
            # token costs nearly the step share it saves) are not made: the sequence drafts again
            # when fewer decode (worth_drafting).
            model_rate = self._min_rate(True, decoding) if self.drafter is not None else 1.0
            lookup_rate = self._min_rate(False, decoding)
        modelled: dict[int, tuple[list[int], int]] = {}  # slot -> (its tokens, draft length): the draft model's
        for s, q in enumerate(seqs):
            if q is not None and q.last >= 0 and q.history is not None and not q.forced and spare > 0 \
                    and q.control is not None and (q.control.always or worth_drafting(model_rate, q.control.draft_max)):
                want = q.control.wanted(min(q.room - 1, self.n_ctx - q.pos - 2, spare))
                if want:
                    modelled[s] = (q.history, want)
                    spare -= want
        from_model = self._model_drafts(modelled) if modelled else {}
        for s, q in enumerate(seqs):
            if q is not None and q.last >= 0:
                owners.append((s, len(entries)))
                entries.append((q.last, q.pos, s, True))
                q.pos += 1
                if q.control is None or q.forced:
                    continue
                if q.lookup is not None:
                    fits = min(q.room - 1, self.n_ctx - q.pos - 1, spare)
                    pays = q.control.always or worth_drafting(lookup_rate, q.control.draft_max)
                    want = q.control.wanted(fits) if spare > 0 and pays else 0
                    draft = q.lookup.draft(want, q.control.ngram_min) if want else []
                    spare -= len(draft)
                else:
                    draft = from_model.get(s, [])
                if draft and len(draft) >= q.control.draft_min:
                    drafted[s] = draft
                    entries.extend((d, q.pos + i, s, True) for i, d in enumerate(draft))
        room = self.n_batch - len(entries)
        if entries:
            room = min(room, self.prefill_cap)
        decoded = len(entries)
        for s, q in enumerate(seqs):
            if room <= 0:
                break
            if q is None or q.last >= 0:
                continue
            tokens = q.tokens
            while q.todo < len(tokens) and tokens[q.todo] < 0 and room > 0:
                # An image: evaluated now, by itself (the text before it is in the cache already),
                # and counted against this step's room like the tokens it stands for.
                n = self._image(s, tokens, q.todo)
                q.todo = q.pos = q.todo + n
                room -= n
            end = min(len(tokens), q.todo + room)
            if room <= 0:
                continue
            stop = next((i for i in range(q.todo, end) if tokens[i] < 0), end)
            end = stop  # text up to the next image; the image follows in the next step
            last = len(tokens) - 1
            entries.extend((tokens[i], i, s, i == last) for i in range(q.todo, end))
            if end == len(tokens):
                owners.append((s, len(entries) - 1))
            room -= end - q.todo
            q.todo = q.pos = end
        prompting = len(entries) > decoded
        if not entries:
            return []
        t0 = time.perf_counter()
        self.decode(entries)
        if not prompting and (drafted or any(q is not None and q.control is not None for q in seqs)):
            self._cost.record(len(entries), time.perf_counter() - t0)  # what drafts are weighed against
        import numpy as np  # with llama-cpp-python; imported here so that loading this module stays light

        ll, ctx = self.ll, self.ctx
        out = []
        for s, idx in owners:
            q = seqs[s]
            assert q is not None
            g = q.grammar
            if q.forced:  # only the forced token stays possible, as a grammar's mask leaves only allowed ones
                logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(self.n_vocab,))
                keep = q.forced.pop(0)
                value = logits[keep]
                logits[:] = -np.inf
                logits[keep] = value if np.isfinite(value) else 0.0
            elif g is not None and g.active:
                g.mask_logits(np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, idx), shape=(self.n_vocab,)))
            tok = self.sample(q.sampler, idx)
            if g is not None:
                g.accept(tok)
            out.append(Sampled(s, tok, self._logprob(idx, tok, q.logprobs) if q.logprobs is not None else None,
                               g is not None and g.breaks(tok, False)))
            kept = [tok]
            draft = drafted.get(s, [])
            # Each drafted position is sampled as it would be without drafts; a draft stands while
            # the sample equals it (then its logits, computed after it, give the next sample).
            accepted = 0
            while accepted < len(draft) and tok == draft[accepted] and not self.is_eog(tok):
                accepted += 1
                idx += 1
                tok = self.sample(q.sampler, idx)
                kept.append(tok)
                out.append(Sampled(s, tok, self._logprob(idx, tok, q.logprobs) if q.logprobs is not None else None))
            if draft:
                q.pos += accepted  # the kept drafts are in the KV cache; the others are removed from it
                if accepted < len(draft):
                    ll.llama_memory_seq_rm(self.mem, s, q.pos, -1)
                assert q.control is not None
                q.control.min_rate = self._min_rate(q.history is not None, decoding)
                q.control.record(len(draft), accepted)
            if q.lookup is not None:
                q.lookup.extend(kept)
            elif q.history is not None:
                q.history.extend(kept)
            q.room -= len(kept)
            q.last = tok
        return out

    def finish(self, slot: int) -> int:
        q = self.seqs[slot]
        if q is None:
            return 0
        if q.sampler is not None:
            self.ll.llama_sampler_free(q.sampler)
        if q.control is not None and q.history is not None:
            self._model_record.finished(q.control)
        self.seqs[slot] = None
        self.ll.llama_memory_seq_rm(self.mem, slot, q.pos, -1)
        return q.pos

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode over (token, position, sequence, wants_logits) entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            reason = last_log_error()
            raise EngineError(f"llama_decode failed (code {rc}){': ' + reason if reason else ''}",
                              "the context may be full; try a larger --ctx")


    def close(self) -> None:
        ll = self.ll
        for s in range(len(getattr(self, "seqs", []))):
            self.finish(s)
        vision = getattr(self, "vision", None)
        if vision is not None:
            vision.close()
            self.vision = None
        drafter = getattr(self, "drafter", None)
        if drafter is not None:
            drafter.close()
            self.drafter = None
        if getattr(self, "_embed_ctx", None):
            ll.llama_free(self._embed_ctx)
            self._embed_ctx = None
        self._free_context()
        for handle in getattr(self, "_adapters", {}).values():
            ll.llama_adapter_lora_free(handle)
        self._adapters = {}
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None

