"""Gemma 3 with images: the Gemma 3 text model and a SigLIP vision tower whose pooled patches a
projection maps into the text embeddings (the projector file, projector type gemma3)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

from convert.archs import register
from convert.archs.base import add_one
from convert.archs.gemma3 import Gemma3
from convert.archs.projector import Projector

_TOWER = "vision_tower.vision_model."
_IN_MEMORY_VISION = ("model.vision_tower.", "model.multi_modal_projector.")


class Gemma3Projector(Projector):
    projector_type = gguf.VisionProjectorType.GEMMA3
    vision_prefixes = (_TOWER, "multi_modal_projector.")
    f32_embeddings = True
    # the published layout nests the SigLIP model in vision_model; transformers 5 saves the tower
    # without it, and keeps everything under model. in memory
    renames = (
        ("model.vision_tower.vision_model.", _TOWER),
        ("model.vision_tower.", _TOWER),
        (_TOWER, _TOWER),
        ("vision_tower.", _TOWER),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def source_name(self, name: str) -> str:
        # the projection is a bare parameter: mm_input_projection_weight
        return super().source_name(name).replace("_weight", ".weight")

    def skip(self, name: str) -> bool:
        return ".vision_model.head." in self.source_name(name) or super().skip(name)

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        w.add_vision_attention_layernorm_eps(float(self.vision.get("layer_norm_eps", 1e-6)))
        w.add_vision_use_gelu(True)
        # patches pooled per side into the image's tokens: llama.cpp assumes 4 (Gemma 3's 896 / 14
        # / 16) and reads the key only where it differs
        per_side = int(int(self.preprocessor.get("image_seq_length", 256)) ** 0.5)
        factor = (self.image_size() // int(self.vparam("patch_size"))) // per_side
        if factor > 0 and factor != 4:
            w.add_vision_projector_scale_factor(factor)

    def tensor_type(
        self, name: str, shape: tuple[int, ...], outtype: gguf.GGMLQuantizationType
    ) -> gguf.GGMLQuantizationType:
        # as llama.cpp's converter: the projection F16 whatever the type
        if name.startswith("mm.input_projection."):
            return gguf.GGMLQuantizationType.F16
        return super().tensor_type(name, shape, outtype)

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        # Gemma's RMS norm multiplies by (1 + weight); the SigLIP norms are plain layer norms
        return add_one if self.source_name(name).endswith("mm_soft_emb_norm.weight") else None


@register("Gemma3ForConditionalGeneration")
class Gemma3VL(Gemma3):
    projector = Gemma3Projector

    def skip(self, name: str) -> bool:
        # Gemma3 skips the published layout's vision tensors; these are transformers 5's in memory
        return name.startswith(_IN_MEMORY_VISION) or super().skip(name)

    def gguf_name(self, name: str) -> str:
        for old in ("language_model.model.", "model.language_model.", "language_model."):
            if name.startswith(old):
                name = "model." + name[len(old) :]
                break
        return super().gguf_name(name)
