"""What a model can do through localrun, in the words Ollama's /api/show uses (`completion`,
`tools`, `insert`, `embedding`, `thinking`, `vision`), and `rerank` for a reranker.

Each capability is one rule over the model's info and the abilities of the engine that runs it,
listed in RULES; a new one (thinking formats, images) is one more rule there, and every front end
that shows capabilities gets it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from localrun.backends.base import EMBEDDING_ARCHS

if TYPE_CHECKING:
    from localrun.backends.base import Abilities
    from localrun.reasoning import ReasoningFormat
    from localrun.store import ModelInfo

RANK_POOLING = 4  # llama.cpp's LLAMA_POOLING_TYPE_RANK


def embeds_only(model: ModelInfo) -> bool:
    """An embedding model: an encoder architecture, or a GGUF that declares a pooling type."""
    arch = model.architecture or ""
    meta = model.details.get("metadata") or {}
    return arch in EMBEDDING_ARCHS or meta.get(f"{arch}.pooling_type") not in (None, 0)


def reranks(model: ModelInfo) -> bool:
    """A reranker: a GGUF whose pooling is rank (4), or an encoder with a classification head
    whose file declares no pooling (llama.cpp's converter leaves rank to llama-server's --rerank)."""
    arch = model.architecture or ""
    meta = model.details.get("metadata") or {}
    pooling = meta.get(f"{arch}.pooling_type")
    if pooling is None:
        return arch in EMBEDDING_ARCHS and f"{arch}.classifier.output_labels" in meta
    try:
        return int(pooling) == RANK_POOLING
    except (TypeError, ValueError):
        return False


def _completion(model: ModelInfo, abilities: Abilities | None) -> bool:
    return not embeds_only(model)


def _tools(model: ModelInfo, abilities: Abilities | None) -> bool:
    # Every model that generates takes tools: a template without a tool syntax of its own gets
    # localrun's generic JSON format (tools.detect_format), held to the call grammar.
    return not embeds_only(model)


def _insert(model: ModelInfo, abilities: Abilities | None) -> bool:
    return False  # suffix (fill-in-the-middle) is refused by both APIs until it is served


def _embedding(model: ModelInfo, abilities: Abilities | None) -> bool:
    # An engine with embeddings pools any model it runs (a generative one by the mean of its tokens).
    return not reranks(model) and (embeds_only(model) or bool(abilities and abilities.embeddings))


def _rerank(model: ModelInfo, abilities: Abilities | None) -> bool:
    return reranks(model) and (abilities is None or abilities.embeddings)


def reasoning_format(model: ModelInfo) -> ReasoningFormat | None:
    """The model's reasoning format, read from its chat template and vocabulary as the engines read
    them at load (a marker the template names only in part may be one token of the vocabulary)."""
    from localrun.api import chat_template
    from localrun.reasoning import detect

    path = Path(model.path)
    try:
        stamp = os.stat(path / "tokenizer.json" if model.format != "gguf" else path).st_mtime_ns
    except OSError:
        stamp = 0
    added = _added_tokens(str(path), model.format == "gguf", stamp)
    return detect(chat_template(model), added.__contains__)


@lru_cache(maxsize=64)
def _added_tokens(path: str, gguf: bool, stamp: int) -> frozenset[str]:
    """The control and user-defined tokens of a GGUF's vocabulary, or a tokenizer.json's added
    tokens (what the engines' special_id finds), read once per file version."""
    if gguf:
        from localrun.errors import LocalrunError
        from localrun.gguf_header import read_gguf

        try:
            meta = read_gguf(path).metadata
        except LocalrunError:  # a file gone or damaged: the template alone decides
            return frozenset()
        types = meta.get("tokenizer.ggml.token_type") or ()
        return frozenset(t for t, kind in zip(meta.get("tokenizer.ggml.tokens") or (), types, strict=False)
                         if kind in (3, 4))  # CONTROL, USER_DEFINED
    try:
        data = json.loads((Path(path) / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return frozenset()
    return frozenset(str(t["content"]) for t in data.get("added_tokens") or ()
                     if isinstance(t, dict) and "content" in t)


def _thinking(model: ModelInfo, abilities: Abilities | None) -> bool:
    # A reasoning format found in the model's chat template and vocabulary; never from its name.
    return not embeds_only(model) and reasoning_format(model) is not None


def _vision(model: ModelInfo, abilities: Abilities | None) -> bool:
    # On an engine that reads images: a GGUF with its projector recorded (and there), or a
    # vision-language folder (a vision_config) where mlx-vlm is installed.
    if not (abilities and abilities.images):
        return False
    mmproj = model.details.get("mmproj")
    if mmproj:
        return os.path.isfile(mmproj)
    if model.format in ("mlx", "safetensors"):
        from localrun.backends.mlx_vision import read_config, vlm_installed

        return "vision_config" in read_config(Path(model.path)) and vlm_installed()
    return False


RULES: tuple[tuple[str, Callable[[ModelInfo, Abilities | None], bool]], ...] = (
    ("completion", _completion),
    ("tools", _tools),
    ("insert", _insert),
    ("embedding", _embedding),
    ("thinking", _thinking),
    ("vision", _vision),
    ("rerank", _rerank),
)


def capabilities(model: ModelInfo, abilities: Abilities | None) -> tuple[str, ...]:
    """The capabilities of a model run by an engine with these abilities (None: no engine here)."""
    return tuple(name for name, rule in RULES if rule(model, abilities))
