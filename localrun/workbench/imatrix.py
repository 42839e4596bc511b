"""Importance matrices for llama.cpp quantization, computed on llama.cpp itself.

This does what llama-imatrix (tools/imatrix/imatrix.cpp of the llama.cpp that llama-cpp-python
0.3.36 vendors) does, through the context's evaluation callback: the calibration tokens are cut
into chunks of n_ctx (the first token of each replaced by BOS when the vocabulary adds one), every
chunk is decoded with all logits on (so the last layer sees every token), and for each MUL_MAT
whose weight is a `blk.*` tensor and whose input has at least 16 rows, and each MUL_MAT_ID (per
expert, by the routing ids), the squares of the input columns are summed over tokens and the
tokens counted. The file is llama-imatrix's GGUF format: `<weight>.in_sum2` (F32, experts x
columns) and `<weight>.counts` (F32, experts x 1), with general.type, imatrix.datasets,
imatrix.chunk_count and imatrix.chunk_size; llama_model_quantize takes sum/count per column
(convert/imatrix.py). By default the work runs in a child process (backends/isolation.py), so that
a native abort is an error message.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from localrun.backends.isolation import Job
from localrun.errors import EngineError, UsageError
from localrun.workbench.texts import default_calibration

DEFAULT_CTX = 512
MIN_ROWS = 16  # llama-imatrix skips matrix products over fewer tokens than this
BATCH_TOKENS = 2048  # llama-imatrix's default -b: chunks per decode = this // n_ctx

# ggml.h of this llama.cpp: GGML_MAX_DIMS 4, GGML_MAX_SRC 10, GGML_MAX_OP_PARAMS 64, GGML_MAX_NAME 64.
_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64
_OP_MUL_MAT, _OP_MUL_MAT_ID = 29, 30  # enum ggml_op; checked against ggml_op_name at load
_TYPE_F32 = 0
_OBJECT_SIZE = 32  # struct ggml_object: ggml_tensor_overhead() = this + sizeof(struct ggml_tensor)


class _GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h)."""


_GgmlTensor._fields_ = [
    ("type", ctypes.c_int),
    ("buffer", ctypes.c_void_p),
    ("ne", ctypes.c_int64 * _MAX_DIMS),
    ("nb", ctypes.c_size_t * _MAX_DIMS),
    ("op", ctypes.c_int),
    ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)),
    ("flags", ctypes.c_int32),
    ("src", ctypes.POINTER(_GgmlTensor) * _MAX_SRC),
    ("view_src", ctypes.POINTER(_GgmlTensor)),
    ("view_offs", ctypes.c_size_t),
    ("data", ctypes.c_void_p),
    ("name", ctypes.c_char * _MAX_NAME),
    ("extra", ctypes.c_void_p),
    ("padding", ctypes.c_char * 8),
]


@dataclass(frozen=True)
class ImatrixProgress:
    """One chunk of calibration text evaluated."""

    chunk: int  # chunks done
    chunks: int
    tokens: int  # tokens evaluated so far
    elapsed_s: float

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the rate so far."""
        return self.elapsed_s / self.chunk * (self.chunks - self.chunk) if self.chunk else None


@dataclass(frozen=True)
class ImatrixSummary:
    """What compute_imatrix wrote."""

    path: Path
    dataset: str
    chunks: int
    chunk_size: int
    tokens: int  # calibration tokens evaluated (chunks x chunk_size)
    tensors: int  # weight matrices with an entry
    seconds: float
    perplexity: float | None  # over the second half of each chunk, as llama-imatrix reports it


ProgressCallback = Callable[[ImatrixProgress], None]


def compute_imatrix(
    model_path: str | os.PathLike[str],
    calibration: str | os.PathLike[str] | Sequence[int] | None,
    out_path: str | os.PathLike[str],
    *,
    n_ctx: int = DEFAULT_CTX,
    chunks: int | None = None,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
    dataset: str | None = None,
    isolated: bool = True,
) -> ImatrixSummary:
    """Compute a GGUF model's importance matrix on calibration text and write it to out_path.

    Args:
        model_path: a GGUF file llama.cpp can load (any type; F16/F32 gives the cleanest data).
        calibration: text (str), a UTF-8 text file (Path), token ids, or None for localrun's
            default set (default_calibration).
        out_path: the .gguf to write (under a temporary name, renamed when complete).
        n_ctx: tokens per chunk (llama-imatrix's -c).
        chunks: at most this many chunks (default: every whole chunk of the text).
        threads: CPU threads (default: localrun's decoding default).
        progress: called as chunks finish (a few at once when short chunks share a decode).
        dataset: the name recorded in imatrix.datasets (default: describes the input).
        isolated: run llama.cpp in a child process, so that a native abort is an error.

    Returns:
        An ImatrixSummary of the written file.

    Raises:
        UsageError: too little calibration text for one chunk, or bad settings.
        BadModelFileError: llama.cpp cannot load the model.
        EngineError: the evaluation failed (EngineCrashedError: llama.cpp crashed).
    """
    if n_ctx < MIN_ROWS:
        raise UsageError(f"--ctx {n_ctx} is too small", f"use at least {MIN_ROWS} (default {DEFAULT_CTX})")
    if chunks is not None and chunks < 1:
        raise UsageError(f"--chunks {chunks} must be at least 1", "leave it out to use the whole text")
    if isinstance(calibration, os.PathLike):
        file = Path(calibration)
        if not file.is_file():
            raise UsageError(f"calibration file {file} does not exist",
                             "pass a text file, or none for localrun's default set")
        calibration, dataset = file.read_text(encoding="utf-8", errors="replace"), dataset or str(file)
    if calibration is None:
        calibration, default_name = default_calibration()
        dataset = dataset or default_name
    elif isinstance(calibration, str):
        dataset = dataset or _describe(calibration)
    else:
        calibration = [int(t) for t in calibration]
        dataset = dataset or f"{len(calibration)} tokens"
    out = Path(out_path)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        request = {"model": os.fspath(model_path), "calibration": calibration, "out": str(tmp),
                   "n_ctx": n_ctx, "chunks": chunks, "threads": threads, "dataset": dataset}
        if isolated:
            job = Job("localrun.workbench.imatrix:job", f"computing the importance matrix of {Path(model_path).name}",
                      hint="the model file may be damaged, or its vocabulary lacks tokens this text needs")
            summary = _summary(job.run(request, lambda e: progress(ImatrixProgress(**e)) if progress else None))
        else:
            summary = _compute(request, progress)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return ImatrixSummary(**{**asdict(summary), "path": out})


def _describe(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"text ({len(text)} characters, sha256 {digest})"


# -- the job in its child process ---------------------------------------------------------------

def job(request: dict[str, Any], emit: Callable[[Any], None]) -> dict[str, Any]:
    """The isolated side (see backends/isolation.py): progress events, then the summary."""
    return _plain(_compute(request, lambda p: emit(asdict(p))))


def _plain(summary: ImatrixSummary) -> dict[str, Any]:
    return {**asdict(summary), "path": str(summary.path)}


def _summary(d: dict[str, Any]) -> ImatrixSummary:
    return ImatrixSummary(**{**d, "path": Path(d["path"])})


# -- the computation (in this process) ------------------------------------------------------------

def _compute(request: dict[str, Any], progress: ProgressCallback | None) -> ImatrixSummary:
    from localrun.backends.llama_loader import library, load_model, model_file, model_params
    from localrun.settings import default_threads

    start = time.monotonic()
    ll = library()
    ggml = _ggml_lib()
    path, n_ctx = request["model"], int(request["n_ctx"])
    model = load_model(path, path, model_params(_gpu_layers(ll, model_file(Path(path)))))
    try:
        vocab = ll.llama_model_get_vocab(model)
        tokens = _tokens(ll, vocab, request["calibration"])
        n_chunk = len(tokens) // n_ctx
        if n_chunk < 1:
            raise UsageError(f"the calibration text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}",
                             "give a longer text or a smaller --ctx")
        if request.get("chunks"):
            n_chunk = min(n_chunk, int(request["chunks"]))
        collector = _Collector(ll, ggml)
        threads = int(request.get("threads") or default_threads())
        ppl = _evaluate(ll, model, vocab, tokens, n_ctx, n_chunk, threads, collector, progress, start)
    finally:
        ll.llama_model_free(model)
    write_imatrix(request["out"], collector.sums, collector.counts, [request["dataset"]], n_chunk, n_ctx)
    return ImatrixSummary(Path(request["out"]), request["dataset"], n_chunk, n_ctx, n_chunk * n_ctx,
                          len(collector.sums), time.monotonic() - start, ppl)


def _gpu_layers(ll: Any, path: Path) -> int:
    """Every layer on the GPU when the build has one and the file fits; none otherwise."""
    if not ll.llama_supports_gpu_offload():
        return 0
    from localrun.system import gpus

    cards = gpus()
    free = cards[0].get("free_bytes") if cards else None
    return -1 if free is None or path.stat().st_size * 1.2 < free else 0


def _tokens(ll: Any, vocab: Any, calibration: str | list[int]) -> list[int]:
    """Token ids as llama-imatrix makes them: BOS added when the vocabulary wants one, no special parsing."""
    if not isinstance(calibration, str):
        n_vocab = ll.llama_vocab_n_tokens(vocab)
        bad = [t for t in calibration if not 0 <= t < n_vocab]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside this model's vocabulary of {n_vocab}")
        return list(calibration)
    from localrun.backends.llama_loader import vocab_tokens

    return vocab_tokens(ll, vocab, calibration.encode("utf-8", "replace"), True, False)


def _evaluate(ll: Any, model: Any, vocab: Any, tokens: list[int], n_ctx: int, n_chunk: int,
              threads: int, collector: _Collector, progress: ProgressCallback | None,
              start: float) -> float | None:
    """Decode the chunks with the collector attached; the perplexity llama-imatrix prints.

    As llama-imatrix does, short chunks share a decode (one sequence each, up to BATCH_TOKENS
    tokens): every collected product ends a piece of the graph, so small decodes cost much more.
    """
    from localrun.backends.llama_loader import last_log_error, new_context

    n_seq = max(1, BATCH_TOKENS // n_ctx)
    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n_seq * n_ctx
    cparams.n_batch = n_seq * n_ctx
    cparams.n_ubatch = min(cparams.n_batch, 512)  # llama-imatrix's default micro-batch
    cparams.n_seq_max = n_seq
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.no_perf = True
    cparams.cb_eval = collector.callback
    cparams.cb_eval_user_data = None
    ctx = new_context(model, cparams, f"a context of {n_seq * n_ctx} tokens", "try a smaller --ctx")
    batch = ll.llama_batch_init(n_seq * n_ctx, 0, 1)
    add_bos, bos = ll.llama_vocab_get_add_bos(vocab), ll.llama_vocab_bos(vocab)
    n_vocab = ll.llama_vocab_n_tokens(vocab)
    first = n_ctx // 2
    nll, count = 0.0, 0
    try:
        mem = ll.llama_get_memory(ctx)
        for i in range(0, n_chunk, n_seq):
            group = min(n_seq, n_chunk - i)
            ll.llama_memory_clear(mem, True)
            for s in range(group):
                chunk = tokens[(i + s) * n_ctx:(i + s + 1) * n_ctx]
                for k, t in enumerate(chunk):
                    j = s * n_ctx + k
                    batch.token[j] = bos if (k == 0 and add_bos) else t
                    batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0], batch.logits[j] = k, 1, s, True
            batch.n_tokens = group * n_ctx
            rc = ll.llama_decode(ctx, batch)
            collector.raise_error()
            if rc != 0:
                raise EngineError(f"llama_decode failed on chunk {i + 1} (status {rc}): {last_log_error()}")
            logits = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(group, n_ctx, n_vocab))
            for s in range(group):
                targets = tokens[(i + s) * n_ctx + first + 1:(i + s + 1) * n_ctx]
                nll += _nll(logits[s, first:n_ctx - 1], np.asarray(targets, dtype=np.int64))
                count += len(targets)
            if progress is not None:
                done = i + group
                progress(ImatrixProgress(done, n_chunk, done * n_ctx, time.monotonic() - start))
    finally:
        ll.llama_batch_free(batch)
        ll.llama_free(ctx)
    return float(np.exp(nll / count)) if count else None


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed negative log-likelihood of the targets."""
    top = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - top, dtype=np.float64).sum(axis=1)) + top[:, 0]
    return float((lse - logits[np.arange(len(targets)), targets]).sum())


def _ggml_lib() -> Any:
    """The loader's libggml, after checking that this module's ggml_tensor layout is its own."""
    from localrun.backends.llama_loader import libggml

    g = libggml()
    size = g.ggml_tensor_overhead() - _OBJECT_SIZE
    ops = (g.ggml_op_name(_OP_MUL_MAT), g.ggml_op_name(_OP_MUL_MAT_ID))
    if size != ctypes.sizeof(_GgmlTensor) or ops != (b"MUL_MAT", b"MUL_MAT_ID"):
        raise EngineError(f"this llama.cpp's ggml_tensor ({size} bytes, ops {ops}) is not the one "
                          "localrun's importance-matrix code was written for",
                          "install the pinned llama-cpp-python (pip install llama-cpp-python==0.3.36)")
    return g


def _weight_name(raw: bytes) -> str:
    """llama-imatrix's filter_tensor_name: CUDA0#blk.0.attn_k.weight#0 -> blk.0.attn_k.weight."""
    name = raw.decode("utf-8", "replace")
    if "#" in name:
        name = name.split("#")[1]
    return name


class _Collector:
    """The evaluation callback: squared inputs of weight matrix products, summed per column."""

    def __init__(self, ll: Any, ggml: Any) -> None:
        self.ggml = ggml
        self.sums: dict[str, np.ndarray] = {}  # (experts, columns) float64
        self.counts: dict[str, np.ndarray] = {}  # (experts,) int64
        self.error: BaseException | None = None
        self.callback = ll.ggml_backend_sched_eval_callback(self._on_tensor)  # kept alive here

    def raise_error(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            if not isinstance(err, Exception):
                raise err  # KeyboardInterrupt and the like stay what they are
            raise EngineError(f"collecting activations failed: {err}") from err

    def _on_tensor(self, ptr: int, ask: bool, _user: Any) -> bool:
        if self.error is not None:
            return False  # the rest of this decode runs without us; the error is raised after it
        try:
            t = _GgmlTensor.from_address(ptr)
            if ask:
                return self._wants(t)
            self._collect(t)
            return True
        except BaseException as e:  # an exception must not unwind through C: stop, report after
            self.error = e
            return False

    def _wants(self, t: _GgmlTensor) -> bool:
        if t.op == _OP_MUL_MAT_ID:
            return True
        if t.op != _OP_MUL_MAT:
            return False
        src1 = t.src[1].contents
        if src1.ne[1] < MIN_ROWS or src1.type != _TYPE_F32:
            return False
        return _weight_name(t.src[0].contents.name).startswith("blk.")

    def _array(self, t: _GgmlTensor, dtype: type) -> np.ndarray:
        """A tensor's elements as an (ne3, ne2, ne1, ne0) array (copied off a GPU when needed)."""
        nbytes = self.ggml.ggml_nbytes(ctypes.addressof(t))
        if t.buffer and self.ggml.ggml_backend_buffer_is_host(t.buffer):
            buf: Any = (ctypes.c_char * nbytes).from_address(t.data)
        else:
            buf = (ctypes.c_char * nbytes)()
            self.ggml.ggml_backend_tensor_get(ctypes.addressof(t), buf, 0, nbytes)
        return np.ndarray(shape=tuple(reversed(t.ne)), dtype=dtype, buffer=buf,
                          strides=tuple(reversed(t.nb)))

    def _entry(self, name: str, n_mat: int, ne0: int) -> tuple[np.ndarray, np.ndarray]:
        if name not in self.sums:
            self.sums[name] = np.zeros((n_mat, ne0), dtype=np.float64)
            self.counts[name] = np.zeros(n_mat, dtype=np.int64)
        sums, counts = self.sums[name], self.counts[name]
        if sums.shape != (n_mat, ne0):
            raise ValueError(f"inconsistent size for {name}: {sums.shape} vs {(n_mat, ne0)}")
        return sums, counts

    def _collect(self, t: _GgmlTensor) -> None:
        src0, src1 = t.src[0].contents, t.src[1].contents
        name = _weight_name(src0.name)
        x = self._array(src1, np.float32)  # (ne3, ne2, ne1, ne0)
        ne0 = int(src1.ne[0])
        if t.op == _OP_MUL_MAT_ID:
            # src1 [cols, n_used or 1, n_tokens]; ids [n_used, n_tokens] (i32, maybe strided)
            ids = self._array(t.src[2].contents, np.int32)[0, 0]  # (n_tokens, n_used)
            n_as = int(src0.ne[2])
            sums, counts = self._entry(name, n_as, ne0)
            for idx in range(ids.shape[1]):
                ex = ids[:, idx].astype(np.int64)
                if ex.size and (ex.min() < 0 or ex.max() >= n_as):
                    raise ValueError(f"expert id out of range in {name}")
                xs = x[0, :, idx % x.shape[2], :].astype(np.float64)
                np.add.at(sums, ex, xs * xs)
                counts += np.bincount(ex, minlength=n_as)
        else:
            s2, s3 = int(src0.ne[2]), int(src0.ne[3])
            sums, counts = self._entry(name, s2 * s3, ne0)
            sq = np.einsum("abij,abij->abj", x, x, dtype=np.float64)  # (ne3, ne2, ne0)
            for i3 in range(sq.shape[0]):
                for i2 in range(sq.shape[1]):
                    sums[(i3 % s3) * s2 + (i2 % s2)] += sq[i3, i2]
            counts += int(np.prod(x.shape[:3])) // (s2 * s3)
        if not np.isfinite(sums).all():
            raise ValueError(f"non-finite activations in {name}")


# -- the file -------------------------------------------------------------------------------------

def write_imatrix(path: str | os.PathLike[str], sums: dict[str, np.ndarray], counts: dict[str, np.ndarray],
                  datasets: Sequence[str], chunk_count: int, chunk_size: int) -> None:
    """Write llama-imatrix's GGUF format (path is written in place: callers pass a temporary name)."""
    import gguf

    class _Writer(gguf.GGUFWriter):
        def add_architecture(self) -> None:
            pass  # llama-imatrix writes no general.architecture

    w = _Writer(os.fspath(path), arch="")
    w.add_type(gguf.GGUFType.IMATRIX)
    w.add_array(gguf.Keys.IMatrix.DATASETS, list(datasets))
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, chunk_count)
    w.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, chunk_size)
    for name in sorted(sums):
        c = np.asarray(counts[name], dtype=np.float32).reshape(-1)
        s = np.asarray(sums[name], dtype=np.float32).reshape(len(c), -1)
        # ggml drops trailing dimensions of 1: a dense weight's entry is 1-D, an expert stack 2-D
        w.add_tensor(f"{name}.in_sum2", s[0] if len(c) == 1 else s)
        w.add_tensor(f"{name}.counts", c if len(c) == 1 else c.reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
