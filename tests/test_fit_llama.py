"""localrun's memory estimate (fit.memory_estimate) against what llama.cpp itself allocates when it
loads a model and creates a context: the buffer sizes its log reports (model, KV, compute,
output), for f16/q8_0/q4_0 caches, flash attention on and off, one and four sequences, several
contexts, on the starter model, the real stories260K and a small mixture-of-experts model.

This build of llama.cpp has no GPU backend, so the --gpu-layers split is checked against
llama.cpp's layer-assignment rule (llama_model::load_tensors), not against a GPU's buffers.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from localrun import fit
from localrun.gguf_header import read_gguf
from tests.llama_buffers import MIB, STORIES, Buffers, ContextCase, Row, compare, llama_gguf

TOLERANCE = 0.05


def _cases(quantized: bool) -> list[ContextCase]:
    """Each context (all sequences together) with f16 K/V, flash attention off and on, and, where
    the heads allow a quantized cache, q8_0 and q4_0 (which need flash attention)."""
    kinds = [("f16", False), ("f16", True)] + ([("q8_0", True), ("q4_0", True)] if quantized else [])
    return [ContextCase(n_ctx, kv, fa, n_seq) for n_ctx in (512, 2048, 8192) for kv, fa in kinds for n_seq in (1, 4)]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers of 8 experts, 2 per token (Mixtral's layout in a Llama GGUF), 64-dim heads."""
    return llama_gguf(tmp_path_factory.mktemp("fit") / "moe.gguf", vocab=1000, embd=128, heads=2, kv_heads=1,
                      ff=256, layers=2, experts=8, experts_used=2)


def _off(rows: list[Row]) -> list[str]:
    """The figures further from llama.cpp's than 5% (or than the log's resolution, for tiny ones)."""
    return [f"{r.label}: {k} llama.cpp {r.llama[k] / MIB:.2f} MiB, localrun {r.localrun[k] / MIB:.2f} MiB"
            for r in rows for k in r.llama if not r.within(k, TOLERANCE)]


@pytest.mark.parametrize("model", ["starter", "stories", "moe"])
def test_the_estimate_is_within_5_percent_of_llama_cpps_buffers(model: str, starter: Path, moe_model: Path) -> None:
    path = {"starter": starter, "stories": STORIES, "moe": moe_model}[model]
    head_dim = {"starter": 64, "stories": 8, "moe": 64}[model]
    cases = _cases(quantized=head_dim % 32 == 0)
    if model == "starter":  # a context off the 256 grid, 3 sequences, smaller and larger batches
        cases += [ContextCase(1000), ContextCase(3000, "f16", True, 3), ContextCase(2048, "f16", False, 1, 256, 256),
                  ContextCase(2048, "q8_0", True, 1, 2048, 1024)]
    rows = compare(path, cases)
    assert not _off(rows), "\n".join(_off(rows))
    # The cases differ where it matters: the KV cache with the context and its type, the compute
    # buffer with flash attention and the context.
    assert len({r.llama["kv"] for r in rows}) >= 4 and len({r.llama["compute"] for r in rows}) >= 3


def test_the_buffers_are_read_from_llama_cpps_log() -> None:
    log = ("load_tensors:   CPU_Mapped model buffer size =    92.10 MiB\n"
           "llama_context:        CPU  output buffer size =     0.19 MiB\n"
           "llama_kv_cache:        CPU KV buffer size =    45.00 MiB\n"
           "sched_reserve:        CPU compute buffer size =    99.38 MiB\n"
           "sched_reserve:  CUDA_Host compute buffer size =     4.01 MiB\n")
    b = Buffers.parse(log)
    assert b.total("weights") == round(92.10 * MIB) and b.total("kv") == 45 * MIB
    assert b.total("compute") == round(99.38 * MIB) + round(4.01 * MIB) and b.total("output") == round(0.19 * MIB)


def test_the_gpu_split_follows_llama_cpps_layer_assignment(starter: Path) -> None:
    """llama_model::load_tensors: with n_gpu_layers = n, the layers from n_layer + 1 - n on go to the
    GPU and, when n >= 1, the output layer; the input layer (token embeddings) stays in host memory.
    The starter's output is tied to its token embeddings: offloading it copies them to the GPU."""
    meta = read_gguf(starter)
    shape = fit.shape_from_gguf(meta)
    layout = shape.weight_layout
    assert layout is not None and shape.layers == 30 and layout.tied and len(layout.layers) == 30
    embeddings = next(t.n_bytes for t in meta.tensors if t.name == "token_embd.weight")
    norm = next(t.n_bytes for t in meta.tensors if t.name == "output_norm.weight")
    assert (layout.input, layout.output) == (embeddings, norm)
    assert layout.total == sum(t.n_bytes for t in meta.tensors)
    assert [fit.gpu_split(30, n) for n in (0, 1, 2, 10, 30, 31, 99, -1)] == [
        (30, False), (30, True), (29, True), (21, True), (1, True), (0, True), (0, True), (0, True)]

    per_layer_kv = fit.kv_cache_bytes(shape, 2048) // 30
    cpu_only = fit.memory_estimate(shape, meta.size, 2048)
    assert cpu_only.gpu.total == 0 and cpu_only.cpu.weights == layout.total
    for n, on_gpu in ((1, 0), (10, 9), (30, 29), (31, 30), (-1, 30)):
        est = fit.memory_estimate(shape, meta.size, 2048, gpu_layers=n)
        assert est.gpu.weights == sum(layout.layers[30 - on_gpu:]) + norm + embeddings
        assert est.cpu.weights == embeddings + sum(layout.layers[:30 - on_gpu])
        assert (est.gpu.kv, est.cpu.kv) == (on_gpu * per_layer_kv, (30 - on_gpu) * per_layer_kv)
        assert est.cpu.output == 49152 * 4 and est.gpu.output == 0  # the logits come back to host memory
        assert est.gpu.compute > 0 and est.cpu.compute > 0
    # Every layer on the GPU: the host keeps only the batch's inputs, the GPU the graph.
    whole = fit.memory_estimate(shape, meta.size, 2048, gpu_layers=-1)
    assert whole.cpu.compute < whole.gpu.compute < cpu_only.cpu.compute


def test_the_default_context_is_the_most_the_whole_estimate_fits(starter: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """choose_context (the engines' default context, `show`) and estimate (`pull --check`) size the
    model with the same estimate: weights, every sequence's KV cache, compute and output buffers."""
    import localrun.system
    from localrun import api

    meta = read_gguf(starter)
    shape = fit.shape_from_gguf(meta)
    installed = fit.shape_of(api.get_model("smollm2:135m"))  # from the store's metadata: no weight layout
    assert installed == replace(shape, weight_layout=None) and installed.vocab == 49152

    def total(tokens: int, **kw: object) -> int:
        return fit.memory_estimate(shape, meta.size, tokens, **kw).total  # type: ignore[arg-type]

    assert fit.choose_context(shape, meta.size, memory=1 << 40).tokens == 8192
    budget = total(6000)  # llama.cpp rounds 6000 up to 6144 cells
    choice = fit.choose_context(shape, meta.size, memory=2 * budget)
    assert choice.tokens == 6144 and total(6144 + 256) > budget
    assert choice.text == "6144 (trained 8192; memory holds 6144 tokens for a sequence)"
    # Without flash attention the compute buffer holds every head's attention scores: less context fits.
    slow = fit.choose_context(shape, meta.size, memory=2 * budget, flash_attn=False)
    assert slow.tokens < 6144 and total(slow.tokens, flash_attn=False) <= budget < total(slow.tokens + 256, flash_attn=False)
    # Four sequences share the same memory (and the default goes no lower than 4096 tokens).
    fits = max(n for n in range(0, 8192, 256) if total(n, sequences=4) <= budget)
    assert 0 < fits < 6144 / 4
    four = fit.choose_context(shape, meta.size, sequences=4, memory=2 * budget)
    assert (four.tokens, four.reason) == (4096, f"memory holds {fits} tokens for 4 sequences")

    monkeypatch.setattr(localrun.system, "gpus", lambda: [])
    monkeypatch.setattr(localrun.system, "ram_bytes", lambda: (64 << 30, 32 << 30))
    est = fit.estimate("HuggingFaceTB/SmolLM2-135M-Instruct", (starter.name,), meta.size, shape, 2048)
    expected = fit.memory_estimate(shape, meta.size, 2048)
    assert (est.weights_bytes, est.kv_cache_bytes, est.compute_bytes, est.output_bytes) == \
        (expected.weights, expected.kv, expected.compute, expected.output)
    assert est.total_bytes == expected.total and est.overhead_bytes == expected.compute + expected.output
    assert est.to_dict()["compute_bytes"] == expected.compute
