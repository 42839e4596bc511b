"""Qwen3 (dense): Qwen2 without biases, with per-head Q/K RMS norms."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import Arch


@register("Qwen3ForCausalLM")
class Qwen3(Arch):
    gguf_arch = gguf.MODEL_ARCH.QWEN3
