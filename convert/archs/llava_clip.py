"""Classic LLaVA (LLaVA 1.5 as llava-hf publishes it, BakLLaVA): a CLIP vision tower whose patches,
read at one of its layers without the [CLS] token, a two-layer GELU projection (mm.0, mm.2) maps
into the text embeddings. The projector file is the one llama.cpp's own LLaVA scripts write
(tools/mtmd/legacy-models: llava_surgery_v2.py, then convert_image_encoder_to_gguf.py on the CLIP
model with the checkpoint's vision_feature_layer), projector type mlp.

Two choices differ from those scripts: the MLP's fc1 and fc2 are named ffn_up and ffn_down, as
every other projector names them (the scripts swap the two names and llama.cpp swaps them back when
it loads the file, with a warning); and an F32 file keeps its patch embeddings and projection
matrices in F32 (the scripts write them as F16 whatever the type).

llama.cpp's runtime (this version) runs such a tower with its [CLS] token after the patches
instead of before them (llama.cpp issue 25814): each patch gets its neighbour's position, and the
image's tokens leave out the first patch and take the [CLS] token's output instead. Every CLIP
LLaVA GGUF runs so there; the converted files are right for a runtime with that fixed."""

from __future__ import annotations

import functools
import re
from typing import Any

import gguf

from convert import outtypes
from convert.archs.base import TensorSpec
from convert.archs.projector import Projector
from convert.errors import ConvertError

# transformers' CLIPVisionConfig defaults, for keys a LLaVA config leaves out
CLIP_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "projection_dim": 512, "num_hidden_layers": 12,
    "num_attention_heads": 12, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5,
}
NOTICE = (
    "llama.cpp's runtime puts a CLIP tower's [CLS] token after the patches (its issue 25814): until "
    "that is fixed, llama.cpp and localrun read images otherwise than the model was trained"
)
# the tower's and projector's source names (llava-hf's, transformers 5's saved and in-memory layouts)
_SOURCE = re.compile(r"^(?:model\.)?(?:vision_tower\.(?:vision_model\.)?|(multi_modal_projector)\.)(.*)$")
_NAMES = {
    "embeddings.class_embedding": "v.class_embd",
    "embeddings.patch_embedding.weight": "v.patch_embd.weight",
    "embeddings.position_embedding.weight": "v.position_embd.weight",
    "pre_layrnorm": "v.pre_ln",
}
# a block's modules, in the order llama.cpp's scripts write them (the CLIP layer's own order)
_BLOCK = {
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.q_proj": "attn_q",
    "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
    "layer_norm2": "ln2",
}
_ORDER = {name: i for i, name in enumerate(_BLOCK.values())}
_HEAD = ("v.class_embd", "v.patch_embd.weight", "v.position_embd.weight", "v.pre_ln.weight", "v.pre_ln.bias")


def feature_block(config: dict[str, Any], n_layers: int) -> int:
    """How many of the tower's blocks the image goes through: vision_feature_layer as a count of
    blocks (transformers' hidden_states index; -2, LLaVA 1.5's, is all but the last)."""
    layer = config.get("vision_feature_layer", -2)
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ConvertError(
            f"LLaVA with a CLIP tower reading several layers ({layer!r}) is not supported",
            "llama.cpp's mlp projector reads one layer of the tower",
        )
    blocks = layer if layer >= 0 else n_layers + layer + 1
    if not 1 <= blocks <= n_layers:
        raise ConvertError(
            f"vision_feature_layer {layer} is outside the tower's {n_layers} layers",
            "the checkpoint's config is inconsistent",
        )
    return blocks


class ClipProjector(Projector):
    projector_type = "mlp"
    vision_prefixes = ("vision_tower.", "multi_modal_projector.")
    notice = NOTICE

    vision_defaults = CLIP_DEFAULTS

    @functools.cached_property
    def blocks(self) -> int:
        """The tower's blocks the image goes through (its feature layer)."""
        return feature_block(self.config, self.n_layers)

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        """The keys llama.cpp's convert_image_encoder_to_gguf.py writes for a LLaVA projector."""
        w.add_bool("clip.has_text_encoder", False)
        w.add_clip_has_vision_encoder(True)
        w.add_bool(gguf.Keys.Clip.HAS_LLAVA_PROJECTOR, True)
        w.add_description("image encoder for LLaVA")
        w.add_clip_projector_type(self.projector_type)
        w.add_vision_image_size(self.image_size())
        w.add_vision_patch_size(int(self.vparam("patch_size")))
        w.add_vision_embedding_length(self.embedding_length())
        w.add_vision_feed_forward_length(self.feed_forward_length())
        w.add_vision_projection_dim(int(self.vparam("projection_dim")))
        w.add_vision_head_count(int(self.vparam(*self.head_keys)))
        w.add_vision_attention_layernorm_eps(float(self.vparam("layer_norm_eps")))
        w.add_vision_block_count(self.blocks)
        w.add_array("clip.vision.feature_layer", [self.blocks])
        w.add_vision_image_mean([float(x) for x in self.preprocessor["image_mean"]])
        w.add_vision_image_std([float(x) for x in self.preprocessor["image_std"]])
        w.add_bool(gguf.Keys.ClipVision.USE_GELU, self.vparam("hidden_act") == "gelu")

    def _name(self, name: str) -> str | None:
        """The GGUF name of a tower or projector tensor; None for one llama.cpp does not read (the
        post-layernorm, blocks past the feature layer, position ids)."""
        m = _SOURCE.match(name)
        if m is None:
            return None
        rest = m.group(2)
        if m.group(1):  # the projector: linear_1 and linear_2 are mm.0 and mm.2
            p = re.fullmatch(r"linear_([12])\.(weight|bias)", rest)
            return f"mm.{2 * int(p.group(1)) - 2}.{p.group(2)}" if p else None
        if rest in _NAMES:
            return _NAMES[rest]
        if rest.startswith("pre_layrnorm."):
            return f"{_NAMES['pre_layrnorm']}.{rest.rsplit('.', 1)[1]}"
        b = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", rest)
        if b is None or int(b.group(1)) >= self.blocks or b.group(2) not in _BLOCK:
            return None
        return f"v.blk.{b.group(1)}.{_BLOCK[b.group(2)]}.{b.group(3)}"

    def skip(self, name: str) -> bool:
        return self._name(name) is None

    def gguf_name(self, name: str) -> str:
        new = self._name(name)
        if new is None:
            raise ConvertError(f"tensor {name!r} has no llama.cpp equivalent in a LLaVA projector")
        return new

    def ordered(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The projector first, then the tower in its modules' order, as llama.cpp's scripts write."""

        def key(spec: TensorSpec) -> tuple:
            name = spec.name
            if name.startswith("mm."):
                return (0, name)
            if name in _HEAD:
                return (1, _HEAD.index(name))
            _, _, block, module, kind = name.split(".")
            return (2, int(block), _ORDER[module], kind != "weight")

        return sorted(specs, key=key)

    def tensor_type(
        self, name: str, shape: tuple[int, ...], outtype: gguf.GGMLQuantizationType
    ) -> gguf.GGMLQuantizationType:
        if name.startswith("v.position_embd."):  # as the scripts write it: a matrix like the others
            return outtypes.tensor_type(name, shape, outtype)
        return super().tensor_type(name, shape, outtype)


def check(config: dict[str, Any], arch: str) -> None:
    """Refuse a CLIP LLaVA variant llama.cpp's mlp projector would run otherwise than trained."""
    strategy = config.get("vision_feature_select_strategy", "default")
    act = config.get("projector_hidden_act", "gelu")
    if strategy != "default":
        raise ConvertError(
            f"{arch} with a CLIP tower reads its patches with strategy {strategy!r}; llama.cpp's mlp "
            "projector leaves out the [CLS] token ('default')",
            "llama.cpp cannot run this variant as it was trained",
        )
    if act != "gelu" or config.get("multimodal_projector_bias", True) is False:
        raise ConvertError(
            f"{arch}'s projection ({act}, bias {config.get('multimodal_projector_bias', True)}) is "
            "not llama.cpp's mlp projector (GELU between two linear layers with biases)",
            "llama.cpp cannot run this variant as it was trained",
        )
    vision = config["vision_config"]
    if vision.get("image_grid_pinpoints") or config.get("image_grid_pinpoints"):
        raise ConvertError(f"{arch} with image grid pinpoints (LLaVA-NeXT) is not supported")
    feature_block(config, int(vision.get("num_hidden_layers", CLIP_DEFAULTS["num_hidden_layers"])))

