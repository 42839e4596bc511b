"""OLMoE: OLMo attention with whole-width Q/K RMS norms, routed experts (top-k weights as is)."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.base import MoeArch
from convert.errors import ConvertError


@register("OlmoeForCausalLM")
class Olmoe(MoeArch):
    gguf_arch = gguf.MODEL_ARCH.OLMOE
    topk_renorm = False
    output_required = True

    def check_experts(self) -> None:
        super().check_experts()
        n_head = int(self.need("num_attention_heads"))
        if int(self.get("num_key_value_heads", n_head)) != n_head:
            raise ConvertError(
                "llama.cpp's olmoe normalizes K over every head, so it needs as many key-value "
                "heads as attention heads",
                "llama.cpp cannot run this variant",
            )
        if self.get("clip_qkv") is not None:
            raise ConvertError(
                "config.json sets clip_qkv, which llama.cpp's olmoe graph does not apply",
                "llama.cpp cannot run this variant as it was trained",
            )
