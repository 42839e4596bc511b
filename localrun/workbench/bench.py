"""llama-bench's measurements (pp, tg, pp+tg) through llama-cpp-python's low-level API.

This reproduces tools/llama-bench/llama-bench.cpp of the llama.cpp that llama-cpp-python vendors:
the same tests in the same order (the cartesian product of the settings, the model reloaded only
when its load settings change, a fresh context per test), the same model and context parameters
(n_ctx = n_prompt + n_gen, swa_full off), the same ggml threadpool (poll 50) attached to the
context, the same warm-up, the same random tokens (glibc's unseeded rand()) and the same timed
region (one llama_decode per n_batch chunk, then a synchronize; tg: one token per llama_decode,
synchronized, no sampling). The tokens of a repetition are drawn just before its clock starts.

`run_bench` measures in this process; `iter_bench_isolated` runs the same code as a job in a
child process (backends/isolation.py), where a native abort on a bad file becomes an
EngineCrashedError instead of taking the caller down.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from itertools import product
from pathlib import Path
from typing import Any

from localrun.errors import EngineError, UsageError

# llama-bench's names for the KV cache types it accepts, and ggml's numbers for them.
CACHE_TYPES = {"f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "iq4_nl": 20}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # llama_flash_attn_type, as llama-bench reports it
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}
POLL = 50  # llama-bench's default --poll
_CPU_DEVICE = 0  # GGML_BACKEND_DEVICE_TYPE_CPU
Progress = Callable[[str], None]


def physical_cores() -> int:
    """llama-bench's default thread count: physical cores (one per set of thread siblings)."""
    siblings = set()
    cpu = 0
    while True:
        try:
            siblings.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings").read_text().strip())
        except OSError:
            break
        cpu += 1
    if siblings:
        return len(siblings)
    n = os.cpu_count() or 4
    return n if n <= 4 else n // 2


@dataclass(frozen=True)
class BenchChoices:
    """The words llama-bench accepts for its settings (the CLI's choices)."""

    cache_types: tuple[str, ...] = tuple(CACHE_TYPES)
    load_modes: tuple[str, ...] = tuple(LOAD_MODES)


@dataclass(frozen=True)
class BenchCase:
    """One test (llama-bench's cmd_params_instance): a model and the settings it runs with."""

    model_path: str
    model: str  # the name it is shown under
    n_prompt: int
    n_gen: int
    n_batch: int
    n_ubatch: int
    type_k: str
    type_v: str
    n_threads: int
    n_gpu_layers: int
    flash_attn: int  # -1 auto, 0 off, 1 on
    load_mode: str

    @property
    def test(self) -> str:
        """llama-bench's name of the test: pp512, tg128 or pp512+tg128."""
        if self.n_gen == 0:
            return f"pp{self.n_prompt}"
        if self.n_prompt == 0:
            return f"tg{self.n_gen}"
        return f"pp{self.n_prompt}+tg{self.n_gen}"

    def model_key(self) -> tuple[str, int, str]:
        """What the loaded model depends on: tests with the same key share one load."""
        return (self.model_path, self.n_gpu_layers, self.load_mode)


@dataclass(frozen=True)
class BenchSpec:
    """What to measure: each setting takes several values and the run is their product.

    Defaults are llama-bench's (-p 512 -n 128 -b 2048 -ub 512 -r 5, f16 cache, all layers on the
    GPU, flash attention auto, one thread per physical core).
    """

    models: tuple[str, ...]  # GGUF paths
    names: tuple[str, ...] = ()  # display names, one per model (default: the file's stem)
    n_prompt: tuple[int, ...] = (512,)
    n_gen: tuple[int, ...] = (128,)
    n_pg: tuple[tuple[int, int], ...] = ()
    n_batch: tuple[int, ...] = (2048,)
    n_ubatch: tuple[int, ...] = (512,)
    type_k: tuple[str, ...] = ("f16",)
    type_v: tuple[str, ...] = ("f16",)
    n_threads: tuple[int, ...] = field(default_factory=lambda: (physical_cores(),))
    n_gpu_layers: tuple[int, ...] = (-1,)
    flash_attn: tuple[int, ...] = (-1,)
    load_mode: tuple[str, ...] = ("auto",)
    repetitions: int = 5
    warmup: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise UsageError for a value llama-bench would reject."""
        if not self.models:
            raise UsageError("no model to benchmark", "name at least one model")
        if self.names and len(self.names) != len(self.models):
            raise UsageError("one name per model is needed")
        for label, values, low in (("-p", self.n_prompt, 0), ("-n", self.n_gen, 0), ("-b", self.n_batch, 1),
                                   ("-ub", self.n_ubatch, 1), ("-t", self.n_threads, 1)):
            if not values or any(v < low for v in values):
                raise UsageError(f"{label}: expected numbers >= {low}, got {','.join(map(str, values)) or 'none'}")
        for label, words, known in (("-ctk", self.type_k, CACHE_TYPES), ("-ctv", self.type_v, CACHE_TYPES),
                                    ("-lm", self.load_mode, LOAD_MODES)):
            bad = [w for w in words if w not in known]
            if bad or not words:
                raise UsageError(f"{label}: unknown value {bad[0] if bad else 'none'!r}", f"use one of {', '.join(known)}")
        if not self.flash_attn or any(v not in FLASH_ATTN.values() for v in self.flash_attn):
            raise UsageError(f"-fa: expected -1 (auto), 0 (off) or 1 (on), got {self.flash_attn}")
        if any(p < 0 or g < 0 for p, g in self.n_pg):
            raise UsageError("-pg: expected pairs of numbers >= 0")
        if self.repetitions < 1:
            raise UsageError(f"-r: expected a number >= 1, got {self.repetitions}")
        if not self.cases():
            raise UsageError("nothing to measure: every -p and -n is 0", "give -p or -n a value above 0")

    def cases(self) -> list[BenchCase]:
        """The tests in llama-bench's order (which reloads each model as rarely as possible)."""
        names = self.names or tuple(Path(m).stem for m in self.models)
        out: list[BenchCase] = []
        for (path, name), ngl, lm, nb, nub, tk, tv, fa, nt in product(
                zip(self.models, names, strict=True), self.n_gpu_layers, self.load_mode, self.n_batch, self.n_ubatch,
                self.type_k, self.type_v, self.flash_attn, self.n_threads):
            tests = [(p, 0) for p in self.n_prompt if p] + [(0, g) for g in self.n_gen if g]
            tests += [pg for pg in self.n_pg if pg != (0, 0)]
            out += [BenchCase(path, name, p, g, nb, nub, tk, tv, nt, ngl, fa, lm) for p, g in tests]
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchSpec:
        values = {f.name: d[f.name] for f in fields(cls) if f.name in d}
        for k, v in values.items():
            if isinstance(v, list):
                values[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        return cls(**values)


@dataclass(frozen=True)
class BenchRecord:
    """One test's result: its settings, the model, and the time of each repetition.

    The JSON names are llama-bench's (model_type, avg_ts, stddev_ts, samples_ns, ...), so tools
    that read llama-bench's -o json read these too.
    """

    case: BenchCase
    model_type: str  # llama_model_desc: architecture, size, file type
    model_size: int  # bytes of tensors
    model_n_params: int
    backend: str  # "CPU", "CUDA", "Metal", ...
    test_time: str  # RFC 3339, when the test started
    samples_ns: tuple[int, ...]

    @property
    def test(self) -> str:
        return self.case.test

    @property
    def samples_ts(self) -> tuple[float, ...]:
        """Tokens per second of each repetition."""
        n = self.case.n_prompt + self.case.n_gen
        return tuple(1e9 * n / t for t in self.samples_ns)

    @property
    def avg_ts(self) -> float:
        """Mean of the repetitions' tokens per second (llama-bench's t/s)."""
        return statistics.fmean(self.samples_ts)

    @property
    def stddev_ts(self) -> float:
        """Sample standard deviation of tokens per second (0 for one repetition)."""
        ts = self.samples_ts
        return statistics.stdev(ts) if len(ts) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A flat JSON-ready dict with every setting, the samples, mean and deviation."""
        ns = self.samples_ns
        d: dict[str, Any] = {**asdict(self.case), "test": self.test, "model_filename": self.case.model_path}
        d.pop("model_path")
        d.update(model_type=self.model_type, model_size=self.model_size, model_n_params=self.model_n_params,
                 backends=self.backend, test_time=self.test_time, avg_ns=round(statistics.fmean(ns)),
                 stddev_ns=round(statistics.stdev(ns)) if len(ns) > 1 else 0, avg_ts=self.avg_ts,
                 stddev_ts=self.stddev_ts, samples_ns=list(ns), samples_ts=list(self.samples_ts))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchRecord:
        case = BenchCase(**{f.name: d["model_filename" if f.name == "model_path" else f.name]
                            for f in fields(BenchCase)})
        return cls(case, d["model_type"], d["model_size"], d["model_n_params"], d["backends"], d["test_time"],
                   tuple(d["samples_ns"]))


class _GlibcRand:
    """glibc's rand() from its default seed (1), which llama-bench's std::rand() calls are."""

    def __init__(self) -> None:
        r = [1]
        for _ in range(30):
            hi, lo = divmod(r[-1], 127773)
            word = 16807 * lo - 2836 * hi
            r.append(word + 2147483647 if word < 0 else word)
        r += r[:3]
        self.ring, self.i = r, 34
        for _ in range(310):  # srandom discards the first 310 outputs
            self()

    def __call__(self) -> int:
        ring, i = self.ring, self.i
        v = (ring[(i - 31) % 34] + ring[(i - 3) % 34]) & 0xFFFFFFFF
        ring[i % 34] = v
        self.i = i + 1
        return v >> 1


class _Ggml:
    """The threadpool and backend-name calls of llama-bench, through the loader's libggml."""

    def __init__(self, ll: Any) -> None:
        from localrun.backends.llama_loader import ThreadpoolParams, libggml

        lib = self.lib = libggml()
        vp = ctypes.c_void_p
        self.attach = ctypes.CFUNCTYPE(None, vp, vp, vp)(("llama_attach_threadpool", ll._lib))
        # As llama-bench does: the CPU backend's own threadpool functions, found through its registry.
        cpu = lib.ggml_backend_dev_by_type(_CPU_DEVICE)
        reg = lib.ggml_backend_dev_backend_reg(cpu) if cpu else None
        new = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_new") if reg else None
        free = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_threadpool_free") if reg else None
        if not (new and free):
            raise EngineError("this llama.cpp build has no CPU backend threadpool", "reinstall llama-cpp-python")
        self.threadpool_new = ctypes.CFUNCTYPE(vp, ctypes.POINTER(ThreadpoolParams))(new)
        self.threadpool_free = ctypes.CFUNCTYPE(None, vp)(free)

    def threadpool(self, n_threads: int) -> Any:
        """llama-bench's threadpool: default params, no CPU mask, not strict, poll 50."""
        tpp = self.lib.ggml_threadpool_params_default(n_threads)
        tpp.strict_cpu = False
        tpp.poll = POLL
        tpp.prio = 0  # GGML_SCHED_PRIO_NORMAL
        tp = self.threadpool_new(ctypes.byref(tpp))
        if not tp:
            raise EngineError(f"cannot create a threadpool of {n_threads} threads", "try a smaller -t")
        return tp

    def backend(self) -> str:
        """llama-bench's backend column: the registered backends other than the CPU."""
        lib, names, rpc = self.lib, [], False
        for i in range(lib.ggml_backend_reg_count()):
            reg = lib.ggml_backend_reg_get(i)
            name = lib.ggml_backend_reg_name(reg).decode()
            if name.startswith("RPC"):
                rpc = rpc or lib.ggml_backend_reg_dev_count(reg) > 0
            elif name != "CPU":
                names.append(name)
        return ",".join(names + (["RPC"] if rpc else [])) or "CPU"


class _Bench:
    """The measurement loop of llama-bench, one test at a time."""

    def __init__(self) -> None:
        from localrun.backends.llama_loader import library

        ll = library()
        self.ll = ll
        self.ggml = _Ggml(ll)
        self.rand = _GlibcRand()  # one stream for the whole run, as in one llama-bench process
        self.model: Any = None
        self.key: tuple[str, int, str] | None = None

    def close(self) -> None:
        if self.model:
            self.ll.llama_model_free(self.model)
            self.model, self.key = None, None

    def load(self, case: BenchCase) -> Any:
        """The case's model, reusing the loaded one when the load settings are unchanged."""
        from localrun.backends.llama_loader import load_model, model_params

        if self.model and self.key == case.model_key():
            return self.model
        self.close()
        params = model_params(case.n_gpu_layers, load_mode=LOAD_MODES[case.load_mode])
        self.model = load_model(case.model_path, case.model, params)
        self.key = case.model_key()
        return self.model

    def context(self, model: Any, case: BenchCase) -> Any:
        from localrun.backends.llama_loader import new_context

        ll = self.ll
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = case.n_prompt + case.n_gen
        cparams.n_batch = case.n_batch
        cparams.n_ubatch = case.n_ubatch
        cparams.type_k = CACHE_TYPES[case.type_k]
        cparams.type_v = CACHE_TYPES[case.type_v]
        cparams.offload_kqv = True
        cparams.flash_attn_type = case.flash_attn
        cparams.embeddings = False
        cparams.op_offload = True
        cparams.swa_full = False
        return new_context(model, cparams, f"a context for '{case.model}' ({case.test}, -b {case.n_batch}, "
                           f"-ub {case.n_ubatch}, -ctk {case.type_k}, -ctv {case.type_v}, -fa {case.flash_attn})",
                           "try smaller -p, -n or -b values")

    def run(self, case: BenchCase, repetitions: int, warmup: bool, note: Progress) -> BenchRecord:
        ll = self.ll
        model = self.load(case)
        ctx = self.context(model, case)
        tp = None
        try:
            desc = ctypes.create_string_buffer(128)
            ll.llama_model_desc(model, desc, len(desc))
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            mem = ll.llama_get_memory(ctx)
            ll.llama_memory_clear(mem, False)
            tp = self.ggml.threadpool(case.n_threads)
            self.ggml.attach(ctx, tp, None)
            vocab = ll.llama_model_get_vocab(model)
            first = ll.llama_vocab_bos(vocab) if ll.llama_vocab_get_add_bos(vocab) else None
            n_vocab = ll.llama_vocab_n_tokens(vocab)
            if warmup:
                if case.n_prompt:
                    note("warm-up prompt run")
                    self.prompt(ctx, self.prompt_batches(case, first, n_vocab), case.n_threads)
                if case.n_gen:
                    note("warm-up generation run")
                    self.gen(ctx, self.gen_tokens(1, first, n_vocab), case.n_threads)
            samples = []
            for rep in range(repetitions):
                ll.llama_memory_clear(mem, False)
                note(f"run {rep + 1}/{repetitions}")
                batches = self.prompt_batches(case, first, n_vocab) if case.n_prompt else []
                gen = self.gen_tokens(case.n_gen, first, n_vocab) if case.n_gen else []
                t0 = time.perf_counter_ns()
                if batches:
                    self.prompt(ctx, batches, case.n_threads)
                if gen:
                    self.gen(ctx, gen, case.n_threads)
                samples.append(time.perf_counter_ns() - t0)
            return BenchRecord(case, desc.value.decode(errors="replace"), ll.llama_model_size(model),
                               ll.llama_model_n_params(model), self.ggml.backend(), stamp, tuple(samples))
        finally:
            ll.llama_free(ctx)
            if tp:
                self.ggml.threadpool_free(tp)

    def prompt_batches(self, case: BenchCase, first: int | None, n_vocab: int) -> list[tuple[Any, Any]]:
        """test_prompt's chunks: n_prompt tokens (a BOS first if the vocabulary adds one) in n_batch pieces.

        Each is a llama_batch_get_one batch, as common_batch_get_one builds: sequence 0, positions
        continuing the memory, logits for the last token only.
        """
        ll, rand = self.ll, self.rand
        out = []
        for start in range(0, case.n_prompt, case.n_batch):
            n = min(case.n_prompt - start, case.n_batch)
            tokens = [first if start == 0 and first is not None else rand() % n_vocab]
            tokens += [rand() % n_vocab for _ in range(n - 1)]
            arr = (ll.llama_token * n)(*tokens)
            out.append((arr, ll.llama_batch_get_one(arr, n)))  # the batch points into arr: keep both
        return out

    def gen_tokens(self, n_gen: int, first: int | None, n_vocab: int) -> list[int]:
        """test_gen's tokens: a BOS (or random) token, then a random one after each decode."""
        tokens = [first if first is not None else self.rand() % n_vocab]
        tokens += [self.rand() % n_vocab for _ in range(n_gen)]  # the last is drawn but never decoded
        return tokens[:n_gen]

    def prompt(self, ctx: Any, batches: list[tuple[Any, Any]], n_threads: int) -> None:
        ll = self.ll
        ll.llama_set_n_threads(ctx, n_threads, n_threads)
        for _, batch in batches:
            rc = ll.llama_decode(ctx, batch)
            if rc != 0:
                raise _decode_error("prompt", rc)
        ll.llama_synchronize(ctx)

    def gen(self, ctx: Any, tokens: list[int], n_threads: int) -> None:
        ll = self.ll
        ll.llama_set_n_threads(ctx, n_threads, n_threads)
        arr = (ll.llama_token * 1)()
        batch = ll.llama_batch_get_one(arr, 1)
        decode, sync = ll.llama_decode, ll.llama_synchronize
        for tok in tokens:
            arr[0] = tok
            rc = decode(ctx, batch)
            if rc != 0:
                raise _decode_error("generation", rc)
            sync(ctx)


def _decode_error(what: str, rc: int) -> EngineError:
    from localrun.backends.llama_loader import last_log_error

    reason = last_log_error()
    return EngineError(f"llama_decode failed in the {what} run (code {rc}){': ' + reason if reason else ''}",
                       "try a smaller -b or -ub")


def iter_bench(spec: BenchSpec, progress: Progress | None = None) -> Iterator[BenchRecord]:
    """Measure every test of spec in this process, yielding each record when its test ends.

    Args:
        spec: the models and settings; every combination is one test per -p, -n and -pg value.
        progress: called with a line on each step ("bench 2/4 (tg128, 'x', 2 threads): run 3/5").

    Raises:
        BackendUnavailableError: llama-cpp-python is not installed.
        BadModelFileError: a model that llama.cpp cannot load.
        EngineError: a context or a decode that failed.
    """
    cases = spec.cases()
    bench = _Bench()
    try:
        for i, case in enumerate(cases, 1):
            what = f"bench {i}/{len(cases)} ({case.test}, '{case.model}', {case.n_threads} threads)"

            def note(msg: str, what: str = what) -> None:
                if progress is not None:
                    progress(f"{what}: {msg}")

            yield bench.run(case, spec.repetitions, spec.warmup, note)
    finally:
        bench.close()


def run_bench(spec: BenchSpec, progress: Progress | None = None) -> list[BenchRecord]:
    """Measure every test of spec in this process (see iter_bench); a native abort ends the process."""
    return list(iter_bench(spec, progress))


def iter_bench_isolated(spec: BenchSpec, progress: Progress | None = None) -> Iterator[BenchRecord]:
    """iter_bench in a child process: a crash of llama.cpp becomes an EngineCrashedError.

    Raises:
        EngineCrashedError: the child died (the message has its last words).
        LocalrunError: whatever iter_bench raised in the child, as the same class.
    """
    from localrun.backends.isolation import Job

    names = ", ".join(spec.names or tuple(Path(m).name for m in spec.models))
    with Job("localrun.workbench.bench:job", f"benchmarking {names}") as job:
        for event in job.stream(spec.to_dict()):
            if "record" in event:
                yield BenchRecord.from_dict(event["record"])
            elif progress is not None:
                progress(event["progress"])


def run_bench_isolated(spec: BenchSpec, progress: Progress | None = None) -> list[BenchRecord]:
    """Measure every test of spec in a child process (see iter_bench_isolated)."""
    return list(iter_bench_isolated(spec, progress))


def job(request: dict[str, Any], emit: Callable[[Any], None]) -> None:
    """The isolated side (see backends/isolation.py): progress lines and records as events."""
    for record in iter_bench(BenchSpec.from_dict(request), lambda line: emit({"progress": line})):
        emit({"record": record.to_dict()})


def summary(records: list[BenchRecord]) -> dict[str, float]:
    """Mean tokens/s by test name ({'pp512': ..., 'tg128': ...}), averaged over the records."""
    out: dict[str, list[float]] = {}
    for r in records:
        out.setdefault(r.test, []).append(r.avg_ts)
    return {k: statistics.fmean(v) for k, v in out.items()}
