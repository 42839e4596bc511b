"""The backend protocol and the registry of engines."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Protocol

from localrun.errors import BackendUnavailableError
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from localrun.store import ModelInfo


class Cancel(Protocol):
    """Anything with is_set(), e.g. threading.Event; checked between tokens."""

    def is_set(self) -> bool: ...


class Session(Protocol):
    """A loaded model."""

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Iterator[Chunk]:
        """Generate a reply, yielding text chunks and a final chunk with statistics.

        Args:
            request: chat messages (rendered with the model's template) or a raw prompt.
            params: sampling and stopping settings.
            cancel: checked between tokens; when set the stream ends with finish_reason "cancelled".

        Raises:
            ContextOverflowError: the prompt does not fit in the context.
            EngineError: the engine failed.
        """
        ...

    def info(self) -> dict[str, Any]:
        """What the engine reports about the loaded model (context, offload, threads)."""
        ...

    def close(self) -> None:
        """Free the model."""
        ...


class Backend(Protocol):
    """An inference engine."""

    name: str
    formats: tuple[str, ...]

    def available(self) -> bool:
        """Cheap probe: is the engine installed and usable here?"""
        ...

    def load(self, model: ModelInfo, options: LoadOptions) -> Session:
        """Load a model.

        Raises:
            BadModelFileError: the engine cannot read the file.
            EngineError: loading failed (e.g. out of memory).
        """
        ...


# name -> "module:class"; imported only when asked for.
_REGISTRY = {
    "llama.cpp": "localrun.backends.llama_cpp:LlamaCppBackend",
    "mlx": "localrun.backends.mlx:MLXBackend",
}
_FORMATS = {"gguf": ("llama.cpp",), "mlx": ("mlx",), "safetensors": ("mlx",)}


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    """Instantiate a backend by name."""
    target = _REGISTRY.get(name)
    if target is None:
        raise BackendUnavailableError(f"unknown engine '{name}'", f"choose one of {', '.join(_REGISTRY)}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise BackendUnavailableError(f"the {name} engine is not installed ({e.name} is missing)",
                                      "run 'localrun doctor' for install hints") from e
    backend: Backend = getattr(module, cls_name)()
    return backend


def backends_for(fmt: str) -> tuple[str, ...]:
    """Names of the engines that can run a model format, preferred first."""
    return _FORMATS.get(fmt, ())
