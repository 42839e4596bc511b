"""Which engine runs a model, and what to say when none can: read from the registry's declarations
(formats, install hints, the formats each engine makes its own copy of), never from engine names."""

from __future__ import annotations

from localrun.backends.base import backend_class, backend_classes, backends_for, get_backend
from localrun.errors import BackendUnavailableError
from localrun.store import ModelInfo

FORMAT_NAMES = {"gguf": "a GGUF file", "mlx": "an MLX model folder", "safetensors": "a Hugging Face safetensors folder"}


def describe_format(fmt: str) -> str:
    """A model format in words ("a GGUF file")."""
    return FORMAT_NAMES.get(fmt, f"a model in {fmt} format")


def choose_engine(model: ModelInfo, engine: str | None = None) -> str:
    """The engine that will run a model: the forced one if it can, else the first available.

    Raises:
        BackendUnavailableError: the forced engine cannot run this format or is not installed, or
            no installed engine can run it; the hint says how to get one that can.
    """
    candidates = backends_for(model.format)
    if engine is not None:
        if engine not in candidates:
            raise BackendUnavailableError(*engine_mismatch(model, engine, candidates))
        if not get_backend(engine).available():
            raise BackendUnavailableError(f"the {engine} engine is not installed", backend_class(engine).install_hint)
        return engine
    found = _first_available(candidates)
    if found is not None:
        return found
    if not candidates:
        raise BackendUnavailableError(
            f"no engine can run '{model.name}' ({model.format} format)", "run 'localrun doctor'")
    missing = " or ".join(backend_class(n).title for n in candidates)
    ways = [*_copy_hints(model), backend_class(candidates[0]).install_hint]
    raise BackendUnavailableError(f"'{model.name}' is {describe_format(model.format)} and {missing} is not installed",
                                  ", or ".join(ways))


def likely_engine(fmt: str | None, engine: str | None = None) -> str | None:
    """The engine choose_engine will most likely pick for a model of this format (None: no
    guess), without raising: a hint for starting an engine process early."""
    if engine is not None or fmt is None:
        return engine
    return _first_available(backends_for(fmt))


def _first_available(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            if get_backend(name).available():
                return name
        except BackendUnavailableError:
            continue
    return None


def engine_mismatch(model: ModelInfo, engine: str, candidates: tuple[str, ...]) -> tuple[str, str]:
    """Why --engine cannot run this model, and what to do instead."""
    message = (f"the {engine} engine cannot run '{model.name}': it is {describe_format(model.format)}, which runs on "
               f"{' or '.join(candidates) or 'no engine'}")
    forced = backend_class(engine)
    drop = f"drop --engine to run it on {candidates[0]}" if candidates else "drop --engine"
    if model.format in forced.copies_from:
        return message, f"{drop}, or {forced.copy_hint.format(path=model.path)}"
    return message, f"{drop}, the engine for its format"


def _copy_hints(model: ModelInfo) -> list[str]:
    """How the installed engines could make their own copy of this model."""
    out = []
    for cls in backend_classes():
        if model.format in cls.copies_from and cls().available():
            out.append(cls.copy_hint.format(path=model.path))
    return out
