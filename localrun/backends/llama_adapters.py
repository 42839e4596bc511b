"""LoRA adapters on the llama.cpp engine: GGUF adapter files loaded once and set on the context
per request."""

from __future__ import annotations

import ctypes
from typing import Any

from localrun.backends.llama_loader import LOG, last_log_error
from localrun.errors import BadModelFileError
from localrun.store import ModelInfo


class LlamaAdapters:
    """The engine's LoRA adapters: loaded on first use, kept with the model, applied per context."""

    ll: Any
    model: Any
    model_info: ModelInfo
    ctx: Any
    _adapters: dict[str, Any]
    lora: tuple[tuple[str, float], ...]

    def _adapter(self, path: str) -> Any:
        """The loaded adapter of a GGUF LoRA file (loaded once, kept with the model)."""
        handle = self._adapters.get(path)
        if handle is None:
            LOG.clear()
            handle = self.ll.llama_adapter_lora_init(self.model, path.encode())
            if not handle:
                reason = last_log_error() or "llama.cpp could not load it"
                raise BadModelFileError(
                    f"cannot apply the LoRA adapter '{path}' to '{self.model_info.name}': {reason}",
                    "an adapter runs only on the base model it was trained for; check its base with 'localrun show'")
            self._adapters[path] = handle
        return handle

    def set_lora(self, lora: tuple[tuple[str, float], ...]) -> None:
        """Apply these adapters (file, scale) to every sequence decoded from now on.

        llama.cpp applies adapters per context, so the engine loop runs together only sequences
        that use the same adapters, and keeps their KV caches apart from the others'.
        """
        lora = tuple(lora)
        if lora == self.lora:
            return
        merged: dict[str, float] = {}
        for path, scale in lora:
            merged[path] = merged.get(path, 0.0) + scale
        ll = self.ll
        handles = [self._adapter(path) for path in merged]
        n = len(handles)
        if n:
            arr = (ll.llama_adapter_lora_p_ctypes * n)(*handles)
            scales = (ctypes.c_float * n)(*merged.values())
            ll.llama_set_adapters_lora(self.ctx, arr, n, scales)
        else:
            ll.llama_set_adapters_lora(self.ctx, None, 0, None)
        self.lora = lora
