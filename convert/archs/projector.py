"""What every vision projector shares: llama.cpp's `clip` file (mmproj) of a vision-language
checkpoint, written beside its text model from the same weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import gguf

from convert.archs.base import Arch
from convert.errors import ConvertError


class Projector(Arch):
    """The vision tower and the projector into the text model's embeddings, as one clip file.

    Subclasses name the projector type, the prefixes of the vision tensors, and what differs in
    the tensors (fused or 3-D weights llama.cpp splits) and in the config's key names."""

    gguf_arch = gguf.MODEL_ARCH.MMPROJ
    has_vocab = False
    projector_type: ClassVar[str]  # clip.projector_type, as llama.cpp's multimodal library reads it
    # Source prefixes of the vision tower and the projector; every other tensor is the text model's.
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    # Source prefixes renamed before the tensor map lookup (layouts that nest the same modules).
    renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # config.json's vision_config keys, the first one present wins (as llama.cpp's converter reads).
    block_keys: ClassVar[tuple[str, ...]] = ("num_hidden_layers", "depth", "num_layers", "layers")
    width_keys: ClassVar[tuple[str, ...]] = ("hidden_size", "width")
    ff_keys: ClassVar[tuple[str, ...]] = ("intermediate_size",)
    head_keys: ClassVar[tuple[str, ...]] = ("num_attention_heads", "num_heads", "heads")
    # llama.cpp's converter keeps a SigLIP tower's patch and position embeddings in F32 whatever
    # the type (other towers: patch embeddings F16 in an F16 file, else F32)
    f32_embeddings: ClassVar[bool] = False
    # The tower's config values transformers assumes where config.json's vision_config names none.
    vision_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        config: dict[str, Any],
        preprocessor: dict[str, Any] | None = None,
        folder: Path | None = None,
    ) -> None:
        """folder: the checkpoint's tokenizer files (for token embeddings the projector holds)."""
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise ConvertError(
                "config.json has no vision_config", "the checkpoint's config is incomplete"
            )
        self.config = config
        self.vision = {**self.vision_defaults, **{k: v for k, v in vision.items() if v is not None}}
        self.text = {**config, **(config.get("text_config") or {})}
        self.preprocessor = preprocessor or {}
        for key in ("image_mean", "image_std"):
            if not isinstance(self.preprocessor.get(key), list):
                raise ConvertError(
                    f"the image processor's {key} is missing",
                    "copy the model's preprocessor_config.json into the checkpoint folder",
                )
        self.n_layers = int(self.vparam(*self.block_keys))
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layers)

    def vparam(self, *keys: str) -> Any:
        """The first of keys present in vision_config, or a ConvertError."""
        for key in keys:
            if self.vision.get(key) is not None:
                return self.vision[key]
        raise ConvertError(
            f"config.json's vision_config lacks {keys[0]!r}",
            "the checkpoint's config is incomplete",
        )

    def image_size(self) -> int:
        return int(self.vparam("image_size"))

    def embedding_length(self) -> int:
        return int(self.vparam(*self.width_keys))

    def feed_forward_length(self) -> int:
        return int(self.vparam(*self.ff_keys))

    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        """The vision encoder's hyper-parameters, the image statistics and the projector type."""
        w.add_clip_has_vision_encoder(True)
        w.add_vision_projection_dim(int(self.text.get("hidden_size") or self.text["n_embd"]))
        w.add_vision_image_size(self.image_size())
        w.add_vision_patch_size(int(self.vparam("patch_size")))
        w.add_vision_embedding_length(self.embedding_length())
        w.add_vision_feed_forward_length(self.feed_forward_length())
        w.add_vision_block_count(self.n_layers)
        w.add_vision_head_count(int(self.vparam(*self.head_keys)))
        w.add_vision_image_mean([float(x) for x in self.preprocessor["image_mean"]])
        w.add_vision_image_std([float(x) for x in self.preprocessor["image_std"]])
        w.add_clip_projector_type(self.projector_type)

    def source_name(self, name: str) -> str:
        for old, new in self.renames:
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def skip(self, name: str) -> bool:
        return not self.source_name(name).startswith(self.vision_prefixes) or super().skip(name)

    def gguf_name(self, name: str) -> str:
        return super().gguf_name(self.source_name(name))

    def tensor_type(
        self, name: str, shape: tuple[int, ...], outtype: gguf.GGMLQuantizationType
    ) -> gguf.GGMLQuantizationType:
        # as llama.cpp's converter: position embeddings in F32, patch embeddings (each piece of a
        # split one too) and a patch merger in F16 for an F16 file and in F32 for every other type
        F16, F32 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32
        if name.startswith("v.position_embd.") or (
            self.f32_embeddings and name.startswith("v.patch_embd.")
        ):
            return F32
        if name.startswith(("v.patch_embd.weight", "mm.patch_merger.weight")):
            return F16 if outtype == F16 else F32
        return super().tensor_type(name, shape, outtype)
