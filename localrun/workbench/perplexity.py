"""Perplexity and KL divergence on llama.cpp, chunked and scored as llama-perplexity does.

The text is tokenized once (with BOS), cut into chunks of n_ctx tokens, and each chunk is decoded
from an empty KV cache with BOS in its first slot (when the vocabulary adds one); only the second
half of each chunk is scored (a token is predicted from at least n_ctx/2 tokens of context), and
n_batch // n_ctx chunks share one llama_decode, as in llama.cpp's tools/perplexity.

Against a reference model, each scored position of the reference is kept on disk (under
home()/cache/eval/, once per reference file, text, n_ctx and chunk count): its likeliest tokens
until at most TAIL_MASS of probability is left, their log-probabilities as uint16 on a per-row
scale, the leftover mass, the target token's log-probability and the top token (a quarter to a
third of llama-perplexity's file, which has a uint16 for every token of a 49k vocabulary). The KL divergence
of a row is then the sum of p log(p/q) - p + q over the kept tokens plus the same for the
leftover taken as one token: every term is >= 0, the uint16 step enters at second order (a
model against itself scores ~1e-9), and the only bias is the leftover's own divergence weighted
by its mass (0.2% low on SmolLM2 Q4_0 against F16). The numbers themselves are workbench/scoring.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localrun.errors import BadModelFileError, EngineError, UsageError
from localrun.workbench.scoring import (
    TAIL_MASS,
    Divergence,
    Scores,
    Work,
    blocks,
    compress,
    kld_rows,
    softmax_parts,
)

CACHE_VERSION = 1
_EXITING = [False]  # set in the job's child process, which ends as soon as its answer is sent


@dataclass(frozen=True)
class EvalProgress:
    """One chunk scored: which pass, how far, the running perplexity of that pass."""

    phase: str  # "reference" or "model"
    chunk: int
    chunks: int
    ppl: float
    elapsed_s: float


@dataclass(frozen=True)
class EvalResult:
    """Perplexity of a model on a text, and its divergence from a reference when one was given."""

    model: str
    text: str
    text_sha256: str
    n_ctx: int
    n_batch: int
    chunks: int
    tokens: int  # positions scored
    n_vocab: int
    ppl: float
    ppl_error: float
    seconds: float
    divergence: Divergence | None = None
    model_path: str = ""  # the model's file, when `model` is its store name
    kv_type: str = "f16"  # the model's KV-cache type

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        div = d.get("divergence")
        return cls(**{**d, "divergence": Divergence(**div) if div is not None else None})


Progress = Callable[[EvalProgress], None]


def evaluate(
    model_path: str | os.PathLike[str],
    text_path: str | os.PathLike[str],
    reference_path: str | os.PathLike[str] | None = None,
    *,
    n_ctx: int = 512,
    chunks: int | None = None,
    n_batch: int = 2048,
    threads: int | None = None,
    gpu_layers: int | None = None,
    progress: Progress | None = None,
    use_cache: bool = True,
    kv_type: str = "f16",
) -> EvalResult:
    """Perplexity of model_path on the text at text_path; with reference_path, also the KL
    divergence and token agreement against that model (same vocabulary required). kv_type is the
    model's KV-cache type (the reference always keeps an f16 cache, so it measures what the cache
    type costs when the reference is the model itself).

    Runs llama.cpp in this process; evaluate_in_worker (or EvalWorker) runs it in a child
    process, where a native crash is an error.

    Raises:
        UsageError: bad settings, or a text too short for n_ctx.
        BadModelFileError: a file llama.cpp cannot load, or vocabularies that differ.
        EngineError: llama.cpp failed to decode.
    """
    ll = _llama()
    if n_ctx < 8:
        raise UsageError(f"--ctx {n_ctx} is too small", "use a context of at least 8 tokens")
    if not (n_batch < n_ctx or n_batch % n_ctx == 0):
        raise UsageError(f"--batch-size {n_batch} must be below --ctx {n_ctx} or a multiple of it",
                         f"try --batch-size {max(n_ctx, n_batch // n_ctx * n_ctx)}")
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks {chunks} must be at least 1")
    from localrun.settings import LoadOptions

    LoadOptions(kv_type=kv_type)  # the same check as a model load's
    text_p = Path(text_path)
    try:
        data = text_p.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read the text file {text_p}: {e.strerror}", "pass a readable text file") from e
    text_sha = hashlib.sha256(data).hexdigest()
    if data.endswith(b"\n"):
        data = data[:-1]  # as llama.cpp's -f reads a file
    settings = _Settings(n_ctx, n_batch, threads or _default_threads(), _gpu_layers(ll, gpu_layers))
    model_p = Path(model_path)

    ref: _Reference | None = None
    ref_seconds, cache_path = 0.0, ""
    if reference_path is not None:
        ref_p = Path(reference_path)
        cache = _cache_dir(ref_p, text_sha, n_ctx, chunks)
        cache_path = str(cache) if use_cache else ""
        ref = _Reference.load(cache) if use_cache else None
        if ref is None:  # refuse a mismatch before the reference's long pass
            _same_vocab(model_p, _vocab_identity(ll, model_p), ref_p, _vocab_identity(ll, ref_p))
            t0 = time.perf_counter()
            ref = _reference_pass(ll, ref_p, data, settings, chunks, progress)
            ref_seconds = time.perf_counter() - t0
            if use_cache:
                ref.save(cache, {"reference": str(ref_p.resolve()), "text_sha256": text_sha, "n_ctx": n_ctx,
                                 "n_batch": settings.n_batch_used, "seconds": round(ref_seconds, 3)})
        tokens, n_chunk = ref.tokens, ref.n_chunk
    t0 = time.perf_counter()
    with _Model(ll, model_p, settings, kv_type) as m:
        if ref is not None:
            _same_vocab(model_p, _vocab_hash(ll, m.vocab), Path(str(reference_path)), (ref.n_vocab, ref.vocab_hash))
        else:
            tokens = m.tokenize(data)
            n_chunk = _chunk_count(len(tokens), n_ctx, chunks, text_p)
        stats, work = Scores(), Work()
        for c, rows, targets in m.chunks(tokens, n_chunk):
            for r0, x, t in blocks(rows, targets):
                parts = softmax_parts(x, t, work)
                g = c * m.scored_per_chunk + r0
                stats.add(parts, None if ref is None else kld_rows(x, parts, ref.rows(g, g + len(x))))
            if progress is not None:
                progress(EvalProgress("model", c + 1, n_chunk, stats.ppl_so_far(), time.perf_counter() - t0))
        n_vocab = m.n_vocab
    seconds = time.perf_counter() - t0
    ppl, ppl_err = stats.perplexity()
    divergence = None
    if ref is not None:
        divergence = stats.divergence(ref.nll[: stats.count], str(reference_path), ref.hit, cache_path, ref_seconds)
    return EvalResult(str(model_path), str(text_path), text_sha, n_ctx, settings.n_batch_used, n_chunk,
                      stats.count, n_vocab, ppl, ppl_err, seconds, divergence, kv_type=kv_type)


# -- llama.cpp ------------------------------------------------------------------------------
def _llama() -> Any:
    from localrun.backends.llama_loader import library

    return library()


def _default_threads() -> int:
    from localrun.settings import default_threads

    return default_threads()


def _gpu_layers(ll: Any, requested: int | None) -> int:
    if not ll.llama_supports_gpu_offload():
        return 0
    return -1 if requested is None else requested


@dataclass(frozen=True)
class _Settings:
    n_ctx: int
    n_batch: int
    threads: int
    gpu_layers: int

    @property
    def n_seq(self) -> int:
        return max(1, self.n_batch // self.n_ctx)

    @property
    def n_batch_used(self) -> int:
        return min(self.n_batch, self.n_seq * self.n_ctx)


def _load_model(ll: Any, path: Path, gpu_layers: int, vocab_only: bool = False) -> Any:
    from localrun.backends.llama_loader import load_model, model_file, model_params

    return load_model(str(model_file(path)), str(path), model_params(gpu_layers, vocab_only=vocab_only))


def _vocab_hash(ll: Any, vocab: Any) -> tuple[int, str]:
    n = ll.llama_vocab_n_tokens(vocab)
    h = hashlib.sha256(f"{n} {ll.llama_vocab_bos(vocab)} {int(ll.llama_vocab_get_add_bos(vocab))}\n".encode())
    for t in range(n):
        h.update(ll.llama_vocab_get_text(vocab, t) or b"")
        h.update(b"\0")
    return n, h.hexdigest()


def _vocab_identity(ll: Any, path: Path) -> tuple[int, str]:
    """A model's vocabulary size and a hash of its token texts, from a vocabulary-only load."""
    model = _load_model(ll, path, 0, vocab_only=True)
    try:
        return _vocab_hash(ll, ll.llama_model_get_vocab(model))
    finally:
        ll.llama_model_free(model)


def _chunk_count(n_tokens: int, n_ctx: int, chunks: int | None, text: Path) -> int:
    if n_tokens < 2 * n_ctx:
        raise UsageError(f"{text} is only {n_tokens} tokens; --ctx {n_ctx} needs at least {2 * n_ctx}",
                         "use a longer text or a smaller --ctx")
    most = n_tokens // n_ctx
    return most if chunks is None else min(chunks, most)


class _Model:
    """A model and one context laid out as llama-perplexity's: n_seq streams of n_ctx tokens."""

    def __init__(self, ll: Any, path: Path, s: _Settings, kv_type: str = "f16") -> None:
        from localrun.backends.llama_loader import GGML_KV_TYPES, new_context

        self.ll, self.s, self.path = ll, s, path
        self.ctx: Any = None
        self.batch: Any = None
        self.model = _load_model(ll, path, s.gpu_layers)
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.n_vocab = ll.llama_vocab_n_tokens(self.vocab)
        if ll.llama_vocab_get_add_eos(self.vocab):
            self.close()
            raise BadModelFileError(f"{path.name} appends EOS to every text, so perplexity cannot be scored",
                                    "use a causal language model")
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self.bos = ll.llama_vocab_bos(self.vocab)
        cp = ll.llama_context_default_params()
        cp.n_ctx = s.n_seq * s.n_ctx
        cp.n_batch = s.n_batch_used
        cp.n_ubatch = min(512, cp.n_batch)
        cp.n_seq_max = s.n_seq
        cp.n_threads = cp.n_threads_batch = s.threads
        cp.swa_full = False  # llama-perplexity's (common's) default
        cp.kv_unified = False
        cp.type_k = cp.type_v = GGML_KV_TYPES[kv_type]
        if kv_type != "f16":  # a quantized V cache needs flash attention, as in the engine
            cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        try:
            self.ctx = new_context(self.model, cp, f"a context of {s.n_seq} x {s.n_ctx} tokens for {path.name}",
                                   "try a smaller --batch-size or --ctx")
        except EngineError:
            self.close()
            raise
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(cp.n_batch, 0, 1)
        self.first = s.n_ctx // 2
        self.scored_per_chunk = s.n_ctx - 1 - self.first

    def __enter__(self) -> _Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tokenize(self, data: bytes) -> np.ndarray:
        from localrun.backends.llama_loader import vocab_tokens

        return np.asarray(vocab_tokens(self.ll, self.vocab, data, True, False), dtype=np.int32)

    def chunks(self, tokens: np.ndarray, n_chunk: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(chunk index, logits of its scored positions, the tokens they predict) for each chunk.

        The logits are a view of llama.cpp's buffer when a chunk fits one batch: valid until the
        next chunk group is decoded.
        """
        ll, s, first = self.ll, self.s, self.first
        n_ctx, n_batch, n_vocab = s.n_ctx, s.n_batch_used, self.n_vocab
        num_batches = -(-n_ctx // n_batch)
        n_keep = self.scored_per_chunk
        b = self.batch
        tok_v = np.ctypeslib.as_array(b.token, shape=(n_batch,))
        pos_v = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        nseq_v = np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))
        out_v = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        nseq_v[:] = 1
        for i in range(0, n_chunk, s.n_seq):
            group = min(s.n_seq, n_chunk - i)
            ll.llama_memory_clear(self.mem, True)
            parts: list[list[np.ndarray]] = [[] for _ in range(group)]
            for j in range(num_batches):
                size = min(n_ctx - j * n_batch, n_batch)
                pos = np.arange(j * n_batch, j * n_batch + size, dtype=np.int32)
                for q in range(group):
                    at = q * size
                    start = (i + q) * n_ctx + j * n_batch
                    tok_v[at:at + size] = tokens[start:start + size]
                    if j == 0 and self.add_bos:
                        tok_v[at] = self.bos
                    pos_v[at:at + size] = pos
                    out_v[at:at + size] = pos >= first
                    for k in range(at, at + size):
                        b.seq_id[k][0] = q
                b.n_tokens = group * size
                rc = ll.llama_decode(self.ctx, b)
                if rc != 0:
                    from localrun.backends.llama_loader import last_log_error

                    raise EngineError(f"llama_decode failed on chunk {i + 1} (code {rc}) {last_log_error()}".strip())
                n_out = int(np.count_nonzero(pos >= first))
                if n_out:
                    logits = np.ctypeslib.as_array(ll.llama_get_logits(self.ctx), shape=(group * n_out, n_vocab))
                    for q in range(group):
                        rows = logits[q * n_out:(q + 1) * n_out]
                        parts[q].append(rows if num_batches == 1 else rows.copy())
            for q in range(group):
                c = i + q
                rows = parts[q][0] if len(parts[q]) == 1 else np.concatenate(parts[q])
                start = c * n_ctx + first + 1
                yield c, rows[:n_keep], tokens[start:start + n_keep]

    def close(self) -> None:
        if _EXITING[0]:
            return  # the process ends right after: freeing would only delay the answer
        ll = self.ll
        if self.batch is not None:
            ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            ll.llama_model_free(self.model)
            self.model = None


def _same_vocab(model: Path, ours: tuple[int, str], ref: Path, theirs: tuple[int, str]) -> None:
    if ours != theirs:
        other = ", same count but other tokens" if ours[0] == theirs[0] else ""
        raise BadModelFileError(
            f"'{model.name}' and the reference '{ref.name}' have different vocabularies ({ours[0]} vs {theirs[0]} tokens{other})",
            "KL divergence compares models with the same tokenizer; drop --reference for perplexity alone")


# -- the reference and its cache ------------------------------------------------------------
_ARRAYS = ("tokens", "offsets", "index", "value", "scale", "low", "tail", "top", "nll")


@dataclass
class _Reference:
    """A reference model's scored rows (all chunks), in memory or memory-mapped from the cache."""

    n_chunk: int
    n_vocab: int
    vocab_hash: str
    arrays: dict[str, np.ndarray]
    hit: bool = False

    @property
    def tokens(self) -> np.ndarray:
        return self.arrays["tokens"]

    @property
    def nll(self) -> np.ndarray:
        return self.arrays["nll"]

    def rows(self, r0: int, r1: int) -> dict[str, np.ndarray]:
        """Scored positions r0..r1 (counted over all chunks)."""
        a = self.arrays
        e0, e1 = int(a["offsets"][r0]), int(a["offsets"][r1])
        return {
            "counts": np.diff(a["offsets"][r0:r1 + 1]),
            "index": a["index"][e0:e1], "value": a["value"][e0:e1],
            **{k: a[k][r0:r1] for k in ("scale", "low", "tail", "top", "nll")},
        }

    @classmethod
    def load(cls, folder: Path) -> _Reference | None:
        try:
            meta = json.loads((folder / "meta.json").read_text())
            if meta.get("version") != CACHE_VERSION:
                return None
            arrays = {k: np.load(folder / f"{k}.npy", mmap_mode="r") for k in _ARRAYS}
        except (OSError, ValueError):
            return None
        return cls(meta["n_chunk"], meta["n_vocab"], meta["vocab_hash"], arrays, hit=True)

    def save(self, folder: Path, extra: dict[str, Any]) -> None:
        """Write the cache entry under a temporary name, then rename it into place."""
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir()
            for k in _ARRAYS:
                np.save(tmp / f"{k}.npy", self.arrays[k])
            meta = {"version": CACHE_VERSION, "n_chunk": self.n_chunk, "n_vocab": self.n_vocab,
                    "vocab_hash": self.vocab_hash, "tail_mass": TAIL_MASS, **extra}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(folder, ignore_errors=True)  # a stale entry (another cache version)
            os.replace(tmp, folder)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # a cache that cannot be written is no error


def _cache_dir(reference: Path, text_sha: str, n_ctx: int, chunks: int | None) -> Path:
    """The cache entry of one reference file (path, size, mtime), text, context and chunk count."""
    import llama_cpp

    from localrun.store import home

    try:
        st = reference.stat()
    except OSError as e:
        raise BadModelFileError(f"reference model file {reference} does not exist",
                                "pass a .gguf file or an installed model's name") from e
    key = json.dumps([CACHE_VERSION, str(reference.resolve()), st.st_size, st.st_mtime_ns, text_sha, n_ctx,
                      chunks, TAIL_MASS, llama_cpp.__version__])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return home() / "cache" / "eval" / f"{reference.stem}-{digest}"


def _reference_pass(ll: Any, path: Path, data: bytes, s: _Settings, chunks: int | None,
                    progress: Progress | None) -> _Reference:
    t0 = time.perf_counter()
    pieces: list[dict[str, np.ndarray]] = []
    nll_sum, count, work = 0.0, 0, Work()
    with _Model(ll, path, s) as m:
        n_vocab, vocab_hash = _vocab_hash(ll, m.vocab)
        tokens = m.tokenize(data)
        n_chunk = _chunk_count(len(tokens), s.n_ctx, chunks, path)
        for c, rows, targets in m.chunks(tokens, n_chunk):
            for _, x, t in blocks(rows, targets):
                parts = softmax_parts(x, t, work)
                pieces.append(compress(x, parts, work))
                nll_sum, count = nll_sum + float(parts.nll.sum()), count + len(parts.nll)
            if progress is not None:
                progress(EvalProgress("reference", c + 1, n_chunk, float(np.exp(nll_sum / count)),
                                      time.perf_counter() - t0))
    counts = np.concatenate([p.pop("counts") for p in pieces])
    arrays = {k: np.concatenate([p[k] for p in pieces]) for k in pieces[0]}
    arrays["offsets"] = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    arrays["tokens"] = tokens[: n_chunk * s.n_ctx].copy()
    return _Reference(n_chunk, n_vocab, vocab_hash, arrays)


# -- isolation ------------------------------------------------------------------------------
class EvalWorker:
    """evaluate() as a job in a child process (backends/isolation.py): a native abort there
    becomes an EngineCrashedError here.

    The child starts loading llama.cpp at once, so a caller can resolve its models meanwhile;
    run() evaluates once, then the process is gone.
    """

    def __init__(self) -> None:
        from localrun.backends.isolation import Job

        self.job = Job("localrun.workbench.perplexity:job", "evaluating", warm="localrun.backends.llama_loader:library")

    def __enter__(self) -> EvalWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, model_path: str | os.PathLike[str], text_path: str | os.PathLike[str],
            reference_path: str | os.PathLike[str] | None = None, *, progress: Progress | None = None,
            **options: Any) -> EvalResult:
        """evaluate(model_path, text_path, reference_path, **options) in the child."""
        self.job.activity = f"evaluating {Path(model_path).name}"
        request = {"model": str(model_path), "text": str(text_path),
                   "reference": None if reference_path is None else str(reference_path), "options": options}
        result = self.job.run(request, lambda e: progress(EvalProgress(**e)) if progress is not None else None)
        return EvalResult.from_dict(result)

    def close(self) -> None:
        self.job.close()


def evaluate_in_worker(
    model_path: str | os.PathLike[str],
    text_path: str | os.PathLike[str],
    reference_path: str | os.PathLike[str] | None = None,
    *,
    progress: Progress | None = None,
    **options: Any,
) -> EvalResult:
    """evaluate() in a child process (see EvalWorker)."""
    with EvalWorker() as worker:
        return worker.run(model_path, text_path, reference_path, progress=progress, **options)


def job(request: dict[str, Any], emit: Callable[[Any], None]) -> dict[str, Any]:
    """The isolated side (see backends/isolation.py): progress events, then the result."""
    _keep_freed_memory()
    _EXITING[0] = True
    result = evaluate(request["model"], request["text"], request["reference"],
                      progress=lambda e: emit(dataclasses.asdict(e)), **request["options"])
    return result.to_dict()


def _keep_freed_memory() -> None:
    """glibc hands freed blocks over 128 KB back to the kernel, so every block's MB-sized numpy
    temporaries come back as fresh pages (a third of the math's time in page faults); this
    process keeps them instead."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: blocks under 64 MB come from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MB of it when freed
    except (OSError, AttributeError):
        pass  # not glibc
