"""Will it fit: the memory a model needs (weights, KV cache, buffers) against this machine.

The GGUF header is read remotely with HTTP range requests (a few hundred KB of a multi-GB file);
safetensors and MLX repositories are sized from config.json and their weight files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from localrun.compute_buffer import Decoder, compute_buffer_bytes, host_input_bytes, rotation
from localrun.errors import BadModelFileError, HubError
from localrun.gguf_header import Experts

if TYPE_CHECKING:
    from localrun.settings import LoadOptions
    from localrun.store import ModelInfo

FIRST_READ = 1 << 20  # the header of most GGUFs fits in 1 MiB; vocabularies can take several
MAX_HEADER = 256 << 20
KV_BYTES = 2  # f16 K and V caches, llama.cpp's and MLX's default
# Bytes per cached value for each KV-cache type (ggml's block sizes: q8_0 is 34 bytes per 32, q4_0 18 per 32)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32,
                 "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
GPU_USABLE = 0.9  # the driver and the display take the rest
# The default context takes the model's trained context when what llama.cpp allocates for it
# (memory_estimate) fits in this share of the memory free at load (the rest: other programs, other models).
MEMORY_SHARE = 0.5
SMALL_CONTEXT = 4096  # for a model that declares no trained context, and the least a default goes down to
_LAYER = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class WeightLayout:
    """A GGUF's weight bytes as llama.cpp places them: the input layer (token embeddings, always in
    host memory), each repeating layer, and the output layer."""

    input: int
    layers: tuple[int, ...]
    output: int
    tied: bool  # no output.weight: the output layer uses the token embeddings (a copy on a GPU)

    @property
    def total(self) -> int:
        return self.input + sum(self.layers) + self.output


@dataclass(frozen=True)
class Shape:
    """What the KV cache and llama.cpp's compute graph depend on (None: unknown)."""

    layers: int | None
    kv_heads: int | None
    key_dim: int | None
    value_dim: int | None
    context_length: int | None
    architecture: str | None = None
    embedding: int | None = None
    heads: int | None = None
    feed_forward: int | None = None
    vocab: int | None = None
    experts: int = 0  # a mixture of experts: experts per layer, and how many each token goes through
    experts_used: int = 0
    expert_feed_forward: int | None = None
    shared_feed_forward: int = 0  # shared experts' hidden size (0: none)
    dense_layers: int = 0  # leading layers with a dense feed-forward block in a mixture of experts
    weight_layout: WeightLayout | None = None  # from a GGUF header that lists every tensor


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
    compute_bytes: int = 0  # llama.cpp's compute buffer; overhead_bytes holds it and the output buffer
    output_bytes: int = 0
    projector: str | None = None  # a vision model's projector file, loaded with it
    projector_bytes: int = 0
    download_bytes: int = 0  # every file a pull fetches, the projector included

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes + self.projector_bytes

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
            "suggested_cpu_moe": self.suggested_cpu_moe, "compute_bytes": self.compute_bytes,
            "output_bytes": self.output_bytes, "projector": self.projector, "projector_bytes": self.projector_bytes,
            "download_bytes": self.download_bytes,
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
    """Layers, heads, head sizes, feed-forward sizes, vocabulary and experts from GGUF metadata,
    and where llama.cpp puts the weights when the header lists every tensor (not a split file's part)."""
    shape = _gguf_shape(meta.arch_value, meta.context_length, meta.architecture, meta.vocab_size or None)
    split = meta.metadata.get("split.count")
    if isinstance(split, int) and split > 1:
        return shape
    return replace(shape, weight_layout=weight_layout(((t.name, t.n_bytes) for t in meta.tensors), shape.layers or 0))


def shape_of(model: ModelInfo) -> Shape:
    """The same for an installed model, from what the store read when it was added (no weight layout)."""
    if model.format == "gguf":
        meta = model.details.get("metadata") or {}
        vocab = model.details.get("vocab_size")
        return _gguf_shape(lambda key: meta.get(f"{model.architecture}.{key}"), model.context_length, model.architecture,
                           vocab if isinstance(vocab, int) and vocab > 0 else None)
    config = model.details.get("config")
    if isinstance(config, dict) and config:
        return shape_from_config(config)
    return Shape(None, None, None, None, model.context_length, model.architecture)


def _gguf_shape(arch_value: Callable[[str], Any], context_length: int | None, architecture: str | None,
                vocab: int | None = None) -> Shape:
    def num(key: str) -> int | None:
        value = arch_value(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    heads = num("attention.head_count")
    embd = num("embedding_length")
    head_dim = embd // heads if embd and heads else None
    experts = num("expert_count") or 0
    expert_ff = num("expert_feed_forward_length")
    shared = num("expert_shared_feed_forward_length") or (num("expert_shared_count") or 0) * (expert_ff or 0)
    return Shape(
        layers=num("block_count"),
        kv_heads=num("attention.head_count_kv") or heads,
        key_dim=num("attention.key_length") or head_dim,
        value_dim=num("attention.value_length") or head_dim,
        context_length=context_length,
        architecture=architecture,
        embedding=embd,
        heads=heads,
        feed_forward=num("feed_forward_length"),
        vocab=num("vocab_size") or vocab,
        experts=experts,
        experts_used=min(num("expert_used_count") or experts, experts),
        expert_feed_forward=expert_ff,
        shared_feed_forward=shared,
        dense_layers=num("leading_dense_block_count") or 0,
    )


def weight_layout(tensors: Iterable[tuple[str, int]], layers: int) -> WeightLayout:
    """(name, bytes) of every tensor by llama.cpp's layers: blk.N.* repeat, output* is the output
    layer, the rest (token embeddings) the input layer."""
    per_layer = [0] * layers
    head = tail = 0
    tied = True
    for name, n_bytes in tensors:
        match = _LAYER.match(name)
        if match and int(match.group(1)) < layers:
            per_layer[int(match.group(1))] += n_bytes
        elif name.startswith("output"):
            tail += n_bytes
            tied = tied and name != "output.weight"
        else:
            head += n_bytes
    return WeightLayout(head, tuple(per_layer), tail, tied)


def shape_from_config(cfg: dict[str, Any]) -> Shape:
    """The same from a Hugging Face config.json (multimodal configs keep it under text_config)."""
    sub = cfg.get("text_config")
    text: dict[str, Any] = sub if isinstance(sub, dict) else cfg
    heads = text.get("num_attention_heads")
    hidden = text.get("hidden_size")
    head_dim = text.get("head_dim") or (hidden // heads if hidden and heads else None)
    arch = (cfg.get("architectures") or [cfg.get("model_type")])[0]

    def num(key: str) -> int | None:  # some configs hold per-layer lists: unknown here
        value = text.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    experts = num("num_local_experts") or num("num_experts") or num("n_routed_experts") or 0
    expert_ff = num("moe_intermediate_size")
    return Shape(
        layers=text.get("num_hidden_layers"),
        kv_heads=text.get("num_key_value_heads") or heads,
        key_dim=head_dim,
        value_dim=head_dim,
        context_length=text.get("max_position_embeddings"),
        architecture=arch,
        embedding=num("hidden_size"),
        heads=num("num_attention_heads"),
        feed_forward=num("intermediate_size"),
        vocab=num("vocab_size"),
        experts=experts,
        experts_used=min(num("num_experts_per_tok") or experts, experts),
        expert_feed_forward=expert_ff,
        shared_feed_forward=num("shared_expert_intermediate_size") or (num("n_shared_experts") or 0) * (expert_ff or 0),
        dense_layers=num("first_k_dense_replace") or 0,
    )


def kv_cache_bytes(shape: Shape, context: int, kv_type: str = "f16") -> int:
    """K and V for every layer and position (0 when the shape is unknown, e.g. recurrent models),
    with both caches of kv_type (f16, q8_0, q4_0, ...: KV_TYPE_BYTES)."""
    if not (shape.layers and shape.kv_heads and shape.key_dim and shape.value_dim):
        return 0
    return int(shape.layers * context * shape.kv_heads * (shape.key_dim + shape.value_dim) * KV_TYPE_BYTES[kv_type])


def overhead_bytes(weights: int) -> int:
    """A guess at the buffers of a model whose dimensions are unknown: a fixed part plus a share of the weights."""
    return (256 << 20) + weights // 20


@dataclass(frozen=True)
class DeviceMemory:
    """What llama.cpp allocates on one device: its model, KV, compute and output buffers."""

    weights: int = 0
    kv: int = 0
    compute: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.output

    def to_dict(self) -> dict[str, int]:
        return {"weights_bytes": self.weights, "kv_cache_bytes": self.kv, "compute_bytes": self.compute,
                "output_bytes": self.output, "total_bytes": self.total}


@dataclass(frozen=True)
class MemoryEstimate:
    """What llama.cpp allocates for a model and a context, in host memory and on the GPU."""

    cpu: DeviceMemory
    gpu: DeviceMemory
    cells: int  # KV cells per sequence: the context rounded up as llama.cpp rounds it

    @property
    def weights(self) -> int:
        return self.cpu.weights + self.gpu.weights

    @property
    def kv(self) -> int:
        return self.cpu.kv + self.gpu.kv

    @property
    def compute(self) -> int:
        return self.cpu.compute + self.gpu.compute

    @property
    def output(self) -> int:
        return self.cpu.output + self.gpu.output

    @property
    def total(self) -> int:
        return self.cpu.total + self.gpu.total

    def to_dict(self) -> dict[str, Any]:
        return {"cells": self.cells, "cpu": self.cpu.to_dict(), "gpu": self.gpu.to_dict(), "total_bytes": self.total}


def gpu_split(layers: int, gpu_layers: int) -> tuple[int, bool]:
    """llama.cpp's layer assignment (llama_model::load_tensors) for n_gpu_layers: the first
    repeating layer on the GPU (the last layers go there) and whether the output layer does; the
    input layer stays in host memory. gpu_layers < 0: all of them."""
    n = layers + 1 if gpu_layers < 0 else min(gpu_layers, layers + 1)
    return min(max(layers + 1 - n, 0), layers), n >= 1


def memory_estimate(shape: Shape, weights: int, context: int, kv_type: str = "f16", *, sequences: int = 1,
                    n_batch: int = 512, n_ubatch: int = 512, flash_attn: bool | None = None,
                    gpu_layers: int = 0) -> MemoryEstimate:
    """What llama.cpp allocates for `sequences` sequences of `context` tokens (each its own KV
    stream, as localrun's engine creates them), per device: the weights (the tensors of the
    shape's weight layout, else the files' `weights` bytes), the KV cache (n_ctx rounded up to 256
    cells per sequence), the compute buffer (its graph for one n_ubatch, replayed: compute_buffer)
    and the output buffer (the logits of one token per sequence). flash_attn None: llama.cpp's
    "auto", which turns it on. gpu_layers: as llama.cpp's n_gpu_layers (gpu_split)."""
    n_seq = max(1, sequences)
    cells = _round_up(_round_up(context * n_seq, 256) // n_seq, 256)
    total_cells = cells * n_seq
    outputs = min(total_cells, n_ubatch, n_batch)  # llama_context::sched_reserve's worst case
    tokens = _round_up(outputs, n_seq)  # graph_reserve: whole tokens per sequence
    fa = flash_attn is not False
    kv = kv_cache_bytes(shape, total_cells, kv_type)
    layers = shape.layers or 0
    start, output_on_gpu = gpu_split(layers, gpu_layers)
    on_gpu = layers - start
    kv_gpu = kv * on_gpu // layers if layers else 0
    output = (shape.vocab or 0) * 4 * n_seq  # llama_context::output_reserve: f32 logits
    decoder = _decoder(shape)
    if decoder is None:
        host, device = (0, overhead_bytes(weights)) if output_on_gpu else (overhead_bytes(weights), 0)
    else:
        def peak(d: Decoder, host_inputs: bool) -> int:
            return compute_buffer_bytes(d, cells, tokens, fa, rotation(d.key_dim, kv_type, True),
                                        rotation(d.value_dim, kv_type, False), host_inputs, outputs)

        if not output_on_gpu:
            host, device = peak(decoder, True), 0
        elif on_gpu == layers:  # all the layers on the GPU: the host keeps the batch's inputs
            host, device = host_input_bytes(decoder, cells, tokens, fa), peak(decoder, False)
        else:  # the host runs its layers, the GPU the rest and the output layer (the logits)
            host, device = peak(replace(decoder, vocab=0), True), peak(decoder, False)
    cpu_w, gpu_w = _weight_split(shape.weight_layout, weights, layers, start, output_on_gpu)
    return MemoryEstimate(DeviceMemory(cpu_w, kv - kv_gpu, host, output), DeviceMemory(gpu_w, kv_gpu, device, 0), cells)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _decoder(shape: Shape) -> Decoder | None:
    """The compute graph's dimensions, or None when the shape lacks one."""
    s = shape
    if not (s.vocab and s.embedding and s.layers and s.heads and s.kv_heads and s.key_dim and s.value_dim):
        return None
    ff = s.feed_forward or 0
    return Decoder(s.vocab, s.embedding, s.layers, s.heads, s.kv_heads, s.key_dim, s.value_dim, ff, s.experts,
                   s.experts_used, s.expert_feed_forward or ff, s.shared_feed_forward, s.dense_layers)


def _weight_split(layout: WeightLayout | None, weights: int, layers: int, start: int, output_on_gpu: bool) -> tuple[int, int]:
    """(host, GPU) weight bytes: the repeating layers from `start` and perhaps the output layer on the
    GPU (a copy of the token embeddings when the output is tied to them). Without a layout, or when
    the files (`weights`) hold more than a header beyond the tensors it lists, the files' bytes in
    proportion to the layers offloaded."""
    if layout is None or weights - layout.total > MAX_HEADER:
        share = (layers - start + (1 if output_on_gpu else 0)) / (layers + 1)
        gpu = int(weights * share)
        return weights - gpu, gpu
    gpu = sum(layout.layers[start:])
    host = layout.input + sum(layout.layers[:start])
    if output_on_gpu:
        gpu += layout.output + (layout.input if layout.tied else 0)
    else:
        host += layout.output
    return host, gpu


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
                   memory: int | None = None, kv_type: str = "f16", *, n_batch: int = 512,
                   flash_attn: bool | None = None) -> ContextChoice:
    """The context per sequence the engines load: `requested` (--ctx) if given, else the model's
    trained context when all llama.cpp allocates for it (memory_estimate: the weights, the KV cache
    (of kv_type) of every sequence, the compute and output buffers) fits in MEMORY_SHARE of the
    memory the model loads into (`memory`, default: this machine's), else as much as does (never
    under min(trained, SMALL_CONTEXT): the engine then says what it cannot allocate)."""
    trained = shape.context_length if shape.context_length and shape.context_length > 0 else None
    sequences = max(1, sequences)
    if requested:
        return ContextChoice(requested, trained, sequences, "set by --ctx")
    if trained is None:
        return ContextChoice(SMALL_CONTEXT, None, sequences, f"{SMALL_CONTEXT}, as the model declares none")

    def need(tokens: int) -> int:
        return memory_estimate(shape, weights, tokens, kv_type, sequences=sequences, n_batch=n_batch,
                               flash_attn=flash_attn).total

    least = min(trained, SMALL_CONTEXT)
    if memory is None:
        ram_total, ram_available, _, gpu_bytes = _machine()
        memory = _capacity(need(least), ram_available or ram_total or 0, gpu_bytes)
    budget = int(memory * MEMORY_SHARE)
    if kv_cache_bytes(shape, 1, kv_type) == 0 or need(trained) <= budget:
        return ContextChoice(trained, trained, sequences, "fits in memory" + (f" for {sequences} sequences" if sequences > 1 else ""))
    low, high = 0, trained // 256  # the most 256-token blocks that fit: need() grows with the context
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if need(mid * 256) <= budget else (low, mid - 1)
    fits = low * 256
    who = "a sequence" if sequences == 1 else f"{sequences} sequences"
    return ContextChoice(max(least, fits), trained, sequences, f"memory holds {fits} tokens for {who}")


def context_for(model: ModelInfo, options: LoadOptions, trained: int | None = None) -> ContextChoice:
    """The context an engine loads a model with under these options (--ctx, --parallel, --kv-type,
    --batch-size, --flash-attn); `trained`: the trained context as the loaded engine reads it, over the store's."""
    shape = shape_of(model)
    if trained:
        shape = replace(shape, context_length=trained)
    return choose_context(shape, model.size, options.n_ctx, options.n_parallel, kv_type=options.kv_type,
                          n_batch=options.n_batch, flash_attn=options.flash_attn)


def model_memory(model: ModelInfo, options: LoadOptions, context: int | None = None, gpu_layers: int = 0) -> MemoryEstimate:
    """What llama.cpp allocates for an installed model under these options, at `context` tokens
    per sequence (default: the context it loads with), gpu_layers of it on the GPU."""
    tokens = context or context_for(model, options).tokens
    return memory_estimate(shape_of(model), model.size, tokens, options.kv_type, sequences=options.n_parallel,
                           n_batch=options.n_batch, flash_attn=options.flash_attn, gpu_layers=gpu_layers)


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


def _capacity(need: int, ram: int, gpu: int | None) -> int:
    """The memory a model loads into: the GPU's when it fits there (`need` bytes), else the RAM."""
    if gpu and need <= gpu * GPU_USABLE:
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
             experts: Experts | None = None, cpu_moe: int | str = 0, projector_bytes: int = 0) -> FitEstimate:
    """Compare the model's needs with this machine's RAM and GPUs; with cpu_moe (--cpu-moe N or
    'all') the expert weights of those layers count toward host memory, not the GPU's. A vision
    model's projector (projector_bytes, its file's size) loads beside it; the context stays the one
    the engine chooses for the model alone."""
    ram_total, ram_available, gpu_name, gpu_bytes = _machine()
    ram = ram_available or ram_total or 0
    least = memory_estimate(shape, weights, min(shape.context_length or SMALL_CONTEXT, SMALL_CONTEXT)).total
    ctx = choose_context(shape, weights, context, memory=_capacity(least, ram, gpu_bytes)).tokens
    memory = memory_estimate(shape, weights, ctx)
    weights, kv, overhead = memory.weights, memory.kv, memory.compute + memory.output
    total = memory.total + projector_bytes

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
        parameters, active_parameters, experts, layers, host, suggested, memory.compute, memory.output,
        projector_bytes=projector_bytes,
    )


def check_header_size(size: int, name: str) -> None:
    if size < 24:
        raise HubError(f"'{name}' is only {size} bytes, not a GGUF model", "choose another file")
