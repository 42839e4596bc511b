"""What llama.cpp allocates when it loads a model and creates a context, read from its own log
(the buffer sizes it prints), and small Llama-architecture GGUFs of any shape to load.

The fit tests and benchmarks/fit_vs_llama.py compare localrun's memory estimate with these figures.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K.gguf"
MIB = 1 << 20
RESOLUTION = -(-MIB // 200)  # the log prints MiB with two decimals: within half of 0.01 MiB
# ggml type ids of the KV-cache types llama_context_params takes (type_k, type_v)
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}

# "load_tensors:   CPU_Mapped model buffer size =    92.10 MiB", "llama_kv_cache:        CPU KV buffer
# size =    45.00 MiB", "sched_reserve:        CPU compute buffer size =    99.38 MiB",
# "llama_context:        CPU  output buffer size =     0.19 MiB"
_BUFFER = re.compile(r"(\S+)\s+(model|KV|compute|output) buffer size =\s*([\d.]+) MiB")
_KIND = {"model": "weights", "KV": "kv", "compute": "compute", "output": "output"}


@dataclass
class Buffers:
    """llama.cpp's buffers by kind (weights, kv, compute, output), each by buffer name, in bytes
    (from the log's MiB with two decimals: within 0.005 MiB)."""

    sizes: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, kind: str, buffer: str, mib: float) -> None:
        by_name = self.sizes.setdefault(kind, {})
        by_name[buffer] = by_name.get(buffer, 0) + round(mib * MIB)

    def total(self, kind: str) -> int:
        return sum(self.sizes.get(kind, {}).values())

    @classmethod
    def parse(cls, text: str) -> Buffers:
        out = cls()
        for name, kind, mib in _BUFFER.findall(text):
            out.add(_KIND[kind], name, float(mib))
        return out


@dataclass(frozen=True)
class ContextCase:
    """One llama_context's parameters."""

    n_ctx: int  # all sequences together, as llama_context_params.n_ctx
    kv_type: str = "f16"
    flash_attn: bool = False
    n_seq: int = 1
    n_batch: int = 512
    n_ubatch: int = 512


@contextmanager
def llama_log() -> Iterator[list[str]]:
    """What llama.cpp logs meanwhile (through localrun's own log sink, which stays installed)."""
    from localrun.backends.llama_loader import LOG, library

    library()
    lines: list[str] = []
    add = LOG.add
    shadowed = "add" in vars(LOG)

    def both(line: str) -> None:
        lines.append(line)
        add(line)

    LOG.add = both  # type: ignore[method-assign]
    try:
        yield lines
    finally:
        if shadowed:
            LOG.add = add  # type: ignore[method-assign]
        else:
            del LOG.add


def measure(path: Path, cases: list[ContextCase]) -> tuple[Buffers, list[Buffers]]:
    """Load the model once (all layers on the CPU) and create one context per case: the model's
    buffers, then each context's (KV cache, output, compute)."""
    from localrun.backends.llama_loader import library, load_model, model_params, new_context

    ll = library()
    with llama_log() as lines:
        model = load_model(str(path), str(path), model_params(0))
    weights = Buffers.parse("".join(lines))
    found = []
    try:
        for case in cases:
            params = ll.llama_context_default_params()
            params.n_ctx, params.n_batch, params.n_ubatch = case.n_ctx, case.n_batch, case.n_ubatch
            params.n_seq_max = case.n_seq
            params.kv_unified = False  # as localrun's engine creates its contexts
            params.type_k = params.type_v = GGML_TYPES[case.kv_type]
            params.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if case.flash_attn
                                      else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
            params.n_threads = params.n_threads_batch = 1
            with llama_log() as lines:
                ctx = new_context(model, params, f"a context for {case}", "")
            ll.llama_free(ctx)
            found.append(Buffers.parse("".join(lines)))
    finally:
        ll.llama_model_free(model)
    return weights, found


@dataclass(frozen=True)
class Row:
    """One case: llama.cpp's figures and localrun's (fit.memory_estimate), in bytes."""

    case: ContextCase
    llama: dict[str, int]  # weights, kv, compute, output, total
    localrun: dict[str, int]

    @property
    def label(self) -> str:
        c = self.case
        batch = f" batch {c.n_batch}/{c.n_ubatch}" if (c.n_batch, c.n_ubatch) != (512, 512) else ""
        return f"ctx {c.n_ctx} x{c.n_seq} {c.kv_type} fa {'on' if c.flash_attn else 'off'}{batch}"

    def diff(self, figure: str) -> float:
        """localrun's figure against llama.cpp's, in percent."""
        return 100 * (self.localrun[figure] - self.llama[figure]) / max(self.llama[figure], 1)

    def within(self, figure: str, tolerance: float) -> bool:
        """Whether localrun's figure is within `tolerance` (a fraction) of llama.cpp's, or within
        the log's resolution (tiny buffers, e.g. the output of a small vocabulary)."""
        return abs(self.localrun[figure] - self.llama[figure]) <= max(tolerance * self.llama[figure], RESOLUTION)


def compare(path: Path, cases: list[ContextCase]) -> list[Row]:
    """llama.cpp's buffers for each case next to localrun's estimate of them."""
    from localrun import fit
    from localrun.gguf_header import read_gguf

    shape = fit.shape_from_gguf(read_gguf(path))
    weights, found = measure(path, cases)
    rows = []
    for case, buffers in zip(cases, found, strict=True):
        est = fit.memory_estimate(shape, path.stat().st_size, case.n_ctx // case.n_seq, case.kv_type,
                                  sequences=case.n_seq, n_batch=case.n_batch, n_ubatch=case.n_ubatch,
                                  flash_attn=case.flash_attn)
        llama = {"weights": weights.total("weights"), "kv": buffers.total("kv"),
                 "compute": buffers.total("compute"), "output": buffers.total("output")}
        ours = {"weights": est.weights, "kv": est.kv, "compute": est.compute, "output": est.output}
        llama["total"], ours["total"] = sum(llama.values()), sum(ours.values())
        rows.append(Row(case, llama, ours))
    return rows


def llama_gguf(path: Path, *, vocab: int = 512, embd: int = 64, heads: int = 8, kv_heads: int = 4,
               ff: int = 172, layers: int = 2, experts: int = 0, experts_used: int = 0,
               tied: bool = False, context: int = 2048) -> Path:
    """A Llama-architecture GGUF of this shape (zero F16 weights, F32 norms), with stories260K's
    SentencePiece vocabulary padded with unused tokens up to `vocab`; experts > 0 makes its
    feed-forward blocks mixtures of experts (Mixtral's layout)."""
    import gguf

    src = gguf.GGUFReader(str(STORIES))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())[:vocab]
    scores = list(src.fields["tokenizer.ggml.scores"].contents())[:vocab]
    types = list(src.fields["tokenizer.ggml.token_type"].contents())[:vocab]
    for i in range(len(tokens), vocab):
        tokens.append(f"<unused{i}>")
        scores.append(0.0)
        types.append(int(gguf.TokenType.UNUSED))
    w = gguf.GGUFWriter(str(path), "llama")
    head_dim = embd // heads
    w.add_context_length(context)
    w.add_embedding_length(embd)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_block_count(layers)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(experts_used)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, *shape: int) -> None:
        w.add_tensor(name, np.zeros(shape, dtype=np.float16))

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(embd, dtype=np.float32))

    matrix("token_embd.weight", vocab, embd)
    norm("output_norm.weight")
    if not tied:
        matrix("output.weight", vocab, embd)
    for i in range(layers):
        b = f"blk.{i}"
        norm(f"{b}.attn_norm.weight")
        matrix(f"{b}.attn_q.weight", heads * head_dim, embd)
        matrix(f"{b}.attn_k.weight", kv_heads * head_dim, embd)
        matrix(f"{b}.attn_v.weight", kv_heads * head_dim, embd)
        matrix(f"{b}.attn_output.weight", embd, heads * head_dim)
        norm(f"{b}.ffn_norm.weight")
        if experts:
            w.add_tensor(f"{b}.ffn_gate_inp.weight", np.zeros((experts, embd), dtype=np.float32))
            matrix(f"{b}.ffn_gate_exps.weight", experts, ff, embd)
            matrix(f"{b}.ffn_up_exps.weight", experts, ff, embd)
            matrix(f"{b}.ffn_down_exps.weight", experts, embd, ff)
        else:
            matrix(f"{b}.ffn_gate.weight", ff, embd)
            matrix(f"{b}.ffn_up.weight", ff, embd)
            matrix(f"{b}.ffn_down.weight", embd, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
