"""A checkpoint to convert: config, architecture, indexed tensors and tokenizer folder."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convert.archs import Arch, arch_for
from convert.errors import ConvertError
from convert.source import SourceTensor, load_checkpoint, tensors_from_state_dict


@dataclass
class Checkpoint:
    """Everything the converter reads, indexed but not loaded."""

    name: str
    config: dict[str, Any]
    arch: Arch
    tensors: dict[str, SourceTensor]
    tokenizer_dir: Path

    @classmethod
    def open(cls, folder: str | os.PathLike[str]) -> Checkpoint:
        """Index a Hugging Face model folder."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ConvertError(
                f"{folder} is not a folder",
                "pass a Hugging Face model folder (config.json, weights, tokenizer files)",
            )
        config_path = folder / "config.json"
        if not config_path.is_file():
            raise ConvertError(f"{folder} has no config.json", "pass a Hugging Face model folder")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConvertError(f"{config_path} is not valid JSON: {e}") from e
        arch = arch_for(config)(config)  # fail on unknown architectures before reading weights
        tensors = load_checkpoint(folder)
        return cls(folder.resolve().name, config, arch, tensors, folder)

    @classmethod
    def from_state_dict(
        cls, config: dict[str, Any], state: Mapping[str, Any], tokenizer_dir: Path, name: str
    ) -> Checkpoint:
        """Wrap an in-memory model's config and state dict."""
        arch = arch_for(config)(config)
        tensors = tensors_from_state_dict(state)
        if config.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]  # the same storage as the embeddings
        return cls(name, config, arch, tensors, tokenizer_dir)

    def source_dtypes(self) -> set[str]:
        return {t.dtype for t in self.tensors.values() if len(t.shape) >= 2}

    def embedding_rows(self) -> int | None:
        for name, t in self.tensors.items():
            if name.endswith("embed_tokens.weight"):
                return t.shape[0]
        vocab = self.config.get("vocab_size")
        return int(vocab) if vocab else None
