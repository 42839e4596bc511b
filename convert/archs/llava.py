"""LLaVA with a Pixtral vision tower (Pixtral 12B) and Mistral 3 (Mistral Small 3.1 and 3.2): a
Llama or Mistral text model and a Pixtral ViT whose patches a two-layer projection (after a patch
merger in Mistral 3) maps into the text embeddings (the projector file, projector type pixtral).

LLaVA with a CLIP tower (llava-hf's LLaVA 1.5) has its projector in llava_clip.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from convert.archs import llava_clip, register, supported_vision
from convert.archs.base import Piece, TensorSpec, permute_rows
from convert.archs.llama import Llama
from convert.archs.projector import Projector
from convert.errors import ConvertError
from convert.source import read_json

# the [IMG_BREAK] embedding's name has no .weight: mtmd reads it so
_IMG_BREAK = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_TOK_EMBD_IMG_BREAK]
# the text model's embeddings, as saved and as transformers 5 holds them in memory
_EMBEDDINGS = (
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
)
_VISION = ("vision_tower.", "multi_modal_projector.")


def token_id(folder: Path | None, text: str) -> int:
    """An added token's id, from tokenizer_config.json or else tokenizer.json (as llama.cpp's
    converter looks it up)."""
    for file, key in (
        ("tokenizer_config.json", "added_tokens_decoder"),
        ("tokenizer.json", "added_tokens"),
    ):
        path = folder / file if folder is not None else None
        added = (read_json(path).get(key) or {}) if path and path.is_file() else {}
        entries = added.items() if isinstance(added, dict) else ((a.get("id"), a) for a in added)
        for i, entry in entries:
            if isinstance(entry, dict) and entry.get("content") == text:
                return int(i)
    raise ConvertError(
        f"the tokenizer has no {text} token, whose embedding the projector file holds",
        "copy the model's tokenizer.json and tokenizer_config.json into the checkpoint folder",
    )


class PixtralProjector(Projector):
    projector_type = gguf.VisionProjectorType.PIXTRAL
    vision_prefixes = _VISION
    renames = tuple((f"model.{p}", p) for p in _VISION)  # transformers 5's in-memory layout

    def __init__(
        self,
        config: dict[str, Any],
        preprocessor: dict[str, Any] | None = None,
        folder: Path | None = None,
    ) -> None:
        super().__init__(config, preprocessor, folder)
        # mtmd lays the image out in rows that end in the [IMG_BREAK] token's embedding
        self.img_break = token_id(folder, "[IMG_BREAK]")

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        # transformers' Pixtral hard-codes its norms' epsilon; a config may still name one
        w.add_vision_attention_layernorm_eps(float(self.vision.get("layer_norm_eps", 1e-5)))
        act = self.vision.get("hidden_act", "gelu")
        if act == "silu":
            w.add_vision_use_silu(True)
        elif act == "gelu":
            w.add_vision_use_gelu(True)
        else:
            raise ConvertError(
                f"the Pixtral vision tower's activation {act!r} is not supported",
                "llama.cpp's pixtral projector runs silu or gelu",
            )
        if "spatial_merge_size" in self.config:  # Mistral 3's patch merger
            w.add_vision_spatial_merge_size(int(self.config["spatial_merge_size"]))

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        if name in _EMBEDDINGS:
            if len(shape) != 2 or self.img_break >= shape[0]:
                raise ConvertError(
                    f"the [IMG_BREAK] token {self.img_break} has no row in {name} {list(shape)}",
                    "the tokenizer files do not belong to this checkpoint",
                )
            row = Piece(name, self.img_break, self.img_break + 1)
            return [TensorSpec(_IMG_BREAK, name, (shape[1],), pieces=(row,))]
        out = super().specs(name, shape)
        for spec in out:
            spec.whole = spec.fn is not None  # the permutation moves rows across blocks
        return out

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        # the vision tower's rotary attention, as the text model's: Q/K rows to llama.cpp's layout
        if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            return permute_rows(int(self.vparam(*self.head_keys)))
        return None


@register("LlavaForConditionalGeneration")
class Llava(Llama):
    skip_prefixes = (*_VISION, *(f"model.{p}" for p in _VISION))
    projector = PixtralProjector
    # transformers' defaults where config.json names none
    default_tower = "clip_vision_model"
    default_feature_layer = -2
    default_strategy = "default"

    def __init__(self, config: dict[str, Any]) -> None:
        self.tower = "pixtral"
        if isinstance(config.get("vision_config"), dict):  # a GGUF base's config has none
            self.tower = config["vision_config"].get("model_type", self.default_tower)
            self.check_tower(config)
        super().__init__(config)

    def projector_class(self) -> type[Projector] | None:
        return llava_clip.ClipProjector if self.tower == "clip_vision_model" else self.projector

    def check_tower(self, config: dict[str, Any]) -> None:
        """Refuse a vision tower or feature choice that llama.cpp's projectors lack."""
        arch = (config.get("architectures") or ["LlavaForConditionalGeneration"])[0]
        if self.tower == "clip_vision_model" and arch == "LlavaForConditionalGeneration":
            llava_clip.check(config, arch)
            return
        if self.tower != "pixtral":
            supported = ", ".join(supported_vision())
            raise ConvertError(
                f"{arch} with a {self.tower!r} vision tower is not supported",
                "convert LLaVA with a CLIP tower (LLaVA 1.5) or a Pixtral one (Pixtral 12B), or "
                f"another of the vision-language architectures the converter supports: {supported}",
            )
        layer = config.get("vision_feature_layer", self.default_feature_layer)
        strategy = config.get("vision_feature_select_strategy", self.default_strategy)
        if layer != -1 or strategy != "full":
            raise ConvertError(
                f"{arch} reads the vision tower's layer {layer} ({strategy!r} patches); "
                "llama.cpp's pixtral projector reads every patch of its last layer",
                "llama.cpp cannot run this variant as it was trained",
            )

    def gguf_name(self, name: str) -> str:
        for old, new in (
            ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."),
            ("model.language_model.", "model."),  # transformers 5's in-memory layout
        ):
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        return super().gguf_name(name)


@register("Mistral3ForConditionalGeneration")
class Mistral3(Llava):
    gguf_arch = gguf.MODEL_ARCH.MISTRAL3
    default_tower = "pixtral"
    default_feature_layer = -1
    default_strategy = "full"  # Mistral 3 has no such choice: every patch goes to the merger

    def __init__(self, config: dict[str, Any]) -> None:
        self.text_type = (config.get("text_config") or {}).get("model_type", "mistral")
        if self.text_type not in ("mistral", "llama", "ministral3"):
            raise ConvertError(
                f"Mistral3ForConditionalGeneration with a {self.text_type!r} text model is not supported yet",
                "supported: Mistral Small 3.1 and 3.2 (a 'mistral' text model) and Ministral 3 ('ministral3')",
            )
        super().__init__(config)

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        if self.text_type == "ministral3":
            write_ministral3_rope(w, self.rope())


def write_ministral3_rope(w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    """Ministral 3's YaRN keys beyond the usual ones: the log multiplier of its attention scale
    (mscale_all_dim) and Llama 4's position-dependent query scaling (beta), as llama.cpp reads them."""
    if (rope.get("rope_type") or rope.get("type")) != "yarn":
        raise ConvertError("a Ministral 3 text model must use YaRN rope scaling",
                           "the checkpoint's rope_parameters are not Ministral 3's")
    for key in ("mscale_all_dim", "llama_4_scaling_beta"):
        if rope.get(key) is None:
            raise ConvertError(f"the Ministral 3 rope_parameters lack {key!r}",
                               "the checkpoint's config is incomplete")
    w.add_rope_scaling_yarn_log_mul(float(rope["mscale_all_dim"]))
    w.add_attn_temperature_scale(float(rope["llama_4_scaling_beta"]))


@register("Ministral3ForCausalLM")
class Ministral3(Llama):
    """Ministral 3's text model alone (llama.cpp's mistral3 architecture)."""

    gguf_arch = gguf.MODEL_ARCH.MISTRAL3

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        super().write_hparams(w)
        write_ministral3_rope(w, self.rope())
