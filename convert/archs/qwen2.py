"""Qwen2 / Qwen2.5: Llama-like with Q/K/V biases; llama.cpp uses NEOX rope, so no permutation."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import Arch


@register("Qwen2ForCausalLM")
class Qwen2(Arch):
    gguf_arch = gguf.MODEL_ARCH.QWEN2
