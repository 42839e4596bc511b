"""What the reasoning splitter costs: the same tiny random Qwen3 (the real Qwen3 tokenizer, seed 0
weights, built as tests/thinking_models.py builds it) converted twice, once with DeepSeek-R1's
chat template (a thinking model: every reply goes through the splitter) and once with Qwen2.5's
(no reasoning format: no splitter), run on the same raw prompt, which ends in `<think>\\n`, so the
thinking side's reply is all thought and every token passes through the splitter (the worst case).

    python benchmarks/bench_thinking.py [--rounds 7] [--prompt-words 200] [--tokens 128] [--threads 2]
        [--json FILE]

Both sessions are loaded once (engine processes of their own); each round runs one request on
each, the order reversing every other round, with the same prompt and sampling seed on both (so
both decode the same tokens; checked), the prompt new each round so no prefix is reused. The tiny
model decodes thousands of tokens a second, so the splitter's share of the time is as large here
as it can be on any model.

Measures, the median over rounds: prompt processing tok/s (prompt tokens / prompt time) and decode
tok/s (generated tokens / decode time), and the median of per-round ratios splitter on / off.
Target: both ratios within noise of 1.0 (>= 0.97).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = ("the sky is blue because air scatters short waves of sunlight more than long ones and so "
         "we see blue from every part of it while the sun itself looks yellow at noon and red at dusk").split()


def build(folder: Path) -> dict[str, Path]:
    """The two GGUFs: same weights, a thinking template and one without a reasoning format."""
    from tests.thinking_models import ASSETS, R1_TEMPLATE, make_thinker

    plain = ASSETS / "chat-templates" / "Qwen-Qwen2.5-7B-Instruct.jinja"
    return {"splitter on": make_thinker(folder, template=R1_TEMPLATE), "splitter off": make_thinker(folder, template=plain)}


def one(session: Any, prompt: str, tokens: int, seed: int) -> dict[str, Any]:
    """One raw request; its speeds and what it produced."""
    from localrun import api
    from localrun.generation import Request
    from localrun.settings import GenerationParams

    params = GenerationParams(max_tokens=tokens, temperature=1.0, seed=seed)
    text, thought, last = [], [], None
    for chunk in api.stream(session, Request.raw(prompt), params):
        if chunk.done:
            last = chunk
            break
        text.append(chunk.text)
        thought.append(chunk.thinking)
    assert last is not None
    return {"pp_tok_s": last.prompt_tokens / (last.prompt_ms / 1000), "decode_tok_s": last.completion_tokens / (last.decode_ms / 1000),
            "prompt_tokens": last.prompt_tokens, "completion_tokens": last.completion_tokens,
            "thinking_tokens": last.thinking_tokens, "output": "".join(thought) + "".join(text)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()

    from localrun import api
    from localrun.settings import LoadOptions

    with tempfile.TemporaryDirectory() as tmp:
        files = build(Path(tmp))
        options = LoadOptions(n_ctx=args.prompt_words * 2 + args.tokens + 64, n_threads=args.threads)
        sessions = {side: api.load(api.resolve_target(str(path)).model, options) for side, path in files.items()}
        try:
            rounds: list[dict[str, dict[str, Any]]] = []
            for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
                words = [WORDS[(r * 7 + i) % len(WORDS)] for i in range(args.prompt_words)]
                prompt = f"Round {r}. Q: {' '.join(words)}?\nA: <think>\n"
                order = list(sessions) if r % 2 == 0 else list(reversed(sessions))
                got = {side: one(sessions[side], prompt, args.tokens, seed=1000 + r) for side in order}
                on, off = got["splitter on"], got["splitter off"]
                assert on["thinking_tokens"] == on["completion_tokens"] and off["thinking_tokens"] == 0, got
                assert on["output"].strip() == off["output"].strip(), "the two sides decoded different tokens"
                if r:
                    rounds.append(got)
        finally:
            for s in sessions.values():
                s.close()

    table: dict[str, Any] = {}
    print(f"{'side':<14}{'pp tok/s':>12}{'decode tok/s':>15}")
    for side in ("splitter on", "splitter off"):
        pp = statistics.median(g[side]["pp_tok_s"] for g in rounds)
        dec = statistics.median(g[side]["decode_tok_s"] for g in rounds)
        table[side] = {"pp_tok_s": pp, "decode_tok_s": dec}
        print(f"{side:<14}{pp:>12.1f}{dec:>15.1f}")
    ratios = {m: statistics.median(g["splitter on"][m] / g["splitter off"][m] for g in rounds)
              for m in ("pp_tok_s", "decode_tok_s")}
    p0, c0 = rounds[0]["splitter on"]["prompt_tokens"], rounds[0]["splitter on"]["completion_tokens"]
    print(f"on / off (median of {len(rounds)} rounds, {p0} prompt + {c0} generated tokens): "
          f"prompt processing {ratios['pp_tok_s']:.3f}, decode {ratios['decode_tok_s']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"sides": table, "ratios": ratios, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
