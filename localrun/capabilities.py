"""What a model can do through localrun, in the words Ollama's /api/show uses (`completion`,
`tools`, `insert`, `embedding`, `thinking`, `vision`).

Each capability is one rule over the model's info and the abilities of the engine that runs it,
listed in RULES; a new one (thinking formats, images) is one more rule there, and every front end
that shows capabilities gets it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from localrun.backends.base import Abilities
    from localrun.store import ModelInfo

# Encoder architectures: they embed and never generate.
EMBEDDING_ARCHS = ("bert", "nomic-bert", "jina-bert-v2", "jina-bert-v3", "t5encoder", "modern-bert", "neo-bert")


def embeds_only(model: ModelInfo) -> bool:
    """An embedding model: an encoder architecture, or a GGUF that declares a pooling type."""
    arch = model.architecture or ""
    meta = model.details.get("metadata") or {}
    return arch in EMBEDDING_ARCHS or meta.get(f"{arch}.pooling_type") not in (None, 0)


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
    return embeds_only(model) or bool(abilities and abilities.embeddings)


def _thinking(model: ModelInfo, abilities: Abilities | None) -> bool:
    # A reasoning format found in the model's chat template (localrun.reasoning); never from its name.
    from localrun.api import chat_template
    from localrun.reasoning import can_think

    return not embeds_only(model) and can_think(chat_template(model))


RULES: tuple[tuple[str, Callable[[ModelInfo, Abilities | None], bool]], ...] = (
    ("completion", _completion),
    ("tools", _tools),
    ("insert", _insert),
    ("embedding", _embedding),
    ("thinking", _thinking),
)


def capabilities(model: ModelInfo, abilities: Abilities | None) -> tuple[str, ...]:
    """The capabilities of a model run by an engine with these abilities (None: no engine here)."""
    return tuple(name for name, rule in RULES if rule(model, abilities))
