"""Gemma 3 (text): Gemma 2 plus per-head Q/K norms and a separate rope base for local layers."""

from __future__ import annotations

import gguf

from convert.archs import register
from convert.archs.gemma2 import GemmaBase


@register("Gemma3ForCausalLM")
class Gemma3(GemmaBase):
    gguf_arch = gguf.MODEL_ARCH.GEMMA3
    skip_prefixes = ("lm_head.", "vision_tower.", "multi_modal_projector.")

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if self.config.get("head_dim") is None:  # else written already, from the config
            hd = self.head_dim()
            w.add_key_length(hd)
            w.add_value_length(hd)
        if cap := self.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(float(cap))
        self.write_swa(w)
