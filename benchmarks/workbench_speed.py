"""`localrun bench` against llama.cpp's own llama-bench, on the same file with the same settings
(pp512 and tg128 by default, the same threads, -r 5), built from the llama.cpp that
llama-cpp-python vendors (benchmarks/llama_tools.py builds it once). The two alternate for several
rounds (which goes first alternates too) and each round gives a ratio: machines are noisy.

    python benchmarks/workbench_speed.py [--model NAME|PATH] [--threads N] [--rounds 3] [-p 512] [-n 128] [-r 5]
                                         [--same-libs]

Target: localrun / llama-bench >= 0.97 for pp and for tg (median of the rounds' ratios). The
ratio of the fastest samples is printed too: on a shared machine it is the one least bent by
other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tools import tool_binary  # noqa: E402


def _speeds(records: list[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """(avg_ts, fastest sample's t/s) by test name (pp512, tg128) from llama-bench-style JSON records."""
    out = {}
    for r in records:
        p, g = r["n_prompt"], r["n_gen"]
        name = f"pp{p}" if not g else f"tg{g}" if not p else f"pp{p}+tg{g}"
        out[name] = (float(r["avg_ts"]), max(float(x) for x in r["samples_ts"]))
    return out


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise SystemExit(f"{what} failed ({res.returncode}): {res.stderr[-2000:]}")
    return list(json.loads(res.stdout))


def run_localrun(model_path: str, threads: int, n_prompt: int, n_gen: int, reps: int,
                 same_libs: bool = False) -> dict[str, tuple[float, float]]:
    """`localrun bench ... --json`, in its own process as a user runs it. same_libs: on llama-bench's
    own build of libllama/ggml (LLAMA_CPP_LIB_PATH) instead of the wheel's, so that only the
    procedure differs."""
    cmd = [sys.executable, "-m", "localrun", "bench", model_path, "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(reps), "-t", str(threads), "--json"]
    env = {"LLAMA_CPP_LIB_PATH": str(tool_binary("llama-bench").parent)} if same_libs else None
    return _speeds(_run(cmd, "localrun bench", env))


def run_llama_bench(model_path: str, threads: int, n_prompt: int, n_gen: int, reps: int) -> dict[str, tuple[float, float]]:
    """llama.cpp's llama-bench with the same settings (-o json)."""
    cmd = [str(tool_binary("llama-bench")), "-m", model_path, "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(reps), "-t", str(threads), "-o", "json"]
    return _speeds(_run(cmd, "llama-bench"))


def compare(model_path: str, threads: int, rounds: int, n_prompt: int = 512, n_gen: int = 128,
            reps: int = 5, same_libs: bool = False) -> dict[str, Any]:
    """Alternate both tools for `rounds` rounds. Per test: each side's median t/s, the median of the
    rounds' ratios, and the ratio of the fastest samples (the least disturbed by other load)."""
    ours: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    best: dict[str, list[float]] = {}  # [localrun, llama-bench]
    for i in range(rounds):
        def ours_once() -> dict[str, tuple[float, float]]:
            return run_localrun(model_path, threads, n_prompt, n_gen, reps, same_libs)

        def theirs_once() -> dict[str, tuple[float, float]]:
            return run_llama_bench(model_path, threads, n_prompt, n_gen, reps)

        order = [("localrun", ours_once), ("llama-bench", theirs_once)]
        got = {name: fn() for name, fn in (order if i % 2 == 0 else order[::-1])}
        for test, (t, t_best) in got["llama-bench"].items():
            o, o_best = got["localrun"][test]
            ours.setdefault(test, []).append(o)
            theirs.setdefault(test, []).append(t)
            ratios.setdefault(test, []).append(o / t)
            b = best.setdefault(test, [0.0, 0.0])
            b[0], b[1] = max(b[0], o_best), max(b[1], t_best)
            print(f"round {i + 1}/{rounds} {test}: localrun {o:.2f} t/s, llama-bench {t:.2f} t/s, ratio {o / t:.3f}",
                  file=sys.stderr, flush=True)
    return {test: {"localrun": statistics.median(ours[test]), "llama_bench": statistics.median(theirs[test]),
                   "ratio": statistics.median(ratios[test]), "ratios": ratios[test],
                   "best_localrun": best[test][0], "best_llama_bench": best[test][1],
                   "best_ratio": best[test][0] / best[test][1]} for test in ratios}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name or path (default: the starter model)")
    ap.add_argument("--threads", type=int, default=None, help="default: llama-bench's (physical cores)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--same-libs", action="store_true",
                    help="run localrun on llama-bench's build of libllama/ggml (only the procedure differs)")
    args = ap.parse_args()

    from localrun import api
    from localrun.store import starter_model_path
    from localrun.workbench.bench import physical_cores

    path = api.get_model(args.model).path if args.model else str(starter_model_path())
    threads = args.threads or physical_cores()
    result = compare(path, threads, args.rounds, args.p, args.n, args.r, args.same_libs)
    libs = "llama-bench's libllama/ggml for both" if args.same_libs else "localrun on the wheel's libllama/ggml"
    print(f"model: {path}; threads {threads}; -r {args.r}; {args.rounds} rounds, alternating; {libs}")
    print(f"{'test':<8}{'localrun t/s':>14}{'llama-bench t/s':>17}{'ratio':>8}{'target':>9}"
          f"{'best localrun':>15}{'best llama-bench':>18}{'ratio':>8}  each round's ratio")
    for test, r in result.items():
        each = " ".join(f"{x:.3f}" for x in r["ratios"])
        print(f"{test:<8}{r['localrun']:>14.2f}{r['llama_bench']:>17.2f}{r['ratio']:>8.3f}{'>= 0.97':>9}"
              f"{r['best_localrun']:>15.2f}{r['best_llama_bench']:>18.2f}{r['best_ratio']:>8.3f}  {each}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
