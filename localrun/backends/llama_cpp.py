"""The llama.cpp engine, driven through llama-cpp-python's low-level API.

The high-level `Llama` wrapper spends about 0.4 ms of Python per token; this engine's step
calls llama_decode over every running sequence and the native sampler chains directly.
The engine loop (loop.py) decides what runs; this module only holds sequences and steps them.
It runs inside the engine worker process (see worker.py), so a native abort cannot take
localrun down.
"""

from __future__ import annotations

import codecs
import ctypes
import dataclasses
import os
import time
import warnings
from typing import Any

from localrun.backends.base import Abilities, Embeddings, Sampled, render_chat, token_logprob
from localrun.backends.drafting import (
    EXPLORE_EVERY,
    DraftControl,
    PromptLookup,
    StepCost,
    worth_drafting,
)
from localrun.backends.grammar import Grammars, GrammarState
from localrun.backends.llama_draft import DraftModel, vocab_facts
from localrun.backends.llama_loader import (
    GGML_KV_TYPES,
    LOG,
    KvCacheReport,
    last_log_error,
    libggml,
    library,
    load_model,
    new_context,
)
from localrun.backends.llama_vision import Vision, image_start
from localrun.chat import PLAIN_STOPS, render_plain
from localrun.errors import (
    BadModelFileError,
    ContextOverflowError,
    EngineError,
    LocalrunError,
    UsageError,
)
from localrun.fit import Shape, context_for, kv_cache_bytes
from localrun.generation import (
    GenerationParams,
    LoadOptions,
    Request,
    TokenLogprob,
    default_threads,
)
from localrun.store import ModelInfo

GGML_BACKEND_DEVICE_TYPE_CPU = 0


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
        self.sampler = sampler
        self.logprobs = logprobs
        self.grammar = grammar
        self.forced: list[int] = []  # tokens the next samples must be (a thinking budget's closing marker)
        self.lookup: PromptLookup | None = None  # speculative decoding's drafter (prompt lookup), if on
        self.control: DraftControl | None = None
        self.room = 0  # tokens the reply may still have (its budget)
        self.history: list[int] | None = None  # a draft model's: the prompt and the reply so far
        self.images = 0  # images its prompt evaluation encoded (those in the KV cache are not)


class LlamaCppEngine:
    """A loaded model and one context of n_slots sequences: the engine loop's step operations."""

    abilities = ABILITIES
    can_copy = True

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        ll = library()
        self.ll = ll
        self.model_info = model
        self.options = options
        mparams = ll.llama_model_default_params()
        self.cpu_moe_layers, host_bytes = 0, 0
        self._overrides: Any = None  # the override array and its patterns live as long as the model
        if options.cpu_moe:
            self._overrides, self.cpu_moe_layers, host_bytes = _cpu_moe_overrides(ll, model, options.cpu_moe)
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
        if options.draft:
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

    def _load_drafter(self, options: LoadOptions) -> None:
        from pathlib import Path

        assert options.draft is not None
        name = Path(options.draft).name
        try:
            if Path(options.draft).is_dir():
                raise UsageError(f"draft model '{name}' is an MLX folder, and on llama.cpp a draft model is a GGUF file",
                                 "pick a GGUF draft model, or use --draft lookup")
            self.drafter = DraftModel(self.ll, options.draft, name, vocab_facts(self.ll, self.vocab), self.n_ctx,
                                      self.n_slots, self.threads, self.gpu_layers, self.n_batch)
        except UsageError as e:
            if not options.draft_optional:
                self.close()
                raise
            self.draft_refused = e.message
        except BaseException:
            self.close()
            raise

    def _llg_tokenizer(self) -> Any:
        """llguidance's view of this vocabulary, with every end-of-generation token as its EOS."""
        from localrun.constraint import import_llguidance

        import_llguidance()
        from llguidance.llamacpp import lltokenizer_from_vocab

        eog = [t for t in range(self.n_vocab) if self.is_eog(t)] or [self.eos]
        with warnings.catch_warnings():  # it reads each token through a name llama-cpp-python deprecates
            warnings.simplefilter("ignore", DeprecationWarning)
            return lltokenizer_from_vocab(self.vocab, eos_token=eog)

    def special_id(self, text: str) -> int | None:
        """The id of the control or user-defined token spelled `text`, if the vocabulary has one."""
        ids = self.tokenize(text, add_special=False, parse_special=True)
        if len(ids) != 1:
            return None
        attr = self.ll.llama_vocab_get_attr(self.vocab, ids[0])
        return ids[0] if attr & (self.ll.LLAMA_TOKEN_ATTR_CONTROL | self.ll.LLAMA_TOKEN_ATTR_USER_DEFINED) else None

    def make_context(self, n_ctx: int, n_parallel: int) -> None:
        """Create the context once: n_parallel sequences of up to n_ctx tokens.

        Each sequence has its own KV stream (kv_unified off): its attention then reads exactly
        the cells it would read alone, so a sequence decoded in a batch gets bit-identical logits
        to the same sequence decoded alone (with one sequence both layouts are the same).
        """
        ll, options = self.ll, self.options
        self._free_context()
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_parallel
        cparams.n_batch = min(options.n_batch, cparams.n_ctx)
        cparams.n_ubatch = min(cparams.n_batch, 512)
        cparams.n_seq_max = n_parallel
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.kv_unified = False
        cparams.type_k = cparams.type_v = GGML_KV_TYPES[options.kv_type]
        # A quantized V cache needs flash attention: on unless the user turned it off (LoadOptions refuses that)
        flash = True if options.kv_type != "f16" and options.flash_attn is None else options.flash_attn
        if flash is not None:
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        what = f"{n_ctx} tokens" if n_parallel == 1 else f"{n_parallel} sequences of {n_ctx} tokens"
        LOG.kv_caches.clear()
        try:
            self.ctx = new_context(self.model, cparams, f"a context of {what} for '{self.model_info.name}'",
                                   "try a smaller --ctx" if n_parallel == 1 else "try a smaller --parallel or --ctx")
        except EngineError as e:
            # llama.cpp refuses a quantized cache whose blocks (32 values) do not divide a head's size
            reason = next((line.strip() for line in LOG.tail if "does not divide" in line), None)
            if options.kv_type != "f16" and reason:
                raise UsageError(f"--kv-type {options.kv_type} cannot hold the KV cache of '{self.model_info.name}': "
                                 f"{reason.split(': ', 1)[-1]}", "use --kv-type f16") from e
            raise
        self.kv_caches = list(LOG.kv_caches)
        self.n_slots = n_parallel
        self.n_batch = cparams.n_batch
        # While sequences generate, a step takes at most this many prompt tokens: a long prompt is
        # then processed over several steps, each of which also gives every running sequence a token.
        self.prefill_cap = max(32, self.n_batch // 4)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(max(cparams.n_batch, n_parallel), 0, 1)

    def _slots_in_ram(self, size: int) -> int:
        """How many sequences of size tokens the KV cache (of --kv-type) fits in half the available RAM."""
        from localrun.system import ram_bytes

        ll = self.ll
        available = ram_bytes()[1]
        if not available or self.gpu_layers != 0:
            return 1 << 30  # on a GPU a failed allocation makes the constructor retry with fewer
        head = ll.llama_model_n_embd(self.model) // max(1, ll.llama_model_n_head(self.model))
        shape = Shape(ll.llama_model_n_layer(self.model), ll.llama_model_n_head_kv(self.model), head, head, None)
        per_sequence = kv_cache_bytes(shape, size, self.options.kv_type)
        return max(1, available // 2 // max(1, per_sequence))

    def _free_context(self) -> None:
        if self.batch is not None:
            self.ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def _gpu_layers(self, options: LoadOptions, host_bytes: int = 0) -> int:
        if not self.ll.llama_supports_gpu_offload():
            return 0
        if options.gpu_layers == "auto":
            return -1 if _fits_on_gpu(self.model_info, host_bytes) else 0
        return int(options.gpu_layers)

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
            **({"mmproj": self.vision.path, "images_encoded": self.vision.encoded} if self.vision is not None else {}),
            **({"warning": self.vision_missing} if self.vision_missing else {}),
        }

    # -- text <-> tokens ------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        n_max = len(data) + 8
        buf = (self.ll.llama_token * n_max)()
        n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (self.ll.llama_token * n_max)()
            n = self.ll.llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            raise EngineError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int, special: bool = False) -> bytes:
        if not special:
            cached = self._pieces.get(token)
            if cached is None:
                cached = self._pieces[token] = self._piece(token, False)
            return cached
        return self._piece(token, True)

    def _piece(self, token: int, special: bool) -> bytes:
        n = self.ll.llama_token_to_piece(self.vocab, token, self._piece_buf, 256, 0, special)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = self.ll.llama_token_to_piece(self.vocab, token, big, -n, 0, special)
            return big.raw[:n]
        return self._piece_buf.raw[:n]

    def token_text(self, token: int) -> str:
        if token < 0 or token >= self.n_vocab:
            return ""
        return self.piece(token, special=True).decode("utf-8", errors="replace")

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self.ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def prompt_tokens(self, request: Request, stops: list[str]) -> list[int]:
        """Render the request (chat template or raw) and tokenize it (images as placeholders)."""
        images = [data for m in request.messages for data in m.images]
        if images:
            if self.vision is None:
                raise UsageError(f"'{self.model_info.name}' does not support images"
                                 + (f" ({self.vision_missing})" if self.vision_missing else ""),
                                 "send text only, or load a vision model with its projector (--mmproj FILE)")
            mark = self.vision.marker
            if any(mark in m.content for m in request.messages):
                raise UsageError(f"a message contains '{mark}', which marks an image on this model",
                                 "remove it from the text")
            # Each image goes before its message's text, as Ollama and llama-server place them.
            request = dataclasses.replace(request, messages=tuple(
                dataclasses.replace(m, content=mark * len(m.images) + m.content, images=()) if m.images else m
                for m in request.messages))
        if request.prompt is not None:
            tokens = self.tokenize(request.prompt, add_special=True, parse_special=False)
            return tokens or [self.bos]
        bos_text = self.token_text(self.bos)
        template = request.template or self._template
        if template:
            text = render_chat(template, self.reasoning, request, bos_text, self.token_text(self.eos))
        else:
            text = render_plain(request.messages)
            stops.extend(PLAIN_STOPS)
        # A template that writes the BOS itself must not get a second one.
        add_special = self.add_bos and not (bos_text and text.startswith(bos_text))
        if images:
            assert self.vision is not None
            return self.vision.tokenize(text, images, add_special)
        return self.tokenize(text, add_special=add_special, parse_special=True) or [self.bos]

    def text_tokens(self, text: str) -> list[int]:
        return self.tokenize(text, add_special=False, parse_special=True)

    def force(self, slot: int, tokens: list[int]) -> None:
        q = self.seqs[slot]
        if q is not None:
            q.forced = list(tokens)

    def is_eog(self, token: int) -> bool:
        return bool(self.ll.llama_vocab_is_eog(self.vocab, token))

    def detokenizer(self, special: bool = False) -> _Utf8Pieces:
        return _Utf8Pieces(self.piece_special if special else self.piece)

    def piece_special(self, token: int) -> bytes:
        return self.piece(token, special=True)

    # -- LoRA adapters --------------------------------------------------------------------
    def _adapter(self, path: str) -> Any:
        """The loaded adapter of a GGUF LoRA file (loaded once, kept with the model)."""
        handle = self._adapters.get(path)
        if handle is None:
            LOG.clear()
            handle = self.ll.llama_adapter_lora_init(self.model, path.encode())
            if not handle:
                reason = last_log_error() or "llama.cpp could not load it"
                raise BadModelFileError(
                    f"cannot apply the LoRA adapter '{path}' to '{self.model_info.name}': {reason}",
                    "an adapter runs only on the base model it was trained for; check its base with 'localrun show'")
            self._adapters[path] = handle
        return handle

    def set_lora(self, lora: tuple[tuple[str, float], ...]) -> None:
        """Apply these adapters (file, scale) to every sequence decoded from now on.

        llama.cpp applies adapters per context, so the engine loop runs together only sequences
        that use the same adapters, and keeps their KV caches apart from the others'.
        """
        lora = tuple(lora)
        if lora == self.lora:
            return
        merged: dict[str, float] = {}
        for path, scale in lora:
            merged[path] = merged.get(path, 0.0) + scale
        ll = self.ll
        handles = [self._adapter(path) for path in merged]
        n = len(handles)
        if n:
            arr = (ll.llama_adapter_lora_p_ctypes * n)(*handles)
            scales = (ctypes.c_float * n)(*merged.values())
            ll.llama_set_adapters_lora(self.ctx, arr, n, scales)
        else:
            ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        self.lora = lora

    # -- the engine loop's operations -----------------------------------------------------
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
        if params.speculative == "model" and self.drafter is None and not self.options.draft_optional:
            raise UsageError(f"no draft model is loaded with '{self.model_info.name}'"
                             + (f" ({self.draft_refused})" if self.draft_refused else ""),
                             "load one with --draft MODEL, or use --draft lookup")
        # A grammar's state follows one token at a time; a server's draft model that cannot draft
        # for this model (draft_optional) gives no drafts, and info() says why.
        by_model = params.speculative == "model" and self.drafter is not None
        has_images = bool(tokens) and min(tokens) < 0  # drafters read tokens, not images
        if grammar is None and not has_images and (by_model or params.speculative == "lookup"):
            if by_model:
                q.history = list(tokens)  # a draft model's tokens cost a decode each: start with short drafts
            else:
                q.lookup = PromptLookup(tokens)
            q.control = DraftControl(draft_max=params.draft_max, draft_min=params.draft_min,
                                     min_rate=0.6 if by_model else 0.3, start=2 if by_model else 4,
                                     always=params.draft_always)
            q.room = params.budget(self.n_ctx, len(tokens))
        return keep

    def _min_rate(self, model: bool, sequences: int) -> float:
        """The share of its drafted tokens a sequence must keep for drafting (with the draft model,
        or by lookup) to pay, with this many sequences decoding (StepCost)."""
        if not model:
            return self._cost.min_rate(sequences, 0.0, 0.3)
        d = self.drafter
        per_token = d.seconds / d.drafted if d is not None and d.drafted else 0.0
        return self._cost.min_rate(sequences, per_token, 0.6)

    def _model_drafts(self, wants: dict[int, tuple[list[int], int]]) -> dict[int, list[int]]:
        """The draft model's drafts for these sequences; none (and no more drafting for them) if it fails."""
        assert self.drafter is not None
        try:
            return self.drafter.draft(wants)
        except EngineError:
            for s in wants:
                q = self.seqs[s]
                if q is not None and q.control is not None:
                    q.control.off = True
            return {}

    def drafts(self, slot: int) -> tuple[int, int]:
        """Tokens drafted for the slot's reply so far, and how many of them the model kept."""
        q = self.seqs[slot]
        return (q.control.drafted, q.control.accepted) if q is not None and q.control is not None else (0, 0)

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
        n = self.vision.eval(self.ctx, tokens[at], at, slot, self.n_batch)
        q = self.seqs[slot]
        if q is not None:
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
                    draft = q.lookup.draft(want) if want else []
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
            tok = ll.llama_sampler_sample(q.sampler, ctx, idx)
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
                tok = ll.llama_sampler_sample(q.sampler, ctx, idx)
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
        self.ll.llama_sampler_free(q.sampler)
        self.seqs[slot] = None
        self.ll.llama_memory_seq_rm(self.mem, slot, q.pos, -1)
        return q.pos

    def _logprob(self, idx: int, token: int, top: int) -> TokenLogprob:
        import numpy as np

        ptr = self.ll.llama_get_logits_ith(self.ctx, idx)
        logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
        m = logits.max()
        return token_logprob(logits - m - np.log(np.exp(logits - m).sum()), token, top,
                             lambda t: self.piece(t, special=True))

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

    def make_sampler(self, params: GenerationParams, seed: int) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.penalized:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                self.n_vocab, params.repeat_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty))
        if params.temperature <= 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_greedy())
            return chain
        if params.top_k > 0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_top_p(params.top_p, 1))
        if params.min_p > 0.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_min_p(params.min_p, 1))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_temp(params.temperature))
        ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_dist(seed))
        return chain

    # -- embeddings -------------------------------------------------------------------------
    def embed(self, texts: list[str]) -> Embeddings:
        """Pooled (the file's pooling, else mean) and L2-normalised vectors, one text at a time."""
        import numpy as np

        ll = self.ll
        if self._embed_ctx is None:
            cparams = ll.llama_context_default_params()
            cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = self.n_ctx
            cparams.n_seq_max = 1
            cparams.n_threads = cparams.n_threads_batch = self.threads
            cparams.embeddings = True
            cparams.no_perf = True
            if self.meta(f"{self.meta('general.architecture')}.pooling_type") is None:
                cparams.pooling_type = ll.LLAMA_POOLING_TYPE_MEAN  # a generative model: mean of its tokens
            self._embed_ctx = ll.llama_init_from_model(self.model, cparams)
            if not self._embed_ctx:
                raise EngineError(f"cannot create an embedding context for '{self.model_info.name}': "
                                  f"{last_log_error() or 'not enough memory?'}")
        ctx = self._embed_ctx
        n_embd = ll.llama_model_n_embd(self.model)
        batch = ll.llama_batch_init(self.n_ctx, 0, 1)
        vectors: list[list[float]] = []
        total = 0
        try:
            for text in texts:
                tokens = self.tokenize(text, add_special=True, parse_special=False) or [self.bos]
                if len(tokens) > self.n_ctx:
                    raise ContextOverflowError(
                        f"an input is {len(tokens)} tokens but the context holds {self.n_ctx}",
                        "use a larger --ctx or shorter inputs")
                total += len(tokens)
                ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
                for i, t in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, True
                batch.n_tokens = len(tokens)
                if ll.llama_decode(ctx, batch) != 0:
                    raise EngineError(f"llama_decode failed while embedding {last_log_error()}".strip())
                ptr = ll.llama_get_embeddings_seq(ctx, 0)
                vec = np.ctypeslib.as_array(ptr, shape=(n_embd,)).astype(np.float64)
                norm = float(np.linalg.norm(vec))
                vectors.append((vec / norm if norm > 0 else vec).tolist())
        finally:
            ll.llama_batch_free(batch)
        return Embeddings(vectors, total)

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


class _Utf8Pieces:
    """Token pieces to text without splitting a UTF-8 character across chunks."""

    __slots__ = ("piece", "utf8")

    def __init__(self, piece: Any) -> None:
        self.piece = piece
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self.utf8.decode(self.piece(token))

    def flush(self) -> str:
        return self.utf8.decode(b"", final=True)


def _fits_on_gpu(model: ModelInfo, host_bytes: int = 0) -> bool:
    """Offload everything unless the GPU clearly lacks room (nvidia-smi when present); host_bytes
    of the weights stay in host memory (--cpu-moe)."""
    from localrun.system import gpus

    cards = gpus()
    if not cards or cards[0].get("free_bytes") is None:
        return True
    return bool((model.size - host_bytes) * 1.2 < cards[0]["free_bytes"])


class _BuftOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_buffer_type() -> int:
    """ggml's CPU buffer type (host memory), the one llama.cpp's own --cpu-moe override names."""
    lib = libggml()  # the CPU device's buffer type, from ggml's device registry
    dev = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    buft = lib.ggml_backend_dev_buffer_type(dev) if dev else None
    if not buft:
        raise EngineError("--cpu-moe: this llama.cpp build has no CPU buffer type", "run without --cpu-moe")
    return int(buft)


def _cpu_moe_overrides(ll: Any, model: ModelInfo, cpu_moe: int | str) -> tuple[Any, int, int]:
    """The NULL-terminated override array that keeps the experts of the first N layers (or all)
    in host memory, as llama.cpp's --n-cpu-moe / --cpu-moe build it; with the layers it covers and
    their expert bytes.

    Raises UsageError for a model without experts.
    """
    from localrun.errors import UsageError
    from localrun.gguf_header import EXPERT_TENSORS, model_experts

    experts = model_experts(model.details)
    if experts is None:
        raise UsageError(f"--cpu-moe: '{model.name}' is not a mixture-of-experts model (it has no expert tensors)",
                         "drop --cpu-moe; --gpu-layers N keeps whole layers off the GPU instead")
    layers = experts.cpu_layers(cpu_moe)
    if layers >= experts.layers:
        patterns = [EXPERT_TENSORS.encode()]
    else:
        patterns = [f"blk\\.{i}{EXPERT_TENSORS}".encode() for i in range(layers)]
    buft = _cpu_buffer_type()
    arr = (_BuftOverride * (len(patterns) + 1))()  # zeroed: the last entry ends the list
    for entry, pattern in zip(arr, patterns, strict=False):
        entry.pattern, entry.buft = pattern, buft
    return (arr, patterns), layers, experts.host_bytes(layers)
