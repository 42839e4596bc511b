"""What every architecture shares: config keys to GGUF keys, tensor renames via gguf-py's map."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import gguf
import numpy as np

from convert.errors import ConvertError

# Tensors that hold no weights llama.cpp uses.
SKIP_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclass
class TensorSpec:
    """How one GGUF tensor is made from one source tensor."""

    name: str  # GGUF name
    source: str  # source (Hugging Face) tensor name; "" for a generated tensor
    shape: tuple[int, ...]  # numpy order (rows first)
    # Row-wise function on float32 rows; applied block by block unless `whole` is set.
    fn: Callable[[np.ndarray], np.ndarray] | None = None
    whole: bool = False  # fn needs the whole tensor at once (e.g. a row permutation)
    data: np.ndarray | None = None  # a generated tensor's values (float32)


def permute_rows(n_head: int) -> Callable[[np.ndarray], np.ndarray]:
    """HF rotary layout (halves) to llama.cpp's interleaved (pairs) layout for Q/K rows."""

    def fn(w: np.ndarray) -> np.ndarray:
        rows = w.shape[0]
        return (
            w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        )

    return fn


def add_one(w: np.ndarray) -> np.ndarray:
    """Gemma RMSNorm multiplies by (1 + weight); llama.cpp multiplies by the stored weight."""
    return w + np.float32(1.0)


class Arch:
    """One architecture family. Subclasses say only what differs."""

    gguf_arch: ClassVar[gguf.MODEL_ARCH]
    # Extra Hugging Face tensor names (prefix match) that llama.cpp does not use.
    skip_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: dict[str, Any]) -> None:
        if isinstance(config.get("text_config"), dict):
            config = {**config, **config["text_config"]}
        self.config = config
        self.n_layers = int(self.need("num_hidden_layers"))
        self.tensor_map = gguf.get_tensor_name_map(self.gguf_arch, self.n_layers)

    @property
    def name(self) -> str:
        return gguf.MODEL_ARCH_NAMES[self.gguf_arch]

    def need(self, *keys: str) -> Any:
        """The first of keys present in config.json, or a ConvertError."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.config[key]
        raise ConvertError(
            f"config.json lacks {keys[0]!r}", "the checkpoint's config is incomplete"
        )

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    # --- rope -------------------------------------------------------------------------------
    def rope(self, kind: str = "full_attention") -> dict[str, Any]:
        """Rope parameters (transformers 5 `rope_parameters` or the older flat keys)."""
        params = self.config.get("rope_parameters") or self.config.get("rope_scaling") or {}
        params = dict(params)
        if kind in params and isinstance(params[kind], dict):
            params = dict(params[kind])
        elif "full_attention" in params and isinstance(params["full_attention"], dict):
            params = dict(params["full_attention"])
        if "rope_theta" not in params and self.config.get("rope_theta") is not None:
            params["rope_theta"] = self.config["rope_theta"]
        if "rope_type" not in params and params.get("type") is not None:
            params["rope_type"] = params["type"]
        return params

    def head_dim(self) -> int:
        hd = self.config.get("head_dim")
        if hd:
            return int(hd)
        return int(self.need("hidden_size")) // int(self.need("num_attention_heads"))

    # --- metadata ---------------------------------------------------------------------------
    def write_hparams(self, w: gguf.GGUFWriter) -> None:
        """Hyper-parameters common to llama.cpp's decoder-only models."""
        w.add_block_count(self.n_layers)
        if (n_ctx := self.get("max_position_embeddings")) is not None:
            w.add_context_length(int(n_ctx))
        w.add_embedding_length(int(self.need("hidden_size")))
        w.add_feed_forward_length(int(self.need("intermediate_size")))
        n_head = int(self.need("num_attention_heads"))
        w.add_head_count(n_head)
        w.add_head_count_kv(int(self.get("num_key_value_heads", n_head)))
        rope = self.rope()
        if (theta := rope.get("rope_theta")) is not None:
            w.add_rope_freq_base(float(theta))
        self.write_rope_scaling(w, rope)
        w.add_layer_norm_rms_eps(float(self.get("rms_norm_eps", 1e-6)))
        if self.config.get("head_dim") is not None:
            w.add_key_length(int(self.config["head_dim"]))
            w.add_value_length(int(self.config["head_dim"]))

    def write_rope_scaling(self, w: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
        rope_type = (rope.get("rope_type") or "default").lower()
        factor = rope.get("factor")
        if rope_type == "linear" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(float(factor))
        elif rope_type == "yarn" and factor is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(factor))
            w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        elif rope_type not in ("default", "llama3", "longrope", "su"):
            raise ConvertError(
                f"rope type {rope_type!r} is not supported for {self.name}",
                "supported: default, linear, yarn, llama3, longrope",
            )

    # --- tensors ----------------------------------------------------------------------------
    def skip(self, name: str) -> bool:
        return name.endswith(SKIP_SUFFIXES) or name.startswith(self.skip_prefixes)

    def gguf_name(self, name: str) -> str:
        new = self.tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ConvertError(
                f"tensor {name!r} has no llama.cpp equivalent for {self.name}",
                "the checkpoint may be a variant this converter does not know",
            )
        return new

    def specs(self, name: str, shape: tuple[int, ...]) -> list[TensorSpec]:
        """The GGUF tensor(s) made from one source tensor (none to drop it)."""
        if self.skip(name):
            return []
        return [TensorSpec(self.gguf_name(name), name, shape, fn=self.transform(name))]

    def transform(self, name: str) -> Callable[[np.ndarray], np.ndarray] | None:
        return None

    def extra_tensors(self) -> list[TensorSpec]:
        """Tensors computed from the config (rope factors)."""
        return []

    def tensor_name(self, key: gguf.MODEL_TENSOR, bid: int | None = None) -> str:
        name = gguf.TENSOR_NAMES[key]
        return (name.format(bid=bid) if bid is not None else name) + ".weight"

    # --- vocabulary -------------------------------------------------------------------------
    def add_space_prefix(self) -> bool | None:
        """Override of the SentencePiece space prefix (None: from the tokenizer)."""
        return None


def llama3_rope_factors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per-frequency factors of Llama 3.1's rope scaling (llama.cpp's rope_freqs tensor)."""
    base = float(rope.get("rope_theta", 10000.0))
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = float(rope.get("factor", 8.0))
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)
