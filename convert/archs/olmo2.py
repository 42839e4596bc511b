"""OLMo 2: norms after attention and after the MLP (none before), Q/K RMS norms over the whole
projection; gguf-py's tensor map names them all, and llama.cpp uses NEOX rope (no permutation)."""

from __future__ import annotations

from typing import ClassVar

import gguf

from convert.archs import register
from convert.archs.base import Arch, TensorSpec


@register("Olmo2ForCausalLM")
class Olmo2(Arch):
    gguf_arch = gguf.MODEL_ARCH.OLMO2
    embeddings: ClassVar[str] = "model.embed_tokens.weight"

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        out = super().specs(name, shape)
        if name == self.embeddings and self.get("tie_word_embeddings", False):
            # llama.cpp's OLMo 2 requires an output matrix: a tied checkpoint gets a copy
            out.append(TensorSpec(self.tensor_name(gguf.MODEL_TENSOR.OUTPUT), name, shape))
        return out
