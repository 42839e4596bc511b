"""Hugging Face / PyTorch checkpoints to GGUF, and llama.cpp quantization.

    import convert
    convert.convert("path/to/hf-folder", "model-f16.gguf", outtype="f16")
    convert.from_module(model, tokenizer, "finetuned-q8_0.gguf", outtype="q8_0")
    convert.quantize("model-f16.gguf", "model-q4_k_m.gguf", "q4_k_m")

Never imports localrun; torch only for pickled .bin files and in-memory modules, llama_cpp only in
the quantization child process.
"""

from __future__ import annotations

from convert.archs import supported as supported_architectures
from convert.converter import Result, convert, from_module
from convert.errors import ConvertError
from convert.outtypes import all_outtypes
from convert.plan import Plan, PlannedTensor
from convert.progress import Progress, ProgressCallback, StderrProgress
from convert.quantize import quantize

__all__ = [
    "ConvertError",
    "Plan",
    "PlannedTensor",
    "Progress",
    "ProgressCallback",
    "Result",
    "StderrProgress",
    "all_outtypes",
    "convert",
    "from_module",
    "quantize",
    "supported_architectures",
]
