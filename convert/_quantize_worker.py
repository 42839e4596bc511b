"""Child process for llama.cpp quantization: python -m convert._quantize_worker SRC DST FTYPE THREADS [IMATRIX]."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

from convert.imatrix import load_imatrix


def main(argv: list[str]) -> int:
    src, dst, ftype, threads, imatrix = argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5]
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = threads
    keep: list[object] = []  # ctypes buffers that must outlive the call
    if imatrix:
        entries = load_imatrix(Path(imatrix))
        arr = (llama_cpp.llama_model_imatrix_data * (len(entries) + 1))()
        for i, (name, values) in enumerate(entries.items()):
            values = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(values)
            arr[i].name = name.encode()
            arr[i].data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            arr[i].size = values.size
        arr[len(entries)].name = None
        keep.append(arr)
        params.imatrix = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", flush=True)
    return int(rc != 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
