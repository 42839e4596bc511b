"""Will it fit: the memory a model needs (weights, KV cache, buffers) against this machine.

The GGUF header is read remotely with HTTP range requests (a few hundred KB of a multi-GB file);
safetensors and MLX repositories are sized from config.json and their weight files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from localrun.errors import BadModelFileError, HubError
from localrun.gguf_header import Experts

if TYPE_CHECKING:
    from localrun.generation import LoadOptions
    from localrun.store import ModelInfo

FIRST_READ = 1 << 20  # the header of most GGUFs fits in 1 MiB; vocabularies can take several
MAX_HEADER = 256 << 20
KV_BYTES = 2  # f16 K and V caches, llama.cpp's and MLX's default
GPU_USABLE = 0.9  # the driver, the display and the compute buffers take the rest
# The default context takes the model's trained context when the weights and every sequence's KV
# cache fit in this share of the memory free at load (the rest: other programs, other models).
MEMORY_SHARE = 0.5
SMALL_CONTEXT = 4096  # for a model that declares no trained context, and the least a default goes down to


@dataclass(frozen=True)
class Shape:
    """What the KV cache depends on."""

    layers: int | None
    kv_heads: int | None
    key_dim: int | None
    value_dim: int | None
    context_length: int | None
    architecture: str | None = None


@dataclass(frozen=True)
class FitEstimate:
    """The memory a model needs at a context size, and where it fits on this machine."""

    repo: str
    files: tuple[str, ...]
    weights_bytes: int
    kv_cache_bytes: int
    overhead_bytes: int
    context: int
    verdict: str  # "gpu", "ram" or "none"
    ram_total: int | None
    ram_available: int | None
    gpu_name: str | None = None
    gpu_bytes: int | None = None
    architecture: str | None = None
    details: dict[str, Any] = field(default_factory=dict, compare=False)
    parameters: int | None = None
    active_parameters: int | None = None  # a mixture-of-experts model: what one token goes through
    experts: Experts | None = None
    cpu_moe_layers: int = 0  # layers whose experts stay in host memory (--cpu-moe)
    host_bytes: int = 0  # the weights kept in host memory by --cpu-moe, even with the rest on the GPU
    suggested_cpu_moe: int | str | None = None  # the smallest --cpu-moe that fits the GPU, when one is needed

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes

    @property
    def device_bytes(self) -> int:
        """What the GPU holds when the whole model is offloaded: all but the host-kept experts."""
        return self.total_bytes - self.host_bytes

    @property
    def verdict_text(self) -> str:
        gpu = f"fits on the GPU ({self.gpu_name})"
        if self.host_bytes:
            gpu += f" with the expert weights of {self.cpu_moe_layers} layers in RAM"
        return {"gpu": gpu, "ram": "fits in RAM", "none": "does not fit in this machine's memory"}[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "repo": self.repo, "files": list(self.files), "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes, "overhead_bytes": self.overhead_bytes,
            "total_bytes": self.total_bytes, "context": self.context, "verdict": self.verdict,
            "verdict_text": self.verdict_text, "ram_total": self.ram_total, "ram_available": self.ram_available,
            "gpu_name": self.gpu_name, "gpu_bytes": self.gpu_bytes, "architecture": self.architecture,
            "parameters": self.parameters, "active_parameters": self.active_parameters,
            "expert_count": self.experts.count if self.experts else None,
            "expert_used_count": self.experts.used if self.experts else None,
            "expert_shared_count": self.experts.shared if self.experts else None,
            "expert_bytes": self.experts.expert_bytes if self.experts else None,
            "cpu_moe_layers": self.cpu_moe_layers, "host_bytes": self.host_bytes, "device_bytes": self.device_bytes,
            "suggested_cpu_moe": self.suggested_cpu_moe,
        }


def read_remote_gguf(name: str, size: int, read_range: Callable[[int, int], bytes]) -> Any:
    """Parse a remote GGUF header from its first bytes, fetching more while the header runs past them."""
    from localrun.gguf_header import parse_gguf_header

    n = min(size, FIRST_READ)
    while True:
        buf = read_range(0, n)
        try:
            return parse_gguf_header(buf, name, size)
        except BadModelFileError as e:
            if "runs past the end" not in e.message or n >= min(size, MAX_HEADER) or len(buf) < n:
                raise
            n = min(size, MAX_HEADER, n * 4)


def shape_from_gguf(meta: Any) -> Shape:
    """Layers, KV heads and head sizes from GGUF metadata."""
    return _gguf_shape(meta.arch_value, meta.context_length, meta.architecture)


def shape_of(model: ModelInfo) -> Shape:
    """The same for an installed model, from what the store read when it was added."""
    if model.format == "gguf":
        meta = model.details.get("metadata") or {}
        return _gguf_shape(lambda key: meta.get(f"{model.architecture}.{key}"), model.context_length, model.architecture)
    config = model.details.get("config")
    if isinstance(config, dict) and config:
        return shape_from_config(config)
    return Shape(None, None, None, None, model.context_length, model.architecture)


def _gguf_shape(arch_value: Callable[[str], Any], context_length: int | None, architecture: str | None) -> Shape:
    def num(key: str) -> int | None:
        value = arch_value(key)
        return int(value) if isinstance(value, int) else None

    heads = num("attention.head_count")
    embd = num("embedding_length")
    head_dim = embd // heads if embd and heads else None
    return Shape(
        layers=num("block_count"),
        kv_heads=num("attention.head_count_kv") or heads,
        key_dim=num("attention.key_length") or head_dim,
        value_dim=num("attention.value_length") or head_dim,
        context_length=context_length,
        architecture=architecture,
    )


def shape_from_config(cfg: dict[str, Any]) -> Shape:
    """The same from a Hugging Face config.json (multimodal configs keep it under text_config)."""
    sub = cfg.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else cfg
    heads = text.get("num_attention_heads")
    hidden = text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]
    return Shape(
        layers=text.get("num_hidden_layers"),
        kv_heads=text.get("num_key_value_heads") or heads,
        key_dim=head_dim,
        value_dim=head_dim,
        context_length=text.get("max_position_embeddings"),
        architecture=arch,
    )


def kv_cache_bytes(shape: Shape, context: int) -> int:
    """K and V for every layer and position (0 when the shape is unknown, e.g. recurrent models)."""
    if not (shape.layers and shape.kv_heads and shape.key_dim and shape.value_dim):
        return 0
    return shape.layers * context * shape.kv_heads * (shape.key_dim + shape.value_dim) * KV_BYTES


def overhead_bytes(weights: int) -> int:
    """Compute buffers and runtime: a fixed part plus a share of the weights (llama.cpp's graphs)."""
    return (256 << 20) + weights // 20


@dataclass(frozen=True)
class ContextChoice:
    """The context each sequence gets, and why."""

    tokens: int  # per sequence
    trained: int | None  # what the model was trained for (GGUF context_length, max_position_embeddings)
    sequences: int  # the parallel sequences it was sized for
    reason: str  # "set by --ctx", "fits in memory", "memory holds N for 4 sequences", ...

    @property
    def text(self) -> str:
        """E.g. "8192 (trained 8192; fits in memory)"."""
        trained = f"trained {self.trained}" if self.trained else "trained context unknown"
        return f"{self.tokens} ({trained}; {self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "trained": self.trained, "sequences": self.sequences, "reason": self.reason}


def choose_context(shape: Shape, weights: int, requested: int | None = None, sequences: int = 1,
                   memory: int | None = None) -> ContextChoice:
    """The context per sequence the engines load: `requested` (--ctx) if given, else the model's
    trained context when the weights and the KV cache of every sequence fit in MEMORY_SHARE of
    the memory the model loads into (`memory`, default: this machine's), else as much as does
    (never under min(trained, SMALL_CONTEXT): the engine then says what it cannot allocate)."""
    trained = shape.context_length if shape.context_length and shape.context_length > 0 else None
    sequences = max(1, sequences)
    if requested:
        return ContextChoice(requested, trained, sequences, "set by --ctx")
    if trained is None:
        return ContextChoice(SMALL_CONTEXT, None, sequences, f"{SMALL_CONTEXT}, as the model declares none")
    per_token = kv_cache_bytes(shape, 1)
    if memory is None:
        ram_total, ram_available, _, gpu_bytes = _machine()
        memory = _capacity(weights, ram_available or ram_total or 0, gpu_bytes)
    budget = int(memory * MEMORY_SHARE)
    room = budget - weights - overhead_bytes(weights)
    if per_token == 0 or per_token * sequences * trained <= room:
        return ContextChoice(trained, trained, sequences, "fits in memory" + (f" for {sequences} sequences" if sequences > 1 else ""))
    fits = max(0, room) // (per_token * sequences) // 256 * 256
    tokens = max(min(trained, SMALL_CONTEXT), fits)
    who = "a sequence" if sequences == 1 else f"{sequences} sequences"
    return ContextChoice(tokens, trained, sequences, f"memory holds {fits} tokens for {who}")


def context_for(model: ModelInfo, options: LoadOptions, trained: int | None = None) -> ContextChoice:
    """The context an engine loads a model with under these options (--ctx, --parallel);
    `trained`: the trained context as the loaded engine reads it, over the store's."""
    shape = shape_of(model)
    if trained:
        shape = replace(shape, context_length=trained)
    return choose_context(shape, model.size, options.n_ctx, options.n_parallel)


def _machine() -> tuple[int | None, int | None, str | None, int | None]:
    """This machine's RAM (total, available) and its largest GPU (name, free or else total bytes)."""
    from localrun.system import gpus, ram_bytes

    ram_total, ram_available = ram_bytes()

    def capacity(gpu: dict[str, Any]) -> int:
        return int(gpu.get("free_bytes") or gpu.get("total_bytes") or 0)

    largest = max(gpus(), key=capacity, default=None)
    if largest is None or not capacity(largest):
        return ram_total, ram_available, None, None
    return ram_total, ram_available, largest.get("name"), capacity(largest)


def _capacity(weights: int, ram: int, gpu: int | None) -> int:
    """The memory a model loads into: the GPU's when the weights fit there, else the RAM."""
    if gpu and weights + overhead_bytes(weights) <= gpu * GPU_USABLE:
        return int(gpu * GPU_USABLE)
    return ram


def parameters_from_gguf(meta: Any, weights: int | None = None) -> tuple[int, int | None, Experts | None]:
    """Parameters, active parameters (mixture-of-experts models) and experts from a GGUF header.

    weights: the bytes of every weights file; when they exceed the header's file (it is only the first
    part's of a split file), the counts grow in proportion."""
    from localrun.gguf_header import experts_of

    scale = weights / meta.size if weights and meta.size and weights > meta.size else 1.0
    experts = experts_of([meta], complete=scale == 1.0)
    total = round(meta.parameters * scale)
    return total, round(experts.active_parameters * scale) if experts else None, experts


def estimate(repo: str, files: tuple[str, ...], weights: int, shape: Shape, context: int | None,
             parameters: int | None = None, active_parameters: int | None = None,
             experts: Experts | None = None, cpu_moe: int | str = 0) -> FitEstimate:
    """Compare the model's needs with this machine's RAM and GPUs; with cpu_moe (--cpu-moe N or
    'all') the expert weights of those layers count toward host memory, not the GPU's."""
    ram_total, ram_available, gpu_name, gpu_bytes = _machine()
    ram = ram_available or ram_total or 0
    ctx = choose_context(shape, weights, context, memory=_capacity(weights, ram, gpu_bytes)).tokens
    kv = kv_cache_bytes(shape, ctx)
    overhead = overhead_bytes(weights)
    total = weights + kv + overhead

    def on_gpu(host: int) -> bool:
        return bool(gpu_bytes) and total - host <= (gpu_bytes or 0) * GPU_USABLE and host <= ram

    layers = experts.cpu_layers(cpu_moe) if experts else 0
    host = experts.host_bytes(layers) if experts else 0
    verdict = "gpu" if on_gpu(host) else "ram" if ram >= total else "none"
    suggested: int | str | None = None
    if experts and verdict != "gpu" and gpu_bytes:
        n = next((n for n in range(layers + 1, experts.layers + 1) if on_gpu(experts.host_bytes(n))), None)
        suggested = "all" if n == experts.layers else n
    return FitEstimate(
        repo, files, weights, kv, overhead, ctx, verdict, ram_total, ram_available, gpu_name, gpu_bytes,
        shape.architecture,
        {"layers": shape.layers, "kv_heads": shape.kv_heads, "key_dim": shape.key_dim,
         "value_dim": shape.value_dim, "model_context": shape.context_length},
        parameters, active_parameters, experts, layers, host, suggested,
    )


def check_header_size(size: int, name: str) -> None:
    if size < 24:
        raise HubError(f"'{name}' is only {size} bytes, not a GGUF model", "choose another file")
