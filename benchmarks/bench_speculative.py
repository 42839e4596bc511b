"""Speculative decoding: tokens/s of the same requests with and without drafts, in one run.

    python benchmarks/bench_speculative.py [--model smollm2:135m] [--rounds 5] [--tokens 160]
        [--draft lookup] [--draft-max 8]

Tasks: (a) a rewrite whose answer repeats most of its prompt (proofreading a paragraph), (b)
prose, (c) 8 concurrent rewrite streams. Each round runs every task without and with speculation, alternating which goes first;
the table shows each side's median tokens/s and their ratio (with / without), and the drafted
and accepted tokens. Greedy decoding on both sides, same model file, same load options; replies
should be equal; a difference is reported (llama.cpp's kernels round differently for different batch
sizes, which can flip a near-tie with or without drafts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localrun import api  # noqa: E402
from localrun.generation import GenerationParams, LoadOptions  # noqa: E402

TEXT = ("The lighthouse keeper climbed the stairs at dusk, lit the lamp, and wrote the weather in his log: "
        "wind from the west, a grey sea, two ships passing north before the rain. In the morning he walked "
        "along the shore, gathered driftwood for the stove, and mended the net that the storm had torn. "
        "His daughter came on Sundays with bread and letters from the town, and they sat by the window "
        "watching the gulls until the tide turned and she rowed back across the bay.")
# a rewrite: the answer repeats most of the prompt (a proofreading pass over a text with two typos)
REWRITE = ("Fix the spelling in this text and return it in full:\n\n"
           + TEXT.replace("weather", "wether").replace("driftwood", "driftwod"))
PROSE = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def one(session: object, prompt: str, params: GenerationParams) -> tuple[str, object, float]:
    t0 = time.perf_counter()
    chunks = list(api.stream(session, api.build_messages(prompt), params))  # type: ignore[arg-type]
    return "".join(c.text for c in chunks), chunks[-1], time.perf_counter() - t0


def task(session: object, prompts: list[str], params: GenerationParams) -> tuple[list[str], float, int, int]:
    """Replies, aggregate tokens/s, drafted and accepted tokens of the prompts run concurrently."""
    results: list[tuple[str, object, float] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = one(session, prompts[i], params)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    tokens = sum(r[1].completion_tokens for r in done)  # type: ignore[attr-defined]
    drafted = sum(r[1].drafted_tokens for r in done)  # type: ignore[attr-defined]
    accepted = sum(r[1].accepted_tokens for r in done)  # type: ignore[attr-defined]
    return [r[0] for r in done], tokens / wall, drafted, accepted


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2:135m")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--draft", default="lookup")
    p.add_argument("--draft-max", type=int, default=8)
    args = p.parse_args()
    tasks = {"rewrite": [REWRITE], "prose": [PROSE], "rewrite x8": [REWRITE] * 8}
    session = api.load(args.model, LoadOptions(n_ctx=1024, n_parallel=8))
    plain = GenerationParams(temperature=0, max_tokens=args.tokens)
    spec = GenerationParams(temperature=0, max_tokens=args.tokens, speculative=args.draft, draft_max=args.draft_max)
    speeds: dict[tuple[str, str], list[float]] = {}
    counts: dict[str, tuple[int, int]] = {}
    errors = 0
    try:
        for prompt in (REWRITE, PROSE):  # warm up: both sides then find the same cached prompt prefix
            one(session, prompt, GenerationParams(temperature=0, max_tokens=1))
        for r in range(args.rounds):
            for name, prompts in tasks.items():
                order = [("without", plain), ("with", spec)]
                if r % 2:
                    order.reverse()
                replies = {}
                for side, params in order:
                    texts, tps, drafted, accepted = task(session, prompts, params)
                    speeds.setdefault((name, side), []).append(tps)
                    replies[side] = texts
                    if side == "with":
                        counts[name] = (drafted, accepted)
                if replies["with"] != replies["without"]:
                    errors += 1
                    print(f"note: {name}: the replies differ (round {r + 1})", file=sys.stderr)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        session.close()  # type: ignore[attr-defined]
    print(f"model {args.model}, {args.rounds} rounds, {args.tokens} tokens, greedy, draft {args.draft} "
          f"(max {args.draft_max}); medians")
    print(f"{'task':<12} {'without tok/s':>14} {'with tok/s':>11} {'ratio':>6} {'drafted':>8} {'accepted':>9}")
    for name in tasks:
        a = statistics.median(speeds[name, "without"])
        b = statistics.median(speeds[name, "with"])
        d, k = counts[name]
        print(f"{name:<12} {a:>14.1f} {b:>11.1f} {b / a:>6.2f} {d:>8} {k:>9}")
    print(f"replies that differed: {errors} of {args.rounds * len(tasks)} task rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
