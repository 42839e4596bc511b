"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini: fused QKV and gate-up projections, partial rotary,
LongRoPE; Phi-4 has no sliding window (null), Phi-4-mini ties its output to the embeddings."""

from __future__ import annotations

import math

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import Arch, TensorSpec
from convert.errors import ConvertError


@register("Phi3ForCausalLM")
class Phi3(Arch):
    gguf_arch = gguf.MODEL_ARCH.PHI3

    def _rope_dims(self) -> int:
        n_embd = int(self.need("hidden_size"))
        n_head = int(self.need("num_attention_heads"))
        partial = self.rope().get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0))
        return int(float(partial) * n_embd) // n_head

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        w.add_context_length(int(self.need("max_position_embeddings")))
        orig = self.rope().get("original_max_position_embeddings") or self.get(
            "original_max_position_embeddings", self.need("max_position_embeddings")
        )
        w.add_rope_scaling_orig_ctx_len(int(orig))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        w.add_block_count(self.n_layers)
        n_head = int(self.need("num_attention_heads"))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(self.get("num_key_value_heads", n_head)))
        w.add_layer_norm_rms_eps(float(self.need("rms_norm_eps")))
        w.add_rope_dimension_count(self._rope_dims())
        w.add_rope_freq_base(float(self.rope().get("rope_theta", 10000.0)))
        # llama.cpp tells Phi-4 (sliding window 0) from Phi-3 by this key.
        w.add_sliding_window(int(self.get("sliding_window", 0)))
        self._write_longrope(w)

    def extra_tensors(self) -> list[TensorSpec]:
        rope = self.rope()
        long_f, short_f = rope.get("long_factor"), rope.get("short_factor")
        if not long_f:
            return []
        rope_type = (rope.get("rope_type") or "").lower()
        if rope_type not in ("su", "longrope"):
            raise ConvertError(
                f"Phi-3 rope type {rope_type!r} is not supported", "supported: longrope"
            )
        if short_f is None or len(long_f) != len(short_f) or len(long_f) * 2 != self._rope_dims():
            raise ConvertError("Phi-3 long/short rope factors do not match the rotary dimensions")
        names = (gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT)
        out = []
        for key, values in zip(names, (long_f, short_f), strict=False):
            data = np.asarray(values, dtype=np.float32)
            out.append(TensorSpec(self.tensor_name(key), "", data.shape, data=data))
        return out

    def _write_longrope(self, w: gguf.GGUFWriter) -> None:
        rope = self.rope()
        if not rope.get("long_factor"):
            return
        orig = float(
            rope.get("original_max_position_embeddings")
            or self.need("original_max_position_embeddings")
        )
        scale = float(self.need("max_position_embeddings")) / orig
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(attn)
