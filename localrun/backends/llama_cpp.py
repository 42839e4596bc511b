"""The llama.cpp engine, driven through llama-cpp-python's low-level API.

The high-level `Llama` wrapper spends about 0.4 ms of Python per token; this module's decode
loop calls llama_decode and the native sampler chain directly (about 0.07 ms).
It runs inside the engine worker process (see worker.py), so a native abort cannot take
localrun down.
"""

from __future__ import annotations

import codecs
import ctypes
import random
import re
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from localrun.backends.base import Cancel
from localrun.chat import PLAIN_STOPS, StopMatcher, render_plain, render_template
from localrun.errors import (
    BackendUnavailableError,
    BadModelFileError,
    ContextOverflowError,
    EngineError,
)
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request, default_threads
from localrun.store import ModelInfo

_LOG_TAIL: deque[str] = deque(maxlen=40)
_OFFLOAD_RE = re.compile(r"offloaded (\d+/\d+) layers to GPU")
_OFFLOADED: list[str | None] = [None]  # 'N/M' from the last model load's log, if it offloaded
_LOG_CALLBACK: Any = None  # keep the ctypes callback alive: a collected one segfaults


def _install_log_sink(llama_cpp: Any) -> None:
    """Route llama.cpp's log to a ring buffer (for error messages) instead of stderr."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @llama_cpp.llama_log_callback
    def sink(level: int, text: bytes, user_data: Any) -> None:
        if text:
            line = text.decode("utf-8", errors="replace")
            _LOG_TAIL.append(line)
            m = _OFFLOAD_RE.search(line)
            if m:
                _OFFLOADED[0] = m.group(1)

    _LOG_CALLBACK = sink
    llama_cpp.llama_log_set(sink, ctypes.c_void_p(0))


def last_log_error() -> str:
    """The last meaningful line llama.cpp logged (often the reason for a failure)."""
    for line in reversed(_LOG_TAIL):
        line = line.strip()
        if line and ("error" in line.lower() or "failed" in line.lower()):
            return line
    return ""


def _import() -> Any:
    try:
        import llama_cpp
    except ImportError as e:
        raise BackendUnavailableError(
            "the llama.cpp engine is not installed (llama-cpp-python is missing)",
            "pip install llama-cpp-python",
        ) from e
    return llama_cpp


def system_info() -> dict[str, Any]:
    """Build facts of llama.cpp: version, CPU features, GPU offload."""
    llama_cpp = _import()
    _install_log_sink(llama_cpp)
    llama_cpp.llama_backend_init()
    features = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    from importlib.metadata import version

    return {
        "llama_cpp_python": version("llama-cpp-python"),
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "mmap": bool(llama_cpp.llama_supports_mmap()),
        "system_info": features,
    }


class LlamaCppBackend:
    """GGUF models on llama.cpp (CPU, CUDA or Metal, as the build supports)."""

    name = "llama.cpp"
    formats = ("gguf",)

    def available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("llama_cpp") is not None

    def load(self, model: ModelInfo, options: LoadOptions) -> LlamaCppSession:
        return LlamaCppSession(model, options)

    def system_info(self) -> dict[str, Any]:
        return system_info()


class Engine:
    """A loaded model and one context: tokenize, decode, sample. Shared by chat and batch."""

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        ll = _import()
        self.ll = ll
        _install_log_sink(ll)
        ll.llama_backend_init()
        self.model_info = model
        self.options = options
        mparams = ll.llama_model_default_params()
        self.gpu_layers = self._gpu_layers(options)
        mparams.n_gpu_layers = self.gpu_layers
        _LOG_TAIL.clear()
        _OFFLOADED[0] = None
        self.model = ll.llama_model_load_from_file(model.path.encode(), mparams)
        if not self.model:
            reason = last_log_error() or "llama.cpp could not load it"
            raise BadModelFileError(f"cannot load model '{model.name}' ({model.path}): {reason}",
                                    "the file may be corrupt or of an architecture this llama.cpp build does not know")
        self.offloaded = _OFFLOADED[0]
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        n_train = ll.llama_model_n_ctx_train(self.model)
        self.n_ctx = options.n_ctx or min(n_train or LoadOptions.DEFAULT_CTX, LoadOptions.DEFAULT_CTX)  # per sequence
        self.threads = options.n_threads or default_threads()
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self.bos = ll.llama_vocab_bos(self.vocab)
        self.eos = ll.llama_vocab_eos(self.vocab)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}
        self._one = (ll.llama_token * 1)()
        self.ctx: Any = None
        self.batch: Any = None
        self.n_parallel = self.seq_ctx = 0
        if options.n_parallel == 1:
            self.make_context(self.n_ctx, 1)
        # A batch engine sizes its context to the batch it is given (see llama_batch.py).

    def make_context(self, n_ctx: int, n_parallel: int) -> None:
        """(Re)create the context: n_parallel sequences of up to n_ctx tokens.

        Each sequence has its own KV stream (kv_unified off): its attention then reads exactly
        the cells it would read alone, so a sequence decoded in a batch gets bit-identical logits
        to the same sequence decoded alone (with one sequence both layouts are the same).
        """
        ll, options = self.ll, self.options
        self._free_context()
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_parallel
        cparams.n_batch = min(options.n_batch, cparams.n_ctx) if n_parallel == 1 else max(options.n_batch, 512)
        cparams.n_ubatch = min(cparams.n_batch, 512)
        cparams.n_seq_max = n_parallel
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.kv_unified = False
        if options.flash_attn is not None:
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if options.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = ll.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            reason = last_log_error() or "not enough memory?"
            if n_parallel == 1:
                ll.llama_model_free(self.model)
                self.model = None
            what = f"{n_ctx} tokens" if n_parallel == 1 else f"{n_parallel} sequences of {n_ctx} tokens"
            raise EngineError(f"cannot create a context of {what} for '{self.model_info.name}': {reason}",
                              "try a smaller --ctx" if n_parallel == 1 else "try a smaller --parallel or --ctx")
        self.n_parallel = n_parallel
        self.seq_ctx = n_ctx
        self.n_batch = cparams.n_batch
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(max(cparams.n_batch, n_parallel), 0, 1)

    def _free_context(self) -> None:
        if self.batch is not None:
            self.ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def decode_next(self, token: int) -> None:
        """Evaluate one token of sequence 0 right after its cached tokens (the hot path)."""
        self._one[0] = token
        rc = self.ll.llama_decode(self.ctx, self.ll.llama_batch_get_one(self._one, 1))
        if rc != 0:
            raise EngineError(f"llama_decode failed (code {rc}) {last_log_error()}".strip())

    def _gpu_layers(self, options: LoadOptions) -> int:
        if not self.ll.llama_supports_gpu_offload():
            return 0
        if options.gpu_layers == "auto":
            return -1 if _fits_on_gpu(self.model_info) else 0
        return int(options.gpu_layers)

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

    def prompt_tokens(self, request: Request, system_stops: list[str]) -> list[int]:
        """Render the request (chat template or raw) and tokenize it."""
        if request.prompt is not None:
            return self.tokenize(request.prompt, add_special=True, parse_special=False)
        template = self.meta("tokenizer.chat_template")
        bos_text = self.token_text(self.bos)
        if template:
            text = render_template(
                template, request.messages, bos_token=bos_text, eos_token=self.token_text(self.eos)
            )
        else:
            text = render_plain(request.messages)
            system_stops.extend(PLAIN_STOPS)
        # A template that writes the BOS itself must not get a second one.
        add_special = self.add_bos and not (bos_text and text.startswith(bos_text))
        return self.tokenize(text, add_special=add_special, parse_special=True)

    # -- decoding ---------------------------------------------------------------------------
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

    def eval_prompt(self, tokens: list[int], start: int, seq: int = 0) -> None:
        """Evaluate tokens[start:] at positions start.., logits only for the last one."""
        n_batch = self.n_batch
        last = len(tokens) - 1
        for s in range(start, len(tokens), n_batch):
            part = range(s, min(s + n_batch, len(tokens)))
            self.decode([(tokens[i], i, seq, i == last) for i in part])

    def make_sampler(self, params: GenerationParams, seed: int) -> Any:
        ll = self.ll
        chain = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        if params.repeat_penalty != 1.0:
            ll.llama_sampler_chain_add(chain, ll.llama_sampler_init_penalties(
                self.n_vocab, params.repeat_last_n, params.repeat_penalty, 0.0, 0.0))
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

    def close(self) -> None:
        ll = self.ll
        self._free_context()
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None


def _fits_on_gpu(model: ModelInfo) -> bool:
    """Offload everything unless the GPU clearly lacks room (nvidia-smi when present)."""
    from localrun.system import gpus

    cards = gpus()
    if not cards or cards[0].get("free_bytes") is None:
        return True
    return bool(model.size * 1.2 < cards[0]["free_bytes"])


class LlamaCppSession:
    """One model in one context, generating one reply at a time; reuses the cached prompt prefix."""

    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        self.engine = Engine(model, options)
        self.cached: list[int] = []  # tokens whose KV is in sequence 0

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "engine": "llama.cpp",
            "n_ctx": e.n_ctx,
            "n_threads": e.threads,
            "gpu_layers": e.gpu_layers,
            "offloaded": e.offloaded,
            "n_layers": e.ll.llama_model_n_layer(e.model),
            "n_vocab": e.n_vocab,
            "chat_template": e.meta("tokenizer.chat_template") is not None,
        }

    def tokenize(self, request: Request) -> list[int]:
        return self.engine.prompt_tokens(request, [])

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Iterator[Chunk]:
        e, ll = self.engine, self.engine.ll
        if e.n_parallel != 1 or e.seq_ctx != e.n_ctx:
            e.make_context(e.n_ctx, 1)  # this session ran a batch before
            self.cached = []
        stops = list(params.stop)
        tokens = e.prompt_tokens(request, stops)
        if not tokens:
            tokens = [e.bos]
        if len(tokens) >= e.n_ctx:
            raise ContextOverflowError(
                f"the prompt is {len(tokens)} tokens but the context holds {e.n_ctx}",
                f"use a larger --ctx (the model was trained for {ll.llama_model_n_ctx_train(e.model)}) or a shorter prompt",
            )
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        t0 = time.perf_counter()
        # Reuse the KV of the longest common prefix with the previous request.
        keep = 0
        limit = min(len(self.cached), len(tokens) - 1)
        while keep < limit and self.cached[keep] == tokens[keep]:
            keep += 1
        ll.llama_memory_seq_rm(e.mem, 0, keep, -1)
        self.cached = tokens[:keep]
        e.eval_prompt(tokens, keep)
        self.cached = list(tokens)
        t1 = time.perf_counter()
        sampler = e.make_sampler(params, seed)
        try:
            yield from self._decode_loop(sampler, params, stops, cancel, len(tokens), t0, t1, seed)
        finally:
            ll.llama_sampler_free(sampler)

    def _decode_loop(self, sampler: Any, params: GenerationParams, stops: list[str], cancel: Cancel | None,
                     n_prompt: int, t0: float, t1: float, seed: int) -> Iterator[Chunk]:
        e, ll = self.engine, self.engine.ll
        ctx, vocab = e.ctx, e.vocab
        matcher = StopMatcher(stops)
        utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        budget = params.max_tokens if params.max_tokens is not None else e.n_ctx
        n_gen = 0
        pos = n_prompt
        finish = "length"
        sample, is_eog, piece, decode_next = ll.llama_sampler_sample, ll.llama_vocab_is_eog, e.piece, e.decode_next
        while True:
            if cancel is not None and cancel.is_set():
                finish = "cancelled"
                break
            tok = sample(sampler, ctx, -1)
            if is_eog(vocab, tok):
                finish = "stop"
                break
            n_gen += 1
            text = utf8.decode(piece(tok))
            out, hit = matcher.feed(text) if stops else (text, False)
            if out:
                yield Chunk(text=out)
            if hit:
                finish = "stop"
                break
            if n_gen >= budget or pos + 1 >= e.n_ctx:
                finish = "length"
                break
            # Evaluate the token right away so the cached prefix always matches the KV cache.
            decode_next(tok)
            self.cached.append(tok)
            pos += 1
        tail = matcher.flush() + utf8.decode(b"", final=True)
        if tail and finish != "cancelled":
            yield Chunk(text=tail)
        yield Chunk.final(finish, n_prompt, n_gen, t0, t1, time.perf_counter(), seed)

    def batch(self, rows: list[dict[str, Any]], params: dict[str, Any],
              cancel: Cancel | None = None) -> Iterator[dict[str, Any]]:
        """Generate many rows concurrently as parallel sequences (see llama_batch.py).

        Takes and yields JSON-style values so the worker can pass them on: rows are
        {"id", "request", "params"?}; events are {"row": ...}, {"progress": ...}, then {"done": ...}.
        """
        from localrun.backends.llama_batch import BatchScheduler

        self.cached = []  # the batch reuses sequence 0
        try:
            yield from BatchScheduler(self.engine).run(rows, params, cancel)
        finally:
            if self.engine.ctx:
                self.engine.ll.llama_memory_clear(self.engine.mem, True)

    def close(self) -> None:
        self.engine.close()
