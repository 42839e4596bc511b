"""Qwen3-MoE: Qwen3 attention (per-head Q/K norms), routed experts with renormalized top-k weights."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import MoeArch


@register("Qwen3MoeForCausalLM")
class Qwen3Moe(MoeArch):
    gguf_arch = gguf.MODEL_ARCH.QWEN3MOE
    topk_renorm = True
