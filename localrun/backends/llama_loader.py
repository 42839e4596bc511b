"""How localrun opens llama.cpp: the library (with its log routed to a ring buffer), a model file
and a context, each failure a LocalrunError that names the file and llama.cpp's own reason.

The engine (llama_cpp.py) and the workbench (localrun/workbench/) load models through this one
module, so they read llama.cpp's log and report its failures the same way.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import re
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun.errors import BackendUnavailableError, BadModelFileError, EngineError

_OFFLOAD_RE = re.compile(r"offloaded (\d+/\d+) layers to GPU")
# llama.cpp logs (at debug level) each tensor an override places: "tensor blk.0.ffn_up_exps.weight
# (0 MiB f32) buffer type overridden to CPU".
_OVERRIDE_RE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
# llama.cpp logs each KV cache a context creates: "llama_kv_cache: size =   22.50 MiB (  4096 cells,
# 30 layers,  1/1 seqs), K (q8_0):   11.95 MiB, V (q8_0):   11.95 MiB".
_KV_RE = re.compile(r"size = +[\d.]+ MiB \( *(\d+) cells, +(\d+) layers, +\d+/(\d+) seqs\), "
                    r"K \((\w+)\): +([\d.]+) MiB, V \((\w+)\): +([\d.]+) MiB")
# ggml's type ids of the KV-cache types (LoadOptions.kv_type), as llama_context_params.type_k/type_v take them
GGML_KV_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


@dataclass(frozen=True)
class KvCacheReport:
    """One KV cache as llama.cpp reported it when it created a context (sizes in MiB, 2 decimals)."""

    cells: int
    layers: int
    streams: int
    k_type: str
    k_mib: float
    v_type: str
    v_mib: float

    def to_dict(self) -> dict[str, Any]:
        return {"cells": self.cells, "layers": self.layers, "streams": self.streams, "k_type": self.k_type,
                "k_mib": self.k_mib, "v_type": self.v_type, "v_mib": self.v_mib}
BAD_FILE_HINT = "the file may be corrupt or of an architecture this llama.cpp build does not know"


@dataclass
class LlamaLog:
    """llama.cpp's recent log lines, and what the last model load reported in them."""

    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))
    offloaded: str | None = None  # 'N/M' layers on the GPU, if the load offloaded
    overridden: list[tuple[str, str]] = field(default_factory=list)  # (tensor, buffer type) by override
    kv_caches: list[KvCacheReport] = field(default_factory=list)  # the KV caches of the contexts created since clear()

    def add(self, line: str) -> None:
        self.tail.append(line)
        m = _OFFLOAD_RE.search(line)
        if m:
            self.offloaded = m.group(1)
        o = _OVERRIDE_RE.search(line)
        if o:
            self.overridden.append((o.group(1), o.group(2)))
        k = _KV_RE.search(line)
        if k:
            self.kv_caches.append(KvCacheReport(int(k.group(1)), int(k.group(2)), int(k.group(3)), k.group(4),
                                                float(k.group(5)), k.group(6), float(k.group(7))))

    def clear(self) -> None:
        """Forget earlier lines, so that the next failure's reason is its own."""
        self.tail.clear()
        self.offloaded = None
        self.overridden.clear()
        self.kv_caches.clear()

    def last_error(self) -> str:
        """The last meaningful line llama.cpp logged (often the reason for a failure)."""
        for line in reversed(self.tail):
            line = line.strip()
            if line and ("error" in line.lower() or "failed" in line.lower()):
                return line
        return ""


LOG = LlamaLog()
_STATE: dict[str, Any] = {}  # the ctypes log callback (a collected one segfaults) and the library


def library() -> Any:
    """llama-cpp-python's low-level module, with the log sink installed and the backend initialised.

    Raises:
        BackendUnavailableError: llama-cpp-python is not installed.
    """
    if "ll" in _STATE:
        return _STATE["ll"]
    try:
        ll: Any = _bindings()
    except ImportError as e:
        raise BackendUnavailableError(
            "the llama.cpp engine is not installed (llama-cpp-python is missing)",
            "pip install llama-cpp-python",
        ) from e

    @ll.llama_log_callback
    def sink(level: int, text: bytes, user_data: Any) -> None:
        if text:
            LOG.add(text.decode("utf-8", errors="replace"))

    _STATE["sink"] = sink
    ll.llama_log_set(sink, ctypes.c_void_p(0))
    ll.llama_backend_init()
    _STATE["ll"] = ll
    return ll


def _bindings() -> Any:
    """llama-cpp-python's ctypes bindings (llama_cpp.llama_cpp), without its package's __init__
    unless something imported it already.

    The __init__ also imports the high-level Llama class, with numpy and jinja2: 0.11 s of the
    engine process's start that localrun, which calls the bindings only, would wait for before the
    model starts loading. The package is made without running it, and runs it the first time one of
    its own names is asked for (`llama_cpp.Llama`), so other code in the process sees the whole
    package as usual."""
    if "llama_cpp" not in sys.modules:
        spec = importlib.util.find_spec("llama_cpp")
        if spec is None or spec.loader is None:
            raise ImportError("llama_cpp")
        package = importlib.util.module_from_spec(spec)
        loader = spec.loader

        def whole(name: str) -> Any:
            del package.__getattr__  # once: what __init__ defines is then found as usual
            sys.modules["llama_cpp"] = package
            loader.exec_module(package)
            if "sink" in _STATE:  # its __init__ sets its own log callback (stderr): llama.cpp's log stays ours
                package.llama_log_set(_STATE["sink"], ctypes.c_void_p(0))
            return getattr(package, name)

        package.__getattr__ = whole  # type: ignore[method-assign]
        sys.modules["llama_cpp"] = package
    return importlib.import_module("llama_cpp.llama_cpp")


def last_log_error() -> str:
    """The last meaningful line llama.cpp logged."""
    return LOG.last_error()


def load_model(path: str, name: str, params: Any) -> Any:
    """llama_model_load_from_file with these llama_model_params; `name` is how the error shows it.

    Raises:
        BadModelFileError: llama.cpp could not load the file (its log's reason in the message).
    """
    ll = library()
    LOG.clear()
    model = ll.llama_model_load_from_file(path.encode(), params)
    if not model:
        reason = LOG.last_error() or "llama.cpp could not load it"
        shown = f"'{name}' ({path})" if name != path else path
        raise BadModelFileError(f"cannot load model {shown}: {reason}", BAD_FILE_HINT)
    return model


def model_file(path: Path) -> Path:
    """path, if it is a file.

    Raises:
        BadModelFileError: it is not.
    """
    if not path.is_file():
        raise BadModelFileError(f"model file {path} does not exist", "pass a .gguf file or an installed model's name")
    return path


def model_params(gpu_layers: int, *, vocab_only: bool = False, load_mode: int | None = None) -> Any:
    """llama_model_params: llama.cpp's defaults with these layers on the GPU."""
    ll = library()
    params = ll.llama_model_default_params()
    params.n_gpu_layers = gpu_layers
    params.vocab_only = vocab_only
    if load_mode is not None:
        params.load_mode = load_mode
    return params


def new_context(model: Any, params: Any, what: str, hint: str) -> Any:
    """llama_init_from_model; `what` completes "cannot create ..." when it fails.

    Raises:
        EngineError: the context could not be created (memory, most often).
    """
    ll = library()
    ctx = ll.llama_init_from_model(model, params)
    if not ctx:
        raise EngineError(f"cannot create {what}: {LOG.last_error() or 'not enough memory?'}", hint)
    return ctx


def supports_gpu() -> bool:
    """Whether this llama.cpp build can offload layers to a GPU."""
    return bool(library().llama_supports_gpu_offload())


def vocab_tokens(ll: Any, vocab: Any, data: bytes, add_special: bool, parse_special: bool) -> list[int]:
    """llama_tokenize with a buffer that grows to the count llama.cpp asks for.

    Raises:
        EngineError: llama.cpp could not tokenize the text.
    """
    n_max = len(data) + 16
    buf = (ll.llama_token * n_max)()
    n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:  # -n tokens needed
        n_max = -n
        buf = (ll.llama_token * n_max)()
        n = ll.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
    if n < 0:
        raise EngineError(f"llama.cpp could not tokenize the text (code {n})")
    return list(buf[:n])


class ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml/include/ggml-cpu.h)."""

    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


_VP = ctypes.c_void_p
_SIGNATURES: tuple[tuple[str, Any, list[Any]], ...] = (
    ("ggml_backend_reg_count", ctypes.c_size_t, []),
    ("ggml_backend_reg_get", _VP, [ctypes.c_size_t]),
    ("ggml_backend_reg_name", ctypes.c_char_p, [_VP]),
    ("ggml_backend_reg_dev_count", ctypes.c_size_t, [_VP]),
    ("ggml_backend_dev_by_type", _VP, [ctypes.c_int]),
    ("ggml_backend_dev_buffer_type", _VP, [_VP]),
    ("ggml_backend_dev_backend_reg", _VP, [_VP]),
    ("ggml_backend_reg_get_proc_address", _VP, [_VP, ctypes.c_char_p]),
    ("ggml_threadpool_params_default", ThreadpoolParams, [ctypes.c_int]),
    ("ggml_tensor_overhead", ctypes.c_size_t, []),
    ("ggml_op_name", ctypes.c_char_p, [ctypes.c_int]),
    ("ggml_nbytes", ctypes.c_size_t, [_VP]),
    ("ggml_backend_buffer_is_host", ctypes.c_bool, [_VP]),
    ("ggml_backend_tensor_get", None, [_VP, _VP, ctypes.c_size_t, ctypes.c_size_t]),
)


@functools.cache
def libggml() -> Any:
    """The ggml library beside the loaded libllama (LLAMA_CPP_LIB_PATH included), with the calls
    llama-cpp-python does not bind typed (backend registry, threadpools, tensors)."""
    from llama_cpp._ctypes_extensions import load_shared_library

    lib = load_shared_library("ggml", Path(library()._base_path))
    for name, res, args in _SIGNATURES:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib
