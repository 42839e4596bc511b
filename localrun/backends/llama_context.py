"""The llama.cpp engine's context and the memory it takes: how many sequences and GPU layers
fit, the --cpu-moe overrides that keep a model's experts in host memory, and making the context."""

from __future__ import annotations

import ctypes
from typing import Any

from localrun.backends.llama_loader import GGML_KV_TYPES, LOG, KvCacheReport, libggml, new_context
from localrun.errors import EngineError, UsageError
from localrun.fit import Shape, kv_cache_bytes
from localrun.settings import LoadOptions
from localrun.store import ModelInfo

GGML_BACKEND_DEVICE_TYPE_CPU = 0


class LlamaContext:
    """The engine's one context of n_slots sequences: making it, and sizing it to the memory there is."""

    ll: Any
    options: LoadOptions
    model_info: ModelInfo
    model: Any
    threads: int
    gpu_layers: int
    ctx: Any
    batch: Any
    kv_caches: list[KvCacheReport]

    def make_context(self, n_ctx: int, n_parallel: int) -> None:
        """Create the context once: n_parallel sequences of up to n_ctx tokens.

        Each sequence has its own KV stream (kv_unified off): its attention then reads exactly
        the cells it would read alone, so a sequence decoded in a batch gets bit-identical logits
        to the same sequence decoded alone (with one sequence both layouts are the same).
        """
        ll, options = self.ll, self.options
        self._free_context()
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_parallel
        cparams.n_batch = min(options.n_batch, cparams.n_ctx)
        cparams.n_ubatch = min(cparams.n_batch, 512)
        cparams.n_seq_max = n_parallel
        cparams.n_threads = self.threads
        cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        cparams.kv_unified = False
        cparams.type_k = cparams.type_v = GGML_KV_TYPES[options.kv_type]
        # A quantized V cache needs flash attention: on unless the user turned it off (LoadOptions refuses that)
        flash = True if options.kv_type != "f16" and options.flash_attn is None else options.flash_attn
        if flash is not None:
            cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        what = f"{n_ctx} tokens" if n_parallel == 1 else f"{n_parallel} sequences of {n_ctx} tokens"
        LOG.kv_caches.clear()
        try:
            self.ctx = new_context(self.model, cparams, f"a context of {what} for '{self.model_info.name}'",
                                   "try a smaller --ctx" if n_parallel == 1 else "try a smaller --parallel or --ctx")
        except EngineError as e:
            # llama.cpp refuses a quantized cache whose blocks (32 values) do not divide a head's size
            reason = next((line.strip() for line in LOG.tail if "does not divide" in line), None)
            if options.kv_type != "f16" and reason:
                raise UsageError(f"--kv-type {options.kv_type} cannot hold the KV cache of '{self.model_info.name}': "
                                 f"{reason.split(': ', 1)[-1]}", "use --kv-type f16") from e
            raise
        self.kv_caches = list(LOG.kv_caches)
        self.n_slots = n_parallel
        self.n_batch = cparams.n_batch
        # While sequences generate, a step takes at most this many prompt tokens: a long prompt is
        # then processed over several steps, each of which also gives every running sequence a token.
        self.prefill_cap = max(32, self.n_batch // 4)
        self.mem = ll.llama_get_memory(self.ctx)
        self.batch = ll.llama_batch_init(max(cparams.n_batch, n_parallel), 0, 1)

    def _slots_in_ram(self, size: int) -> int:
        """How many sequences of size tokens the KV cache (of --kv-type) fits in half the available RAM."""
        from localrun.system import ram_bytes

        ll = self.ll
        available = ram_bytes()[1]
        if not available or self.gpu_layers != 0:
            return 1 << 30  # on a GPU a failed allocation makes the constructor retry with fewer
        head = ll.llama_model_n_embd(self.model) // max(1, ll.llama_model_n_head(self.model))
        shape = Shape(ll.llama_model_n_layer(self.model), ll.llama_model_n_head_kv(self.model), head, head, None)
        per_sequence = kv_cache_bytes(shape, size, self.options.kv_type)
        return max(1, available // 2 // max(1, per_sequence))

    def _free_context(self) -> None:
        if self.batch is not None:
            self.ll.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None

    def _gpu_layers(self, options: LoadOptions, host_bytes: int = 0) -> int:
        if not self.ll.llama_supports_gpu_offload():
            return 0
        if options.gpu_layers == "auto":
            return -1 if _fits_on_gpu(self.model_info, host_bytes) else 0
        return int(options.gpu_layers)


def _fits_on_gpu(model: ModelInfo, host_bytes: int = 0) -> bool:
    """Offload everything unless the GPU clearly lacks room (nvidia-smi when present); host_bytes
    of the weights stay in host memory (--cpu-moe)."""
    from localrun.system import gpus

    cards = gpus()
    if not cards or cards[0].get("free_bytes") is None:
        return True
    return bool((model.size - host_bytes) * 1.2 < cards[0]["free_bytes"])


class _BuftOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` go to `buft`."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _cpu_buffer_type() -> int:
    """ggml's CPU buffer type (host memory), the one llama.cpp's own --cpu-moe override names."""
    lib = libggml()  # the CPU device's buffer type, from ggml's device registry
    dev = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    buft = lib.ggml_backend_dev_buffer_type(dev) if dev else None
    if not buft:
        raise EngineError("--cpu-moe: this llama.cpp build has no CPU buffer type", "run without --cpu-moe")
    return int(buft)


def cpu_moe_overrides(ll: Any, model: ModelInfo, cpu_moe: int | str) -> tuple[Any, int, int]:
    """The NULL-terminated override array that keeps the experts of the first N layers (or all)
    in host memory, as llama.cpp's --n-cpu-moe / --cpu-moe build it; with the layers it covers and
    their expert bytes.

    Raises UsageError for a model without experts.
    """
    from localrun.errors import UsageError
    from localrun.gguf_header import EXPERT_TENSORS, model_experts

    experts = model_experts(model.details)
    if experts is None:
        raise UsageError(f"--cpu-moe: '{model.name}' is not a mixture-of-experts model (it has no expert tensors)",
                         "drop --cpu-moe; --gpu-layers N keeps whole layers off the GPU instead")
    layers = experts.cpu_layers(cpu_moe)
    if layers >= experts.layers:
        patterns = [EXPERT_TENSORS.encode()]
    else:
        patterns = [f"blk\\.{i}{EXPERT_TENSORS}".encode() for i in range(layers)]
    buft = _cpu_buffer_type()
    arr = (_BuftOverride * (len(patterns) + 1))()  # zeroed: the last entry ends the list
    for entry, pattern in zip(arr, patterns, strict=False):
        entry.pattern, entry.buft = pattern, buft
    return (arr, patterns), layers, experts.host_bytes(layers)
