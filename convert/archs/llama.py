"""Llama 2/3.x, TinyLlama, SmolLM/SmolLM2: Q/K rows permuted to llama.cpp's rotary layout."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import Arch, TensorSpec, llama3_rope_factors, permute_rows


@register("LlamaForCausalLM", "LLaMAForCausalLM")
class Llama(Arch):
    gguf_arch = gguf.MODEL_ARCH.LLAMA

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        w.add_vocab_size(int(self.need("vocab_size")))
        w.add_rope_dimension_count(self.head_dim())

    def add_bos_token(self) -> bool | None:
        # The 49,152-token vocabulary (SmolLM, SmolLM2, Granite 3's small models) adds no BOS in
        # transformers, and its tokenizer_config.json does not say so: llama.cpp's converter
        # writes the False for it, so the file says what the model expects.
        return False if self.get("vocab_size") == 49152 else None

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        n_head = int(self.need("num_attention_heads"))
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return permute_rows(n_head)
        if name.endswith(("k_proj.weight", "k_proj.bias")):
            return permute_rows(int(self.get("num_key_value_heads", n_head)))
        return None

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        out = super().specs(name, shape)
        for spec in out:
            spec.whole = spec.fn is not None  # the permutation moves rows across blocks
        return out

    def extra_tensors(self) -> list[TensorSpec]:
        rope = self.rope()
        if (rope.get("rope_type") or "").lower() != "llama3":
            return []
        factors = llama3_rope_factors(rope, self.head_dim())
        name = self.tensor_name(gguf.MODEL_TENSOR.ROPE_FREQS)
        return [TensorSpec(name, "", factors.shape, data=factors)]
