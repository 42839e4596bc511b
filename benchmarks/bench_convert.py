"""Benchmark: localrun's converter vs llama.cpp's convert_hf_to_gguf.py on a TinyLlama-shaped model
and on a mixture-of-experts model of about the same size.

A random-weight 1.1B Llama (22 layers, hidden 2048, FFN 5632, 32/4 heads, vocab 32000; BF16 in
three safetensors shards, Llama 2 SentencePiece tokenizer) and a random 1.1B Qwen3-MoE (10 layers,
hidden 1024, 64 experts of FFN 384 with 8 active, 16/4 heads, the Qwen3 tokenizer; BF16 in three
shards, one tensor per expert as published) are converted by both converters, like
with like: F16 against llama.cpp's F16, and Q4_K_M end to end against llama.cpp's own way there
(convert_hf_to_gguf.py to the same intermediate type localrun writes, then llama-quantize, both
with the same thread count). `cat` of the input bytes is the I/O floor. Every run is a child
process whose wall time and peak RSS are measured; the runs alternate, in the opposite order
every other round, and the table shows medians over the rounds; each ratio compares a row with
llama.cpp's row of the same output type, from this run only.

    .venv/bin/python benchmarks/bench_convert.py [--work DIR] [--keep] [--no-q4] [--rounds 3] [--layers 22]
        [--model dense|moe|both]

llama.cpp's converter comes from the llama-cpp-python sdist on PyPI (downloaded once, cached);
llama-quantize is built from the same llama.cpp by benchmarks/llama_tools.py (cached).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPM = ROOT.parent / "shared" / "assets" / "tokenizers" / "llama2-spm" / "tokenizer.model"
QWEN3 = ROOT.parent / "shared" / "assets" / "tokenizers" / "qwen3"
sys.path.insert(0, str(ROOT / "tests" / "convert"))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))  # convert_helpers imports tests.conftest

# Runs a command and prints its wall time and the peak RSS of its process tree's largest member.
_MEASURE = r"""
import resource, subprocess, sys, time, json
t = time.perf_counter()
rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
wall = time.perf_counter() - t
rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"rc": rc.returncode, "wall": wall, "rss": rss, "err": rc.stderr[-1500:]}))
"""


def measure(cmd: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE, *cmd], capture_output=True, text=True, check=True
    )
    res = json.loads(out.stdout)
    if res["rc"] != 0:
        raise SystemExit(f"{cmd[:3]} failed: {res['err']}")
    return res


def measure_steps(cmds: list[list[str]]) -> dict:
    """Steps run one after the other, as one contestant: wall times add up, peak RSS is the largest."""
    steps = [measure(c) for c in cmds]
    return {"wall": sum(r["wall"] for r in steps), "rss": max(r["rss"] for r in steps)}


def make_model(folder: Path, layers: int = 22) -> None:
    """TinyLlama shapes (or fewer layers), random BF16 weights, three shards."""
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    save_random(folder, cfg, tf.LlamaForCausalLM)
    shutil.copy(SPM, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "tokenizer_class": "LlamaTokenizer",
            }
        )
    )


def make_moe_model(folder: Path, layers: int = 10) -> None:
    """A Qwen3-MoE of about 1.1B parameters (64 experts, 8 active), random BF16 weights, three shards."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(QWEN3))
    cfg = tf.Qwen3MoeConfig(
        hidden_size=1024,
        intermediate_size=3072,
        moe_intermediate_size=384,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,  # as Qwen3-30B-A3B sets it
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=len(tok),
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    save_random(folder, cfg, tf.Qwen3MoeForCausalLM)
    tok.save_pretrained(folder)


def save_random(folder: Path, cfg, cls) -> None:  # noqa: ANN001
    """Random BF16 weights of the model class in three safetensors shards, made one tensor at a time."""
    import torch

    with torch.device("meta"):
        model = cls(cfg)
    g = torch.Generator().manual_seed(0)
    state = {}

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)

    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        elif name.endswith("experts.gate_up_proj"):  # fused in memory; published one tensor per expert
            n_exp, rows, cols = p.shape
            for e in range(n_exp):
                for part in ("gate_proj", "up_proj"):
                    state[name.replace("gate_up_proj", f"{e}.{part}.weight")] = rand(rows // 2, cols)
        elif name.endswith("experts.down_proj"):
            n_exp, rows, cols = p.shape
            for e in range(n_exp):
                state[name.replace("down_proj", f"{e}.down_proj.weight")] = rand(rows, cols)
        else:
            state[name] = rand(*p.shape)
    cfg.dtype = "bfloat16"
    from safetensors.torch import save_file

    names = list(state)
    total = sum(state[n].numel() * 2 for n in names)
    shards: list[list[str]] = [[]]
    size = 0
    for n in names:  # three shards of about equal size
        if size > total / 3 * len(shards) and len(shards) < 3:
            shards.append([])
        shards[-1].append(n)
        size += state[n].numel() * 2
    weight_map = {}
    for i, part in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: state[n] for n in part}, folder / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    cfg.architectures = [cls.__name__]
    cfg.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work", type=Path, help="folder for the model and outputs (default: a temp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--no-q4", action="store_true", help="skip the Q4_K_M runs")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every run (medians are shown)")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers of the dense model (fewer: a quick check)")
    ap.add_argument("--moe-layers", type=int, default=10, help="decoder layers of the MoE model")
    ap.add_argument("--model", choices=("dense", "moe", "both"), default="both", help="which models to convert")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.model in ("dense", "both"):
            model = work / f"tinyllama-random-{args.layers}l"
            title = f"TinyLlama-shaped random model ({args.layers} layers)"
            bench(model, lambda m: make_model(m, args.layers), title, args, work)
        if args.model in ("moe", "both"):
            model = work / f"qwen3moe-random-{args.moe_layers}l"
            title = f"Qwen3-MoE random model ({args.moe_layers} layers, 64 experts, 8 active)"
            bench(model, lambda m: make_moe_model(m, args.moe_layers), title, args, work)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


def bench(model: Path, make: Callable[[Path], None], title: str, args: argparse.Namespace, work: Path) -> None:
    """Every contestant on one model, alternating rounds; prints the table of medians."""
    if not (model / "config.json").is_file():
        model.mkdir(exist_ok=True)
        t = time.perf_counter()
        make(model)
        print(f"made {model.name} in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    from convert_helpers import converter_cache, llama_cpp_converter_dir

    llama_dir = llama_cpp_converter_dir(converter_cache())
    shards = sorted(str(p) for p in model.glob("*.safetensors"))
    in_bytes = sum(os.path.getsize(p) for p in shards)
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    threads = os.cpu_count() or 1

    def ours(outtype: str) -> dict:
        out = work / f"ours-{outtype}.gguf"
        code = ("import sys, convert; convert.convert(sys.argv[1], sys.argv[2], outtype=sys.argv[3],"
                " force=True, threads=int(sys.argv[4]))")
        r = measure([sys.executable, "-c", code, str(model), str(out), outtype, str(threads)])
        out.unlink()
        return r

    def reference(outtype: str) -> list[str]:
        return [sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(model), "--outtype", outtype,
                "--outfile", str(work / f"ref-{outtype}.gguf")]

    def ref_f16() -> dict:
        r = measure(reference("f16"))
        (work / "ref-f16.gguf").unlink()
        return r

    runs: list[tuple[str, str, Callable[[], dict]]] = [  # (name, output type, run)
        ("cat (I/O floor)", "", lambda: measure(["sh", "-c", 'cat "$@" | wc -c > /dev/null', "cat", *shards])),
        ("llama.cpp convert_hf_to_gguf.py f16", "f16", ref_f16),
        ("localrun convert f16", "f16", lambda: ours("f16")),
    ]
    if not args.no_q4:
        from llama_tools import tool_binary

        import convert

        quantize = tool_binary("llama-quantize")
        inter = convert.convert(model, work / "plan.gguf", outtype="q4_k_m", dry_run=True).plan.written_type

        def ref_q4() -> dict:
            mid, out = work / f"ref-{inter}.gguf", work / "ref-q4_k_m.gguf"
            r = measure_steps([reference(inter), [str(quantize), str(mid), str(out), "Q4_K_M", str(threads)]])
            mid.unlink()
            out.unlink()
            return r

        runs += [
            (f"llama.cpp {inter} + llama-quantize q4_k_m", "q4_k_m", ref_q4),
            ("localrun convert q4_k_m (end to end)", "q4_k_m", lambda: ours("q4_k_m")),
        ]
    measure(["cat", *shards])  # warm the page cache for everyone
    results: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for i in range(args.rounds):
        for name, _, run in runs if i % 2 == 0 else runs[::-1]:
            results[name].append(run())
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("wall", "rss")} for name, rs in results.items()}
    baseline = {kind: med[name] for name, kind, _ in runs if name.startswith("llama.cpp")}
    print(
        f"\n{title}, BF16, {len(shards)} shards,"
        f" {in_bytes / 1e9:.2f} GB; {os.cpu_count()} CPUs; {threads} threads for localrun and llama-quantize"
        " (convert_hf_to_gguf.py has no thread setting);"
        f" median of {args.rounds} alternating rounds\n"
    )
    print(
        f"{'run':<44} {'wall s':>8} {'peak RSS GB':>12} {'x llama.cpp time':>17} {'x llama.cpp RSS':>16}"
    )
    for name, kind, _ in runs:
        r, ref = med[name], baseline[kind or "f16"]
        print(
            f"{name:<44} {r['wall']:>8.2f} {r['rss'] / 1e9:>12.2f} "
            f"{r['wall'] / ref['wall']:>17.2f} {r['rss'] / ref['rss']:>16.2f}"
        )
    print("\nratios: against llama.cpp's row of the same output type (cat: against llama.cpp f16)")


if __name__ == "__main__":
    main()
