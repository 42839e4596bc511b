"""localrun's memory estimate (fit.memory_estimate) against llama.cpp's own buffer sizes.

Each model is loaded once with llama.cpp (all layers on the CPU) and a context is created per
case; llama.cpp's log reports its model, KV, compute and output buffers, and the table sets
localrun's estimate of each beside it, with the difference in percent. Models: the starter
(SmolLM2-135M Q4_1), stories260K, and two mixtures of experts built for the run (Mixtral's layout:
8 experts with 2 per token, 16 with 4); with --models ...,qwen3moe also a tiny Qwen3-MoE converted
by llama.cpp's own converter (needs torch and transformers). The --gpu-layers split is printed as
estimated only: this llama.cpp build has no GPU backend to measure it with.

    .venv/bin/python benchmarks/fit_vs_llama.py [--models starter,stories,moe,moe16,qwen3moe] [--gpu]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.llama_buffers import MIB, STORIES, ContextCase, Row, compare, llama_gguf  # noqa: E402

FIGURES = ("weights", "kv", "compute", "output", "total")


def cases(quantized: bool) -> list[ContextCase]:
    kinds = [("f16", False), ("f16", True)] + ([("q8_0", True), ("q4_0", True)] if quantized else [])
    return [ContextCase(n_ctx, kv, fa, n_seq) for n_ctx in (512, 2048, 8192) for kv, fa in kinds for n_seq in (1, 4)]


def models(tmp: Path) -> dict[str, tuple[Path, bool]]:
    """name -> (GGUF, whether its heads allow a quantized cache)."""
    from localrun.store import starter_model_path

    starter = starter_model_path()
    found = {"stories": (STORIES, False),
             "moe": (llama_gguf(tmp / "moe.gguf", vocab=1000, embd=128, heads=2, kv_heads=1, ff=256, layers=2,
                                experts=8, experts_used=2), True),
             "moe16": (llama_gguf(tmp / "moe16.gguf", vocab=2000, embd=512, heads=8, kv_heads=2, ff=512, layers=2,
                                  experts=16, experts_used=4), True)}
    if starter is not None:
        found["starter"] = (starter, True)
    return found


def qwen3_moe(tmp: Path) -> Path:
    """tests/test_moe_runtime.py's Qwen3-MoE (2 layers, 4 experts, 2 per token, the real Qwen3
    vocabulary), converted by llama.cpp's convert_hf_to_gguf.py: another architecture's graph."""
    import torch
    import transformers as tf

    from tests.convert.convert_helpers import (
        convert_reference,
        converter_cache,
        llama_cpp_converter_dir,
        need_asset,
    )

    tok = tf.AutoTokenizer.from_pretrained(str(need_asset("tokenizers", "qwen3")))
    config = tf.Qwen3MoeConfig(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tok),
        max_position_embeddings=512, tie_word_embeddings=True, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True)
    torch.manual_seed(0)
    folder = tmp / "qwen3moe"
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return convert_reference(llama_cpp_converter_dir(converter_cache()), folder, tmp / "qwen3moe.gguf", "f32")


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def table(name: str, rows: list[Row]) -> float:
    """Print the model's rows; return the largest difference in percent (beyond the log's resolution)."""
    print(f"\n### {name}: weights llama.cpp {mib(rows[0].llama['weights'])} MiB, localrun "
          f"{mib(rows[0].localrun['weights'])} MiB ({rows[0].diff('weights'):+.2f}%)\n")
    print("| case | KV llama.cpp | KV localrun | % | compute llama.cpp | compute localrun | % "
          "| output llama.cpp | output localrun | total llama.cpp | total localrun | % |")
    print("|---" * 12 + "|")
    for r in rows:
        print(f"| {r.label} | {mib(r.llama['kv'])} | {mib(r.localrun['kv'])} | {r.diff('kv'):+.2f} "
              f"| {mib(r.llama['compute'])} | {mib(r.localrun['compute'])} | {r.diff('compute'):+.2f} "
              f"| {mib(r.llama['output'])} | {mib(r.localrun['output'])} "
              f"| {mib(r.llama['total'])} | {mib(r.localrun['total'])} | {r.diff('total'):+.2f} |")
    return max((abs(r.diff(f)) for r in rows for f in FIGURES if not r.within(f, 0)), default=0.0)


def gpu_table(path: Path) -> None:
    """The estimate's split for --gpu-layers (not measured: no GPU backend in this build)."""
    from localrun import fit
    from localrun.gguf_header import read_gguf

    shape = fit.shape_from_gguf(read_gguf(path))
    print(f"\n### {path.name}, ctx 4096, flash attention: --gpu-layers split (estimate only)\n")
    print("| --gpu-layers | host weights | host KV | host compute | host output | GPU weights | GPU KV | GPU compute |")
    print("|---" * 8 + "|")
    for n in (0, 1, (shape.layers or 0) // 2, shape.layers or 0, -1):
        est = fit.memory_estimate(shape, path.stat().st_size, 4096, gpu_layers=n)
        c, g = est.cpu, est.gpu
        print(f"| {n} | {mib(c.weights)} | {mib(c.kv)} | {mib(c.compute)} | {mib(c.output)} "
              f"| {mib(g.weights)} | {mib(g.kv)} | {mib(g.compute)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="starter,stories,moe,moe16")
    parser.add_argument("--gpu", action="store_true", help="also print the estimated --gpu-layers split")
    args = parser.parse_args()
    print("MiB as llama.cpp logs them (two decimals); % = (localrun - llama.cpp) / llama.cpp; the output\n"
          "buffer (the logits of one token per sequence) is below the log's resolution for small vocabularies")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="fit-vs-llama-") as tmp:
        found = models(Path(tmp))
        if "qwen3moe" in args.models.split(","):
            found["qwen3moe"] = (qwen3_moe(Path(tmp)), False)
        for name in args.models.split(","):
            if name not in found:
                print(f"\n### {name}: not available", file=sys.stderr)
                continue
            path, quantized = found[name]
            extra = [ContextCase(1000), ContextCase(3000, "f16", True, 3), ContextCase(2048, "f16", False, 1, 256, 256),
                     ContextCase(2048, "q8_0" if quantized else "f16", True, 1, 2048, 1024)]
            worst = max(worst, table(f"{name} ({path.name})", compare(path, cases(quantized) + extra)))
        if args.gpu and "starter" in found:
            gpu_table(found["starter"][0])
    print(f"\nlargest difference: {worst:.2f}% (target: within 5%)")
    return 0 if worst <= 5 else 1


if __name__ == "__main__":
    sys.exit(main())
