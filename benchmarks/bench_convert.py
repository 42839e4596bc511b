"""Benchmark: localrun's converter vs llama.cpp's convert_hf_to_gguf.py on a TinyLlama-shaped model.

A random-weight 1.1B Llama (22 layers, hidden 2048, FFN 5632, 32/4 heads, vocab 32000; BF16 in
three safetensors shards, Llama 2 SentencePiece tokenizer) is converted to F16 by both converters
in the same run; `cat` of the input bytes is the I/O floor. Wall time and peak RSS of each child
process are measured; the ratios in the table come from this run only. Q4_K_M end to end is timed
too (BF16 intermediate + llama.cpp's quantizer).

    .venv/bin/python benchmarks/bench_convert.py [--work DIR] [--keep] [--no-q4]

llama.cpp's converter comes from the llama-cpp-python sdist on PyPI (downloaded once, cached).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPM = ROOT.parent / "shared" / "assets" / "tokenizers" / "llama2-spm" / "tokenizer.model"
sys.path.insert(0, str(ROOT / "tests" / "convert"))

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


def make_model(folder: Path) -> None:
    """TinyLlama shapes, random BF16 weights, three shards."""
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.device("meta"):
        model = tf.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            state[name] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
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
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(folder)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--work", type=Path, help="folder for the model and outputs (default: a temp dir)"
    )
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--no-q4", action="store_true", help="skip the Q4_K_M run")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tinyllama-random"
    try:
        if not (model / "config.json").is_file():
            model.mkdir(exist_ok=True)
            t = time.perf_counter()
            make_model(model)
            print(f"made the model in {time.perf_counter() - t:.0f}s", file=sys.stderr)
        from convert_helpers import converter_cache, llama_cpp_converter_dir

        llama_dir = llama_cpp_converter_dir(converter_cache())
        shards = sorted(str(p) for p in model.glob("*.safetensors"))
        in_bytes = sum(os.path.getsize(p) for p in shards)
        ours_cmd = [
            sys.executable,
            "-c",
            "import sys, convert; convert.convert(sys.argv[1], sys.argv[2], outtype=sys.argv[3], force=True)",
        ]
        env_path = f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
        os.environ["PYTHONPATH"] = env_path
        measure(["cat", *shards])  # warm the page cache for everyone
        rows = []
        cat = measure(["sh", "-c", 'cat "$@" | wc -c > /dev/null', "cat", *shards])
        rows.append(("cat (I/O floor)", cat))
        ref = measure(
            [
                sys.executable,
                str(llama_dir / "convert_hf_to_gguf.py"),
                str(model),
                "--outtype",
                "f16",
                "--outfile",
                str(work / "ref-f16.gguf"),
            ]
        )
        rows.append(("llama.cpp convert_hf_to_gguf.py f16", ref))
        (work / "ref-f16.gguf").unlink()
        ours = measure([*ours_cmd, str(model), str(work / "ours-f16.gguf"), "f16"])
        rows.append(("localrun convert f16", ours))
        (work / "ours-f16.gguf").unlink()
        if not args.no_q4:
            q4 = measure([*ours_cmd, str(model), str(work / "ours-q4_k_m.gguf"), "q4_k_m"])
            rows.append(("localrun convert q4_k_m (end to end)", q4))
        print(
            f"\nTinyLlama-shaped random model, BF16, {len(shards)} shards, {in_bytes / 1e9:.2f} GB; "
            f"{os.cpu_count()} CPUs\n"
        )
        print(
            f"{'run':<40} {'wall s':>8} {'peak RSS GB':>12} {'x llama.cpp time':>17} {'x llama.cpp RSS':>16}"
        )
        for name, r in rows:
            print(
                f"{name:<40} {r['wall']:>8.2f} {r['rss'] / 1e9:>12.2f} "
                f"{r['wall'] / ref['wall']:>17.2f} {r['rss'] / ref['rss']:>16.2f}"
            )
    finally:
        if not args.keep and args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
