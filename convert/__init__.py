"""Hugging Face / PyTorch checkpoints to GGUF, and llama.cpp quantization.

    import convert
    convert.convert("path/to/hf-folder", "model-f16.gguf", outtype="f16")
    convert.from_module(model, tokenizer, "finetuned-q8_0.gguf", outtype="q8_0")
    convert.quantize("model-f16.gguf", "model-q4_k_m.gguf", "q4_k_m")
    convert.convert_adapter("path/to/peft-lora", "path/to/hf-folder")  # a llama.cpp LoRA adapter
    convert.convert("path/to/hf-folder", "merged.gguf", lora=[("path/to/peft-lora", 1.0)])
    convert.convert("path/to/qwen2-vl", "vl-q4_k_m.gguf", outtype="q4_k_m")  # + mmproj-vl-f16.gguf

Never imports localrun; torch only for pickled .bin files and in-memory modules, llama_cpp only in
the quantization child process.
"""

from __future__ import annotations

from convert.archs import supported as supported_architectures
from convert.converter import AdapterResult, Result, convert, convert_adapter, from_module
from convert.errors import ConvertError
from convert.lora import Adapter, LoraWeight, is_adapter_dir, read_adapter
from convert.outtypes import all_outtypes
from convert.plan import Plan, PlannedTensor
from convert.progress import Progress, ProgressCallback, StderrProgress
from convert.quantize import quantize

__all__ = [
    "Adapter",
    "AdapterResult",
    "ConvertError",
    "LoraWeight",
    "Plan",
    "PlannedTensor",
    "Progress",
    "ProgressCallback",
    "Result",
    "StderrProgress",
    "all_outtypes",
    "convert",
    "convert_adapter",
    "from_module",
    "is_adapter_dir",
    "quantize",
    "read_adapter",
    "supported_architectures",
]
