"""Aggregate throughput of `localrun batch` against the loop a user writes by hand: one
`llama_cpp.Llama.create_chat_completion` after another. Both run as fresh processes and are timed
from start to exit (interpreter start, model load, prompts and generation), in the same run,
alternating, since machines are noisy.

    python benchmarks/bench_batch.py [--model NAME|PATH] [--prompts 32] [--tokens 64] [--parallel 16] [--rounds 3]
                                     [--gpu-layers N] [--flash-attn on|off]

Target: localrun batch >= 1.8x the loop's generated tokens per second of wall time.
Both sides get the same explicit engine settings, printed above the table: threads (Llama() would
default to half the cores), GPU layers (Llama() would default to none; all when this llama.cpp
build offloads) and flash attention (Llama() would default to off; on unless told). The loop
reuses its cached prompt prefix between calls, as Llama does by itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SYSTEM = "You are a helpful assistant who writes vivid, detailed prose."
TOPICS = [
    "a lighthouse keeper", "a city under the sea", "the first day of spring", "a lost dog finding home",
    "a robot learning to paint", "a storm at sea", "a mountain village", "an old library",
    "a journey across the desert", "a market in the morning", "a clockmaker", "a train at night",
    "a garden in autumn", "a dragon who is afraid of fire", "a space station", "a chess tournament",
    "a baker's first shop", "a river in flood", "a forgotten castle", "a kite festival",
    "a winter cabin", "an island volcano", "a jazz club", "a detective in the rain",
    "a beekeeper", "a circus leaving town", "a lonely astronaut", "a street musician",
    "a coral reef", "a haunted theatre", "a wedding in the hills", "a tiny inventor",
]

LOOP = r"""
import json, sys, time
t0 = time.perf_counter()
from llama_cpp import Llama
path, threads, tokens, system = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gpu_layers, flash_attn = int(sys.argv[5]), sys.argv[6] == "on"
prompts = json.loads(sys.stdin.read())
llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_gpu_layers=gpu_layers,
            flash_attn=flash_attn, verbose=False)
n = 0
for p in prompts:
    out = llm.create_chat_completion(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": p}],
        max_tokens=tokens, temperature=0)
    n += out["usage"]["completion_tokens"]
print(json.dumps({"tokens": n}))
"""


def prompts(n: int) -> list[str]:
    return [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


ALL_LAYERS = 999  # more than any model has: llama.cpp offloads every layer


@dataclass(frozen=True)
class Engine:
    """The engine settings both sides get, explicitly."""

    threads: int
    gpu_layers: int  # ALL_LAYERS: every layer
    flash_attn: str  # "on" or "off"

    def describe(self) -> str:
        layers = "all" if self.gpu_layers >= ALL_LAYERS else str(self.gpu_layers)
        return f"threads {self.threads}, GPU layers {layers}, flash attention {self.flash_attn} (both sides)"



def run_loop(path: str, items: list[str], tokens: int, engine: Engine) -> tuple[float, int]:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", LOOP, path, str(engine.threads), str(tokens), SYSTEM,
                          str(engine.gpu_layers), engine.flash_attn],
                         input=json.dumps(items), capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"the llama-cpp-python loop failed ({res.returncode}): {res.stderr[-2000:]}")
    return wall, json.loads(res.stdout.strip().splitlines()[-1])["tokens"]


def run_batch(model: str, items: list[str], tokens: int, parallel: int, engine: Engine, work: Path) -> tuple[float, int]:
    inp, out = work / "in.jsonl", work / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(items)))
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "localrun", "batch", model, "-i", str(inp), "-o", str(out), "--system", SYSTEM,
           "--temperature", "0", "--max-tokens", str(tokens), "--parallel", str(parallel), "--threads", str(engine.threads),
           "--gpu-layers", str(engine.gpu_layers), "--flash-attn", engine.flash_attn]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"localrun batch failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return wall, sum(r["completion_tokens"] for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--gpu-layers", type=int, default=None,
                    help="layers on the GPU for both sides (default: all when llama.cpp offloads, else 0)")
    ap.add_argument("--flash-attn", choices=("on", "off"), default="on", help="flash attention for both sides")
    args = ap.parse_args()

    import llama_cpp

    from localrun import api
    from localrun.settings import default_threads

    path = api.get_model(args.model).path
    gpu_layers = args.gpu_layers if args.gpu_layers is not None else (
        ALL_LAYERS if llama_cpp.llama_supports_gpu_offload() else 0)
    engine = Engine(args.threads or default_threads(), gpu_layers, args.flash_attn)
    items = prompts(args.prompts)
    ours: list[tuple[float, float, int]] = []  # (tokens/s, wall s, tokens) of each round
    base: list[tuple[float, float, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("LOCALRUN_HOME", str(Path(tmp) / "home"))
        sides = [
            (ours, lambda: run_batch(args.model, items, args.tokens, args.parallel, engine, Path(tmp))),
            (base, lambda: run_loop(path, items, args.tokens, engine)),
        ]
        for r in range(args.rounds):
            for results, side in sides if r % 2 == 0 else sides[::-1]:  # who goes first alternates
                w, n = side()
                results.append((n / w, w, n))
    o = statistics.median(r[0] for r in ours)
    b = statistics.median(r[0] for r in base)
    ow = statistics.median(r[1] for r in ours)
    bw = statistics.median(r[1] for r in base)
    print(f"model: {args.model} ({path}); {args.prompts} prompts x {args.tokens} tokens, greedy;"
          f" localrun --parallel {args.parallel}; {args.rounds} rounds, medians")
    print(f"engine: {engine.describe()}")
    print(f"{'measure':<48}{'localrun':>12}{'loop':>12}{'ratio':>8}{'target':>10}")
    print(f"{'generated tokens (last round)':<48}{ours[-1][2]:>12}{base[-1][2]:>12}{'':>8}{'':>10}")
    print(f"{'wall time incl. start and model load (s)':<48}{ow:>12.2f}{bw:>12.2f}{bw / ow:>8.2f}{'':>10}")
    print(f"{'aggregate tok/s (generated tokens / wall time)':<48}{o:>12.1f}{b:>12.1f}{o / b:>8.2f}{'>= 1.8':>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
