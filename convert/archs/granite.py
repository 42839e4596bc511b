"""Granite 3 (dense): the Llama graph with embedding, residual, attention and logit multipliers."""

from __future__ import annotations

from typing import Any

import gguf

from convert.archs import register
from convert.archs.llama import Llama


@register("GraniteForCausalLM")
class Granite(Llama):
    gguf_arch = gguf.MODEL_ARCH.GRANITE

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        # Granite's head size is hidden_size / heads (transformers ignores head_dim, as llama.cpp does)
        self.config = {k: v for k, v in self.config.items() if k != "head_dim"}

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        # transformers' defaults are 1.0; llama.cpp requires the logit scale
        w.add_attention_scale(float(self.get("attention_multiplier", 1.0)))
        w.add_embedding_scale(float(self.get("embedding_multiplier", 1.0)))
        w.add_residual_scale(float(self.get("residual_multiplier", 1.0)))
        w.add_logit_scale(float(self.get("logits_scaling", 1.0)))
