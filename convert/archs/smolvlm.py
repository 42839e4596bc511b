"""SmolVLM and Idefics3: a Llama text model and a SigLIP vision tower whose patches a pixel
shuffle and one projection map into the text embeddings (the projector file, idefics3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from convert.archs import register
from convert.archs.llama import Llama
from convert.archs.projector import Projector

_TEXT = "model.text_model."


class Idefics3Projector(Projector):
    projector_type = gguf.VisionProjectorType.IDEFICS3
    vision_prefixes = ("model.vision_model.", "model.connector.")
    f32_embeddings = True

    def __init__(
        self,
        config: dict[str, Any],
        preprocessor: dict[str, Any] | None = None,
        folder: Path | None = None,
    ) -> None:
        super().__init__(config, preprocessor, folder)
        if self.vision.get("model_type") == "smolvlm_vision":
            # SmolVLM2's config leaves out transformers' defaults (llama.cpp's converter fills them)
            defaults = {"hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 3072}
            self.vision = {**defaults, **self.vision}

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        w.add_vision_attention_layernorm_eps(float(self.vision.get("layer_norm_eps", 1e-5)))
        w.add_vision_projector_scale_factor(int(self.config.get("scale_factor", 2)))
        w.add_vision_use_gelu(True)
        # the longest side the image processor resizes to before splitting the image into tiles
        longest = (self.preprocessor.get("size") or {}).get("longest_edge", self.image_size())
        w.add_vision_preproc_image_size(int(longest))


@register("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
class Idefics3(Llama):
    skip_prefixes = ("model.vision_model.", "model.connector.")
    projector = Idefics3Projector

    def __init__(self, config: dict[str, Any]) -> None:
        text = config.get("text_config") or {}
        if text.get("architectures") == ["VLlama3ForCausalLM"]:
            # SmolVLM2 leaves the head count out: llama.cpp's converter assumes 32, as transformers
            text = {"num_attention_heads": 32, **text}
            config = {**config, "text_config": text}
        super().__init__(config)

    def gguf_name(self, name: str) -> str:
        if name.startswith(_TEXT):
            name = "model." + name[len(_TEXT) :]
        return super().gguf_name(name)
