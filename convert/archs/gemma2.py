"""Gemma 2: (1 + w) RMS norms, logit soft-capping, alternating sliding-window layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import Arch, add_one


class GemmaBase(Arch):
    """What Gemma 2 and 3 share."""

    skip_prefixes: ClassVar[tuple[str, ...]] = ("lm_head.",)  # always tied to the embeddings

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        return add_one if name.endswith("norm.weight") else None

    def write_swa(self, w: gguf.GGUFWriter) -> None:
        window = self.get("sliding_window")
        if not window:
            return
        w.add_sliding_window(int(window))
        layer_types = self.get("layer_types")
        if layer_types and len(layer_types) == self.n_layers:
            w.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types])


@register("Gemma2ForCausalLM")
class Gemma2(GemmaBase):
    gguf_arch = gguf.MODEL_ARCH.GEMMA2

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if self.config.get("head_dim") is None:  # else written already, from the config
            hd = self.head_dim()
            w.add_key_length(hd)
            w.add_value_length(hd)
        if (cap := self.get("attn_logit_softcapping")) is not None:
            w.add_attn_logit_softcapping(float(cap))
        if (cap := self.get("final_logit_softcapping")) is not None:
            w.add_final_logit_softcapping(float(cap))
        self.write_swa(w)
