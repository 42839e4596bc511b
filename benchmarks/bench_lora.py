"""Benchmark: LoRA adapters, localrun against llama.cpp's own tools.

convert: a rank-16 PEFT LoRA on all seven projections (q/k/v/o, gate/up/down) of a random
SmolLM-135M-shaped Llama (30 layers, hidden 576, FFN 1536, 9/3 heads, vocab 49152; BF16 weights
in safetensors; the adapter in F32 with PEFT's key layout) becomes a GGUF adapter, by
llama.cpp's convert_lora_to_gguf.py and by localrun's convert.convert_adapter, each a fresh
process, alternating for several rounds after a warm-up. `python -c "import convert"` is the
start-up floor. The table shows median wall time, peak RSS and the ratio to llama.cpp's time for
the same output type (target: <= 0.5x). The F32 outputs must hold the same tensors.

decode: decode tokens/s of a base model with a rank-16 adapter applied at run time (localrun's
per-request adapters on llama.cpp) against the same adapter merged into the weights, and the bare
base for reference; each side in its own engine process with the same settings, alternating.

    .venv/bin/python benchmarks/bench_lora.py [--only convert|decode] [--rounds 5] [--work DIR]

llama.cpp's converter comes from the llama-cpp-python sdist on PyPI (downloaded once, cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "convert"))
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convert import measure  # noqa: E402 - wall time and peak RSS of one child process

RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)


def make_base(folder: Path) -> None:
    """SmolLM-135M shapes, random BF16 weights, tied embeddings, one safetensors file."""
    import torch
    import transformers as tf
    from safetensors.torch import save_file

    cfg = tf.LlamaConfig(
        **SHAPE,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        if "norm" in name:
            state[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.save_pretrained(folder)


def make_adapter(folder: Path, base: Path) -> None:
    """A rank-16 LoRA as PEFT saves it: adapter_config.json and F32 lora_A/lora_B tensors."""
    import peft
    import torch
    from safetensors.torch import save_file

    hidden, ffn, heads, kv = (
        SHAPE["hidden_size"],
        SHAPE["intermediate_size"],
        SHAPE["num_attention_heads"],
        SHAPE["num_key_value_heads"],
    )
    kv_dim = hidden // heads * kv
    io = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden, kv_dim),
        "self_attn.v_proj": (hidden, kv_dim),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (hidden, ffn),
        "mlp.up_proj": (hidden, ffn),
        "mlp.down_proj": (ffn, hidden),
    }
    g = torch.Generator().manual_seed(1)
    state = {}
    for layer in range(SHAPE["num_hidden_layers"]):
        for module, (n_in, n_out) in io.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            state[f"{key}.lora_A.weight"] = torch.randn((RANK, n_in), generator=g) / n_in**0.5
            state[f"{key}.lora_B.weight"] = torch.randn((n_out, RANK), generator=g) * 0.01
    save_file(state, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    config = peft.LoraConfig(
        r=RANK, lora_alpha=32, target_modules=list(TARGETS), base_model_name_or_path=str(base)
    )
    config.save_pretrained(str(folder))


def bench_convert(work: Path, rounds: int) -> None:
    """Time both adapter converters on the same adapter, alternating; print the table."""
    from convert_helpers import converter_cache, llama_cpp_converter_dir

    base, adapter = work / "smollm-135m-random", work / "lora-r16"
    if not (base / "config.json").is_file():
        base.mkdir(exist_ok=True)
        t = time.perf_counter()
        make_base(base)
        print(f"made the base in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    if not (adapter / "adapter_config.json").is_file():
        adapter.mkdir(exist_ok=True)
        make_adapter(adapter, base)
    llama_dir = llama_cpp_converter_dir(converter_cache())
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(llama_dir / "gguf-py"), os.environ.get("PYTHONPATH", "")]
    )
    ours_code = (
        "import sys, convert; convert.convert_adapter(sys.argv[1], sys.argv[2], sys.argv[3], "
        "outtype=sys.argv[4], force=True)"
    )

    def ours(outtype: str) -> list[str]:
        out = work / f"ours-{outtype}.gguf"
        return [sys.executable, "-c", ours_code, str(adapter), str(base), str(out), outtype]

    def ref(outtype: str) -> list[str]:
        script = llama_dir / "convert_lora_to_gguf.py"
        out = work / f"ref-{outtype}.gguf"
        return [sys.executable, str(script), str(adapter), "--base", str(base),
                "--outtype", outtype, "--outfile", str(out)]  # fmt: skip

    runs = {
        "python -c 'import convert' (floor)": [sys.executable, "-c", "import convert"],
        "llama.cpp convert_lora_to_gguf.py f32": ref("f32"),
        "localrun convert_adapter f32": ours("f32"),
        "llama.cpp convert_lora_to_gguf.py f16": ref("f16"),
        "localrun convert_adapter f16": ours("f16"),
    }
    results: dict[str, list[dict]] = {name: [] for name in runs}
    names = list(runs)
    for name in names:  # warm-up: page cache, .pyc files
        measure(runs[name])
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            results[name].append(measure(runs[name]))
    _check_same_tensors(work / "ours-f32.gguf", work / "ref-f32.gguf")
    size = (adapter / "adapter_model.safetensors").stat().st_size
    print(
        f"\nrank-{RANK} LoRA on {len(TARGETS)} projections x {SHAPE['num_hidden_layers']} layers "
        f"of a SmolLM-135M-shaped Llama, adapter {size / 1e6:.1f} MB (F32); {os.cpu_count()} "
        f"CPUs; median of {rounds} rounds\n"
    )
    print(f"{'run':<42}{'wall s':>8}{'peak RSS MB':>13}{'x llama.cpp time':>18}")
    for name in names:
        wall = statistics.median(r["wall"] for r in results[name])
        rss = statistics.median(r["rss"] for r in results[name])
        outtype = name.rsplit(" ", 1)[-1]
        baseline = f"llama.cpp convert_lora_to_gguf.py {outtype}"
        ratio = ""
        if baseline in results and baseline != name:
            ratio = f"{wall / statistics.median(r['wall'] for r in results[baseline]):.2f}x"
        print(f"{name:<42}{wall:>8.2f}{rss / 1e6:>13.0f}{ratio:>18}")


def _check_same_tensors(ours: Path, ref: Path) -> None:
    from gguf import GGUFReader

    def tensors(path: Path) -> dict[str, bytes]:
        return {t.name: bytes(t.data) for t in GGUFReader(path).tensors}

    if tensors(ours) != tensors(ref):
        print("warning: the F32 adapters differ from llama.cpp's", file=sys.stderr)


# --- decode --------------------------------------------------------------------------------------


DECODE_TOKENS = 128
DECODE_PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _decode_files(work: Path) -> tuple[Path, Path, Path]:
    """The decode part's base (SmolLM-135M shapes with the Llama 2 tokenizer, F16 GGUF), its
    rank-16 adapter as a GGUF adapter, and the base with the adapter merged (F16 GGUF)."""
    import transformers as tf

    import convert
    from tests.lora_models import TOKENIZER

    base = work / "decode-base"
    if not (base / "config.json").is_file():
        base.mkdir(exist_ok=True)
        SHAPE["vocab_size"], vocab = 32000, SHAPE["vocab_size"]
        try:
            make_base(base)
            (work / "decode-lora").mkdir(exist_ok=True)
            make_adapter(work / "decode-lora", base)
        finally:
            SHAPE["vocab_size"] = vocab
        tf.AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(str(base))
    adapter = work / "decode-lora"
    out = (work / "decode-base-f16.gguf", work / "decode-lora-f16.gguf", work / "decode-merged-f16.gguf")
    if not out[0].is_file():
        convert.convert(base, out[0], outtype="f16", force=True)
        convert.convert_adapter(adapter, base, out[1], outtype="f16", force=True)
        convert.convert(base, out[2], outtype="f16", lora=[(str(adapter), 1.0)], force=True)
    return out


def bench_decode(work: Path, rounds: int) -> None:
    """Decode tokens/s with the adapter applied at run time against the merged model (the cost of
    applying it per request), and the bare base for reference. One engine process per side, the
    same settings (2 threads, context 512, greedy, 128 tokens), alternating rounds, medians."""
    from localrun import api
    from localrun.generation import Request
    from localrun.settings import GenerationParams, LoadOptions

    base, adapter, merged = _decode_files(work)
    options = LoadOptions(n_ctx=512, n_threads=2, gpu_layers=0)
    greedy = GenerationParams(temperature=0, max_tokens=DECODE_TOKENS)
    sides = {
        "merged model (baseline)": (merged, ()),
        "base + adapter at run time": (base, ((str(adapter), 1.0),)),
        "bare base (reference)": (base, ()),
    }
    sessions = {name: api.load(str(path), options, engine="llama.cpp") for name, (path, _) in sides.items()}
    speeds: dict[str, list[float]] = {name: [] for name in sides}
    texts: dict[str, str] = {}
    try:
        for name, session in sessions.items():  # warm-up: load the adapter, fill the caches
            list(session.stream(Request.raw(DECODE_PROMPT), dataclasses.replace(greedy, max_tokens=8,
                                                                                 lora=sides[name][1])))
        for r in range(rounds):
            order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
            for name in order:
                params = dataclasses.replace(greedy, lora=sides[name][1], seed=r)
                parts, last = [], None
                for chunk in sessions[name].stream(Request.raw(DECODE_PROMPT + " " * (r % 2)), params):
                    parts.append(chunk.text)
                    last = chunk
                assert last is not None and last.done
                speeds[name].append(last.tokens_per_second)
                texts.setdefault(name, "".join(parts))
    finally:
        for session in sessions.values():
            session.close()
    ref = statistics.median(speeds["merged model (baseline)"])
    print(f"\n## decode: {DECODE_TOKENS} tokens, 2 threads, F16, rank-16 adapter on 7 projections x 30 layers "
          f"({rounds} rounds, median)\n")
    print("| side | tokens/s | x merged |")
    print("|---|---|---|")
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / ref:.2f}x |")
    same = texts["merged model (baseline)"] == texts["base + adapter at run time"]
    print(f"\nrun-time adapter and merged model give the same greedy text: {same}")


PARTS = {"convert": bench_convert, "decode": bench_decode}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=list(PARTS), help="run one part (default: all)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, help="folder for the models and outputs (default: temp)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    missing = []
    try:
        for name in [args.only] if args.only else list(PARTS):
            try:
                PARTS[name](work, args.rounds)
            except NotImplementedError:
                if args.only:
                    raise
                missing.append(name)
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if missing:
        print(f"not written yet: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
