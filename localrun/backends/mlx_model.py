"""What the MLX engine reads from a model beside mlx-lm's loader: the rope keys transformers 5 nests
in config.json, and where a loaded model keeps its decoder layers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def layers_prefix(model: Any) -> str:
    """Where mlx-lm's model keeps its decoder layers, as a parameter path: 'model.layers.'."""
    layers = getattr(model, "layers", None)
    if layers:
        for name, module in model.named_modules():
            if module is layers[0] and "." in name:
                return name.rsplit(".", 1)[0] + "."
    return "model.layers."


def flat_rope(folder: Path) -> dict[str, Any]:
    """mlx_rope_keys of a folder's config.json ({} when it cannot be read)."""
    import json

    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return mlx_rope_keys(cfg) if isinstance(cfg, dict) else {}


def mlx_rope_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 saves rope_theta and the scaling (yarn, llama3, linear...) inside
    rope_parameters, where mlx-lm's models do not look: they would run with their default base
    and no scaling. The top-level keys mlx-lm reads, for a config that lacks them."""
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    out: dict[str, Any] = {}
    if cfg.get("rope_theta") is None and isinstance(rope.get("rope_theta"), int | float):
        out["rope_theta"] = float(rope["rope_theta"])
    kind = rope.get("rope_type") or rope.get("type")
    if cfg.get("rope_scaling") is None and kind not in (None, "default"):
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        out["rope_scaling"] = {**scaling, "rope_type": kind, "type": kind}
    return out
