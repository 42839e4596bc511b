"""Qwen2-VL and Qwen2.5-VL: a Qwen2 text model with M-RoPE (llama.cpp's qwen2vl) and a ViT whose
patch merger projects into it (the projector file, qwen2vl_merger / qwen2.5vl_merger)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import Arch, Piece, TensorSpec
from convert.archs.projector import Projector
from convert.errors import ConvertError

_PATCH_EMBD = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"


def _rows(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w[start:stop]


def _frame(t: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda w: w[:, :, t]


class Qwen2VLProjector(Projector):
    projector_type = gguf.VisionProjectorType.QWEN2VL
    vision_prefixes = ("visual.",)
    renames = (("model.visual.", "visual."),)  # transformers 5's in-memory layout
    block_keys = ("depth",)
    head_keys = ("num_heads",)

    def image_size(self) -> int:
        return int(self.vision.get("image_size", 560))  # llama.cpp's converter's default

    # Qwen2-VL names the ViT's width embed_dim and the merger's output hidden_size; llama.cpp writes
    # the width as the embedding length and the merger's output as the FFN length (Qwen2.5-VL's
    # config has hidden_size and intermediate_size as usual).
    def embedding_length(self) -> int:
        return int(self.vparam("embed_dim" if "embed_dim" in self.vision else "hidden_size"))

    def feed_forward_length(self) -> int:
        return int(
            self.vparam("hidden_size" if "embed_dim" in self.vision else "intermediate_size")
        )

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        self.write_window_attention(w)
        # the top-level key only, as llama.cpp's converter reads it (text_config's is the text's)
        w.add_vision_attention_layernorm_eps(float(self.config.get("rms_norm_eps", 1e-6)))

    def write_window_attention(self, w: gguf.GGUFWriter) -> None:
        """Qwen2.5-VL's windowed attention; Qwen2-VL attends over the whole image in every block."""

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if self.skip(name):
            return []
        source = self.source_name(name)
        if ".attn.qkv." in source:
            # the fused projection's rows are Q, then K, then V
            if shape[0] % 3:
                raise ConvertError(f"tensor {name!r} has {shape[0]} rows, not 3 equal parts")
            c = shape[0] // 3
            out = []
            for i, part in enumerate(("q", "k", "v")):
                new = self.gguf_name(name.replace(".qkv.", f".{part}."))
                if len(shape) == 1:
                    out.append(
                        TensorSpec(new, name, (c,), fn=_rows(i * c, (i + 1) * c), whole=True)
                    )
                else:
                    piece = Piece(name, i * c, (i + 1) * c)
                    out.append(TensorSpec(new, name, (c, *shape[1:]), pieces=(piece,)))
            return out
        if source.startswith("visual.patch_embed.proj.weight"):
            # a 3-D convolution over 2 frames: llama.cpp applies two 2-D ones, one per frame
            if len(shape) != 5 or shape[2] != 2:
                raise ConvertError(
                    f"tensor {name!r} has shape {list(shape)}, expected a temporal patch size of 2",
                    "llama.cpp's Qwen2-VL projector supports temporal_patch_size 2 only",
                )
            frame = (shape[0], shape[1], shape[3], shape[4])
            return [
                TensorSpec(_PATCH_EMBD + suffix, name, frame, fn=_frame(t), whole=True)
                for t, suffix in ((0, ""), (1, ".1"))
            ]
        return super().specs(name, shape)


class Qwen25VLProjector(Qwen2VLProjector):
    projector_type = gguf.VisionProjectorType.QWEN25VL

    def write_window_attention(self, w: gguf.GGUFWriter) -> None:
        w.add_vision_use_silu(True)
        full = self.vision.get("fullatt_block_indexes")
        if not full:
            raise ConvertError(
                "config.json's vision_config lacks 'fullatt_block_indexes'",
                "the checkpoint's config is incomplete",
            )
        # llama.cpp repeats one pattern: every n-th block attends over the whole image
        n = int(full[0]) + 1
        if any(b - a != n for a, b in zip(full, full[1:], strict=False)):
            raise ConvertError(
                f"the full-attention blocks {full} are not evenly spaced",
                "llama.cpp's Qwen2.5-VL projector needs every n-th block to be one",
            )
        w.add_vision_n_wa_pattern(n)


@register("Qwen2VLForConditionalGeneration")
class Qwen2VL(Arch):
    gguf_arch = gguf.MODEL_ARCH.QWEN2VL
    skip_prefixes = ("visual.", "model.visual.")
    projector = Qwen2VLProjector

    def gguf_name(self, name: str) -> str:
        if name.startswith("model.language_model."):  # transformers 5's in-memory layout
            name = "model." + name[len("model.language_model.") :]
        return super().gguf_name(name)

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        sections = list(self.rope().get("mrope_section") or [])
        if sections:
            # M-RoPE's temporal, height and width shares of the rotary pairs, padded to four
            w.add_rope_dimension_sections((sections + [0] * 4)[:4])

    def write_rope_scaling(self, w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
        if (rope.get("rope_type") or "").lower() == "mrope":  # older configs' name for M-RoPE
            return
        super().write_rope_scaling(w, rope)


@register("Qwen2_5_VLForConditionalGeneration")
class Qwen25VL(Qwen2VL):
    projector = Qwen25VLProjector
