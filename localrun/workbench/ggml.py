"""libggml beside the libllama that llama-cpp-python loaded, with the signatures of the ggml calls
the workbench makes that llama-cpp-python does not bind (backend registry, threadpools, tensors)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any


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
    """The ggml library of the loaded llama.cpp (LLAMA_CPP_LIB_PATH included), its calls typed."""
    from llama_cpp._ctypes_extensions import load_shared_library

    from localrun.backends.llama_loader import library

    lib = load_shared_library("ggml", Path(library().llama_cpp._base_path))
    for name, res, args in _SIGNATURES:
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib
