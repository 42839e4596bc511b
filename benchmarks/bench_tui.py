"""TUI benchmark: streaming speed into the chat screen vs the backend alone, and launch time.

    .venv/bin/python benchmarks/bench_tui.py [--tokens 256] [--rounds 3]

1. Streaming: the same greedy prompt through `api.stream` (the backend's raw stream, engine in
   its worker process) and through the headless app's chat screen (worker thread -> messages ->
   MarkdownStream -> rendered). Speed is (tokens - 1) / (time of the last piece - time of the first
   piece), measured where each consumer sees the text; for the chat screen that is after the
   Markdown widget has rendered it. Target: chat >= 0.95x raw.
2. Launch: from spawning `python -c "...LocalrunApp..."` to the Library table filled and focused
   (headless, so without the terminal's own start-up). Target: <= 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a very long story about a dragon who learns to bake bread."
MODEL = "smollm2:135m"


def raw_speed(params: Any, options: Any) -> tuple[float, int, float]:
    """(tokens/s seen by the consumer, tokens, engine-reported tokens/s) of the backend alone."""
    from localrun import api

    session = api.load(MODEL, options)
    try:
        request = api.build_messages(PROMPT)
        first = last = 0.0
        pieces = 0
        done: Any = None
        for chunk in api.stream(session, request, params):
            now = time.perf_counter()
            if chunk.done:
                done = chunk
                break
            if chunk.text:
                first = first or now
                last = now
                pieces += 1
        n = done.completion_tokens
        return (n - 1) / (last - first), n, done.tokens_per_second
    finally:
        session.close()


def chat_speed(params: Any, options: Any) -> tuple[float, int, int]:
    """(tokens/s rendered into the chat screen, tokens, UI updates) for the same prompt."""
    from tui.app import LocalrunApp
    from tui.screens.chat import ChatScreen

    marks: dict[str, float] = {}
    original_text, original_done = ChatScreen.on_reply_text, ChatScreen.on_reply_done

    async def on_text(self: ChatScreen, message: Any) -> None:
        await original_text(self, message)
        marks.setdefault("first", time.perf_counter())

    async def on_done(self: ChatScreen, message: Any) -> None:
        await original_done(self, message)  # stops the MarkdownStream: everything is rendered
        marks["last"] = time.perf_counter()
        marks["tokens"] = message.stats["completion_tokens"]
        finished.set()

    ChatScreen.on_reply_text, ChatScreen.on_reply_done = on_text, on_done  # type: ignore[method-assign]
    app = LocalrunApp(settings={"temperature": params.temperature, "seed": params.seed,
                                "max_tokens": params.max_tokens}, load_options=options)

    finished = asyncio.Event()

    async def run() -> int:
        async with app.run_test(size=(100, 30)):
            await app.open_chat(MODEL)
            chat = app.mode_screens["chat"]
            assert isinstance(chat, ChatScreen)
            app.models.session(MODEL)  # load before timing, as the raw run does outside its timing
            await chat.send(PROMPT)
            await finished.wait()  # no polling: the app runs as it would for a person
            return chat.stream_updates

    try:
        updates = asyncio.run(run())
    finally:
        app.models.close()
        ChatScreen.on_reply_text, ChatScreen.on_reply_done = original_text, original_done  # type: ignore[method-assign]
    n = int(marks["tokens"])
    return (n - 1) / (marks["last"] - marks["first"]), n, updates


LAUNCH = """
import asyncio, sys
from tui.app import LocalrunApp
async def main():
    app = LocalrunApp()
    async with app.run_test(size=(80, 24)) as pilot:
        lib = app.mode_screens["library"]
        while not lib.loaded:
            await pilot.pause(0.005)
        print("READY", flush=True)
        app.exit()
asyncio.run(main())
"""


def launch_time() -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = time.perf_counter() - start
    proc.wait(timeout=60)
    if line.strip() != "READY":
        raise RuntimeError("the app did not reach the library screen")
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("LOCALRUN_HOME", tempfile.mkdtemp(prefix="bench-tui-"))
    from localrun.settings import GenerationParams, LoadOptions

    params = GenerationParams(temperature=0, seed=1, max_tokens=args.tokens)
    options = LoadOptions(n_ctx=2048)
    raw_speed(params, options)  # warm the page cache and the engine's first load
    raws, chats, engine_reported, updates = [], [], [], []
    for _ in range(args.rounds):  # interleaved, so machine noise hits both alike
        r, n_raw, reported = raw_speed(params, options)
        c, n_chat, u = chat_speed(params, options)
        if n_raw != n_chat:
            print(f"warning: {n_raw} raw tokens vs {n_chat} in the chat", file=sys.stderr)
        raws.append(r)
        chats.append(c)
        engine_reported.append(reported)
        updates.append(u)
    launches = [launch_time() for _ in range(max(args.rounds, 3))]
    raw, chat, launch = statistics.median(raws), statistics.median(chats), statistics.median(launches)
    ratio = statistics.median(c / r for c, r in zip(chats, raws, strict=True))
    rows = [
        ("backend raw stream (tok/s)", f"{raw:.1f}", "baseline", f"engine-reported {statistics.median(engine_reported):.1f}"),
        ("chat screen, rendered (tok/s)", f"{chat:.1f}", ">= 0.95x raw",
         f"{ratio:.2f}x raw (median of per-round ratios), {statistics.median(updates):.0f} UI updates"),
        ("launch to interactive library (s)", f"{launch:.2f}", "<= 1.00", f"min {min(launches):.2f}, max {max(launches):.2f}"),
    ]
    print(f"TUI benchmark: {MODEL}, greedy, {args.tokens} tokens, {args.rounds} rounds, {os.cpu_count()} CPUs")
    widths = [max(len(r[i]) for r in rows + [("measure", "value", "target", "notes")]) for i in range(4)]
    for row in [("measure", "value", "target", "notes"), *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
