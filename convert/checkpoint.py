"""A checkpoint to convert (config, architecture, indexed tensors, tokenizer folder), LoRA adapters
merged into it, and the base model an adapter is checked against."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from convert.archs import Arch, arch_for, supported
from convert.errors import ConvertError
from convert.lora import Adapter, LoraWeight, check_against
from convert.outtypes import to_f32
from convert.source import (
    SourceTensor,
    check_native_layout,
    load_checkpoint,
    read_json,
    tensors_from_state_dict,
)


@dataclass
class Checkpoint:
    """Everything the converter reads, indexed but not loaded."""

    name: str
    config: dict[str, Any]
    arch: Arch
    tensors: dict[str, SourceTensor]
    tokenizer_dir: Path
    # The dtypes before adapters were merged in (merged tensors are read as F32): --outtype auto
    # picks the same type with or without a merge.
    dtypes: frozenset[str] | None = None

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> Checkpoint:
        """Index a Hugging Face model folder."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConvertError(
                f"{folder} is not a folder",
                "pass a Hugging Face model folder (config.json, weights, tokenizer files)",
            )
        check_native_layout(folder)  # a publisher's own layout: name the Hugging Face one to use
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConvertError(f"{folder} has no config.json", "pass a Hugging Face model folder")
        config = read_json(config_path)
        arch = arch_for(config)(config)  # fail on unknown architectures before reading weights
        arch.read_folder(folder)
        tensors = load_checkpoint(folder)
        return cls(folder.resolve().name, config, arch, tensors, folder)

    @classmethod
    def from_state_dict(
        cls, config: dict[str, Any], state: Mapping[str, Any], tokenizer_dir: Path, name: str
    ) -> Checkpoint:
        """Wrap an in-memory model's config and state dict."""
        arch = arch_for(config)(config)
        arch.read_folder(tokenizer_dir)
        tensors = tensors_from_state_dict(state)
        if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]  # the same storage as the embeddings
        return cls(name, config, arch, tensors, tokenizer_dir)

    def source_dtypes(self) -> set[str]:
        if self.dtypes is not None:
            return set(self.dtypes)
        return {t.dtype for t in self.tensors.values() if len(t.shape) >= 2}

    def merge(self, adapters: Sequence[tuple[Adapter, float]]) -> Checkpoint:
        """This checkpoint with LoRA adapters (and scales) merged into its weights, read lazily."""
        tensors = merge_tensors(self.tensors, self.arch, self.name, adapters)
        return dataclasses.replace(self, tensors=tensors, dtypes=frozenset(self.source_dtypes()))

    def projector(self) -> Checkpoint | None:
        """The same weights as the vision projector's checkpoint (a vision-language family), else None."""
        cls = self.arch.projector_class()
        if cls is None:
            return None
        arch = cls(self.config, processor_config(self.tokenizer_dir), self.tokenizer_dir)
        return dataclasses.replace(self, arch=arch)

    def embedding_rows(self) -> int | None:
        for name, t in self.tensors.items():
            if name.endswith("embed_tokens.weight"):
                return t.shape[0]
        vocab = self.config.get("vocab_size")
        return int(vocab) if vocab else None


def processor_config(folder: Path) -> dict[str, Any]:
    """The image processor's settings (mean, std, sizes) of a checkpoint folder: preprocessor_config.json
    with processor_config.json's image_processor over it, as llama.cpp's converter merges them."""
    out: dict[str, Any] = {}
    for file, nested in (
        ("preprocessor_config.json", "media_proc_cfg"),
        ("processor_config.json", "image_processor"),
    ):
        path = folder / file
        if path.is_file():
            cfg = read_json(path)
            if isinstance(cfg.get(nested), dict):
                cfg = {**cfg, **cfg[nested]}
            out.update(cfg)
    return out


# --- merging into the weights ---------------------------------------------------------------------


class _MergedRows:
    """Rows of W (or its replacement) plus each adapter's scale * scaling * B @ A, in float32."""

    def __init__(self, base: SourceTensor, updates: list[tuple[LoraWeight, float]]):
        self.base, self.updates = base, updates
        self._lock = threading.Lock()
        self._embedding_a: dict[int, np.ndarray] = {}

    def _a(self, i: int, w: LoraWeight) -> np.ndarray:
        if not w.embedding:
            return to_f32(w.a.read(), w.a.dtype)
        with self._lock:  # embedding A is (r, rows): read once, not once per block
            if i not in self._embedding_a:
                self._embedding_a[i] = to_f32(w.a.read(), w.a.dtype)
            return self._embedding_a[i]

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        rows = to_f32(self.base.read(start, stop), self.base.dtype)
        for i, (w, scale) in enumerate(self.updates):
            a = self._a(i, w)
            factor = np.float32(scale * w.scaling)
            if w.embedding:
                delta = (to_f32(w.b.read(), w.b.dtype) @ a[:, start:stop]).T
            else:
                delta = to_f32(w.b.read(start, stop), w.b.dtype) @ a
            rows = rows + factor * delta  # never in place: rows may be the model's own memory
        return rows


def merge_tensors(
    tensors: dict[str, SourceTensor],
    arch: Arch,
    label: str,
    adapters: Sequence[tuple[Adapter, float]],
) -> dict[str, SourceTensor]:
    """The checkpoint's tensors with the adapters merged; every shape is checked first."""
    shapes = {name: t.shape for name, t in tensors.items()}
    tied = _tied(shapes, arch)
    replaced: dict[str, tuple[SourceTensor, str]] = {}
    updates: dict[str, list[tuple[LoraWeight, float]]] = {}
    for adapter, scale in adapters:
        if adapter.invocation_tokens:
            raise ConvertError(
                f"adapter '{adapter.name}' is an activated LoRA (aLoRA): it applies only after its "
                "invocation tokens, so it cannot be merged",
                "convert it as an adapter and load it at run time",
            )
        check_against(adapter, shapes.get, label, tied)
        for name, t in adapter.full.items():
            if name not in tensors:
                raise ConvertError(
                    f"adapter '{adapter.name}' replaces {name}, which the base '{label}' does not "
                    "have",
                    "pass the base the adapter was trained on",
                )
            if name in replaced:
                raise ConvertError(
                    f"adapters '{replaced[name][1]}' and '{adapter.name}' both replace {name}",
                    "merge one of them at a time",
                )
            replaced[name] = (t, adapter.name)
        for target, w in adapter.weights.items():
            updates.setdefault(target, []).append((w, float(scale)))
    out = dict(tensors)
    for name, (t, _) in replaced.items():
        out[name] = SourceTensor(name, t.dtype, t.shape, t.reader)
    for target, ups in updates.items():
        src = out[target]
        out[target] = SourceTensor(target, "F32", src.shape, _MergedRows(src, ups))
    return out


# --- the base model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BaseModel:
    """What an adapter is checked against: the architecture and every weight's shape."""

    label: str
    arch: Arch
    shapes: dict[str, tuple[int, ...]]  # HF names (a folder) or GGUF names (a GGUF file)
    gguf_names: bool
    tied: bool  # no separate output weight: llama.cpp reuses the token embeddings

    def shape(self, hf_name: str) -> tuple[int, ...] | None:
        """The numpy-order shape of the base weight with this Hugging Face name, if there is one."""
        if not self.gguf_names:
            return self.shapes.get(hf_name)
        try:
            specs = self.arch.specs(hf_name, ())
        except ConvertError:
            return None
        return self.shapes.get(specs[0].name) if len(specs) == 1 else None


def _tied(tensors: dict[str, tuple[int, ...]], arch: Arch) -> bool:
    shape = tensors.get("lm_head.weight")
    return shape is None or not arch.specs("lm_head.weight", shape)


def open_base(path: str | os.PathLike[str], hint: str | None = None) -> BaseModel:
    """A Hugging Face model folder (config.json and weights) or a base GGUF model file."""
    path = Path(path)
    if not path.exists():
        raise ConvertError(
            f"base model {path} does not exist",
            hint or "pass the base model's Hugging Face folder or GGUF file with --base",
        )
    if path.is_dir():
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConvertError(
                f"base {path} has no config.json",
                "pass a Hugging Face model folder or a GGUF model file as the base",
            )
        config = read_json(config_path)
        arch = arch_for(config)(config)
        shapes = {name: t.shape for name, t in load_checkpoint(path).items()}
        return BaseModel(path.resolve().name, arch, shapes, False, _tied(shapes, arch))
    return _open_gguf_base(path)


def _open_gguf_base(path: Path) -> BaseModel:
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ConvertError(
            f"base {path} is not a GGUF file ({e})",
            "pass a Hugging Face model folder or a GGUF model file as the base",
        ) from e

    def value(key: str) -> Any:
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    if value("general.type") == "adapter":
        raise ConvertError(
            f"base {path.name} is itself an adapter", "pass the base model it was trained for"
        )
    gguf_arch = value("general.architecture")
    # The first registered Hugging Face name whose Arch writes this GGUF architecture.
    by_gguf: dict[str, str] = {}
    classes = {name: arch_for({"architectures": [name]}) for name in supported()}
    # text families first: a vision-language family may write the same text architecture (llama)
    for hf_name in sorted(classes, key=lambda name: classes[name].projector is not None):
        by_gguf.setdefault(gguf.MODEL_ARCH_NAMES[classes[hf_name].gguf_arch], hf_name)
    hf = by_gguf.get(str(gguf_arch))
    if hf is None:
        raise ConvertError(
            f"base {path.name} has architecture {gguf_arch!r}, which the converter does not know",
            f"supported architectures: {', '.join(supported())}",
        )
    keys = {
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv",
        "hidden_size": "embedding_length",
        "intermediate_size": "feed_forward_length",
        "vocab_size": "vocab_size",
        "head_dim": "attention.key_length",
    }
    config: dict[str, Any] = {"architectures": [hf]}
    for hf_key, gguf_key in keys.items():
        v = value(f"{gguf_arch}.{gguf_key}")
        if isinstance(v, list):  # per-layer values: the Arch's transforms need one number
            if len(set(v)) != 1:
                raise ConvertError(f"base {path.name} has per-layer {gguf_key}, not supported")
            v = v[0]
        if v is not None:
            config[hf_key] = v
    arch = arch_for(config)(config)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}
    return BaseModel(path.name, arch, shapes, True, "output.weight" not in shapes)
