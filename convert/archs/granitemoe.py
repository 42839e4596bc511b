"""Granite MoE (3.0/3.1 MoE, and its shared-expert variant): the Llama graph with top-k experts and
Granite's scales of the embeddings, residuals, attention and logits."""

from __future__ import annotations

from typing import ClassVar

import gguf

from convert.archs import register
from convert.archs.base import MoeArch, Piece, TensorSpec
from convert.archs.granite import Granite
from convert.errors import ConvertError

_T = gguf.MODEL_TENSOR


@register("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM")
class GraniteMoe(MoeArch, Granite):
    gguf_arch = gguf.MODEL_ARCH.GRANITE_MOE
    # Saved checkpoints fuse each layer's experts: input_linear [n_expert, 2 * n_ff, n_embd]
    # (gate rows, then up rows) and output_linear [n_expert, n_embd, n_ff].
    fused_gate_up: ClassVar[tuple[str, ...]] = (
        *MoeArch.fused_gate_up,
        ".block_sparse_moe.input_linear.weight",
    )
    fused_down: ClassVar[tuple[str, ...]] = (
        *MoeArch.fused_down,
        ".block_sparse_moe.output_linear.weight",
    )

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if n_ff := self.get("shared_intermediate_size"):
            w.add_expert_shared_feed_forward_length(int(n_ff))

    def gguf_name(self, name: str) -> str:
        if name.endswith(".block_sparse_moe.router.weight"):  # transformers 5's in-memory name
            return self.tensor_name(_T.FFN_GATE_INP, self._bid(name))
        return super().gguf_name(name)

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if not name.endswith(".shared_mlp.input_linear.weight"):
            return super().specs(name, shape)
        # The shared expert's gate and up rows, fused like the experts' (one 2D tensor).
        if len(shape) != 2 or shape[0] % 2:
            raise ConvertError(
                f"tensor {name!r} has shape {list(shape)}, expected [2 * n_ff, n_embd]"
            )
        ff, bid = shape[0] // 2, self._bid(name)
        return [
            TensorSpec(self.tensor_name(key, bid), name, (ff, shape[1]), pieces=(piece,))
            for key, piece in (
                (_T.FFN_GATE_SHEXP, Piece(name, 0, ff)),
                (_T.FFN_UP_SHEXP, Piece(name, ff, 2 * ff)),
            )
        ]
