"""The quantization workbench against llama.cpp's own tools, built from the same vendored llama.cpp
(benchmarks/llama_tools.py builds and caches them):

1. `localrun bench` against `llama-bench` (pp512, tg128, same threads): target ratio >= 0.97 on both
   (benchmarks/workbench_speed.py).
2. `localrun eval` against `llama-perplexity --kl-divergence` on the same files and text: wall time
   <= 1.1x, KLD within 2% relative, perplexity within 0.5% (benchmarks/workbench_eval.py).
3. `localrun imatrix` against `llama-imatrix`: per-tensor cosine similarity >= 0.99, wall time
   (benchmarks/workbench_imatrix.py).
4. A ladder of 4 rungs: `localrun quantize F16 --ladder ...` against the same steps by hand with
   the tools (llama-imatrix once, llama-quantize per rung, llama-perplexity --kl-divergence-base
   once and --kl-divergence per rung, llama-bench per rung), same settings, total wall time.
   `--source tinyllama` builds a random-weight TinyLlama-shaped 1.1B checkpoint (torch needed) and
   converts it to F16 once, outside the timing; `--source starter` (default, quicker) uses an F16
   copy of the starter model.

    python benchmarks/bench_workbench.py [--only speed,eval,imatrix,ladder] [--source starter|tinyllama]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TYPES = ["q8_0", "q6_k", "q4_k_m", "iq4_xs"]


def _timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({res.returncode}): {res.stderr[-2000:]}")
    return time.perf_counter() - t


def source_f16(kind: str, work: Path) -> Path:
    """The 16-bit GGUF both sides start from."""
    if kind == "starter":
        sys.path.insert(0, str(ROOT))
        from localrun.store import starter_model_path
        from tests.ggufs import dequantize_to_f16

        src = starter_model_path()
        assert src is not None, "the starter model is not installed"
        return dequantize_to_f16(src, work / "starter-F16.gguf")
    sys.path.insert(0, str(HERE))
    from bench_convert import make_model

    hf = work / "tinyllama-random"
    hf.mkdir()
    make_model(hf)
    out = work / "tinyllama-F16.gguf"
    subprocess.run([sys.executable, "-m", "localrun", "convert", str(hf), "--outtype", "f16", "-o", str(out),
                    "--no-register"], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(hf)
    return out


def by_hand(f16: Path, cal: Path, text: Path, work: Path, ctx: int, chunks: int, bench: tuple[int, int, int],
            threads: int) -> float:
    """The ladder's steps with llama.cpp's tools, one after another; total seconds."""
    sys.path.insert(0, str(HERE))
    from llama_tools import tool_binary

    imatrix, quantize = tool_binary("llama-imatrix"), tool_binary("llama-quantize")
    perplexity, llama_bench = tool_binary("llama-perplexity"), tool_binary("llama-bench")
    t = str(threads)
    total = _timed([str(imatrix), "-m", str(f16), "-f", str(cal), "-o", str(work / "hand.imatrix.gguf"), "-c", "512",
                    "-t", t])
    base = work / "hand.kld"
    total += _timed([str(perplexity), "-m", str(f16), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
                     "-t", t, "--kl-divergence-base", str(base)])
    for q in TYPES:
        out = work / f"hand-{q}.gguf"
        total += _timed([str(quantize), "--imatrix", str(work / "hand.imatrix.gguf"), str(f16), str(out), q.upper(), t])
        total += _timed([str(perplexity), "-m", str(out), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
                         "-t", t, "--kl-divergence-base", str(base), "--kl-divergence"])
        total += _timed([str(llama_bench), "-m", str(out), "-p", str(bench[0]), "-n", str(bench[1]), "-r",
                         str(bench[2]), "-t", t])
    return total


def with_localrun(f16: Path, cal: Path, text: Path, work: Path, ctx: int, chunks: int, bench: tuple[int, int, int],
                  threads: int) -> float:
    out = work / "ladder"
    shutil.rmtree(out, ignore_errors=True)
    return _timed([sys.executable, "-m", "localrun", "quantize", str(f16), "--ladder", ",".join(TYPES), "-o", str(out),
                   "--calibration", str(cal), "--text", str(text), "--ctx", str(ctx), "--chunks", str(chunks),
                   "--bench", ",".join(map(str, bench)), "--threads", str(threads), "--name", "bench-ladder"])


def ladder(kind: str, rounds: int, threads: int) -> None:
    sys.path.insert(0, str(ROOT))
    from localrun.workbench.texts import default_calibration, default_text

    with tempfile.TemporaryDirectory(prefix="bench-ladder-") as d:
        work = Path(d)
        f16 = source_f16(kind, work)
        cal, text = work / "calibration.txt", work / "eval.txt"
        cal.write_text(default_calibration(40_000)[0], encoding="utf-8")
        text.write_text(default_text()[0], encoding="utf-8")
        ctx, chunks, bench = 512, 8, (512, 128, 3)
        ours, theirs = [], []
        for r in range(rounds):
            order = [("localrun", with_localrun), ("by hand", by_hand)]
            for label, fn in order if r % 2 == 0 else order[::-1]:
                (ours if label == "localrun" else theirs).append(fn(f16, cal, text, work, ctx, chunks, bench, threads))
            print(f"round {r + 1}: localrun {ours[-1]:.1f} s, by hand {theirs[-1]:.1f} s", file=sys.stderr)
        import statistics

        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"\nladder of {len(TYPES)} rungs ({', '.join(TYPES)}) on {f16.name}, {threads} threads, "
              f"median of {rounds} rounds")
        print("| run | wall s |\n|---|---:|")
        print(f"| localrun quantize --ladder (imatrix, quantize, eval, bench, register, report) | {a:.1f} |")
        print(f"| llama.cpp tools by hand (imatrix, quantize, perplexity, bench) | {b:.1f} |")
        print(f"\nlocalrun / by hand: {a / b:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="speed,eval,imatrix,ladder")
    ap.add_argument("--source", choices=("starter", "tinyllama"), default="starter")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    parts = set(a.only.split(","))
    for name in ("speed", "eval", "imatrix"):
        if name in parts:
            print(f"\n== {name}", flush=True)
            subprocess.run([sys.executable, str(HERE / f"workbench_{name}.py")], check=True)
    if "ladder" in parts:
        print("\n== ladder", flush=True)
        ladder(a.source, a.rounds, a.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
