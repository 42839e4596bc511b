"""Architecture registry: one module per family, each class registered by its HF `architectures` names.

Adding an architecture is one new module in this package that subclasses `Arch` and decorates
it with `@register("SomethingForCausalLM")`; every module here is imported on first lookup.
"""

from __future__ import annotations

import importlib
import pkgutil

from convert.archs.base import Arch, TensorSpec
from convert.errors import ConvertError

_REGISTRY: dict[str, type[Arch]] = {}
_loaded = False


def register(*hf_names: str):  # noqa: ANN201 - a class decorator
    """Register an Arch subclass under one or more Hugging Face architecture names."""

    def deco(cls: type[Arch]) -> type[Arch]:
        for name in hf_names:
            _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    _loaded = True


def supported() -> list[str]:
    """Every registered Hugging Face architecture name, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def supported_vision() -> list[str]:
    """The registered Hugging Face architecture names that come with a projector, sorted."""
    _load_all()
    return sorted(name for name, cls in _REGISTRY.items() if cls.projector is not None)


def arch_for(config: dict) -> type[Arch]:
    """The Arch class for a config.json, or a ConvertError naming the supported ones."""
    _load_all()
    # transformers 4.57 saves a Qwen2-VL's model class only in text_config
    text = config.get("text_config")
    names = (
        config.get("architectures")
        or (text.get("architectures") if isinstance(text, dict) else None)
        or []
    )
    if not names:
        raise ConvertError(
            "config.json has no 'architectures' entry",
            f"add the model class name, one of: {', '.join(supported())}",
        )
    for name in names:
        if name in _REGISTRY:
            return _REGISTRY[name]
    if isinstance(config.get("vision_config"), dict):
        raise ConvertError(
            f"vision-language architecture {names[0]!r} is not supported yet",
            f"vision-language architectures the converter supports: {', '.join(supported_vision())}",
        )
    raise ConvertError(
        f"architecture {names[0]!r} is not supported",
        f"supported architectures: {', '.join(supported())}",
    )


__all__ = ["Arch", "TensorSpec", "arch_for", "register", "supported", "supported_vision"]
