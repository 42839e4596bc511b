"""Qwen1.5-MoE / Qwen2-MoE: Qwen2 attention, routed experts plus a sigmoid-gated shared expert."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import MoeArch


@register("Qwen2MoeForCausalLM")
class Qwen2Moe(MoeArch):
    gguf_arch = gguf.MODEL_ARCH.QWEN2MOE
    topk_renorm = False  # llama.cpp's graph keeps the softmax weights of the top k as they are
    output_required = True

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if (n_ff := self.get("shared_expert_intermediate_size")) is not None:
            w.add_expert_shared_feed_forward_length(int(n_ff))
