"""The tool loop's own cost per call: from a call parsed to its result ready to feed back, apart
from the tool's time (ToolUse.overhead_ms: the schema check, the approval check, the record), and
the time of the call itself through localrun's ToolServers (the SDK's client on its own thread)
against the same call made directly with the SDK's client in one asyncio loop (the floor).

Rounds alternate the two ways, 200 calls each of the test server's `add` tool (tests/mcp_test_server.py,
stdio); the medians and 95th percentiles are printed.

    .venv/bin/python benchmarks/bench_tool_loop.py [--calls 200] [--rounds 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVER = [sys.executable, str(ROOT / "tests" / "mcp_test_server.py"), "stdio"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def direct(n: int) -> list[float]:
    """The SDK's own client: n calls in its asyncio loop (ms each)."""
    from mcp import Client, StdioServerParameters

    out = []
    async with Client(StdioServerParameters(command=SERVER[0], args=SERVER[1:])) as client:
        await client.call_tool("add", {"a": 1, "b": 1})
        for i in range(n):
            t0 = time.perf_counter()
            await client.call_tool("add", {"a": i, "b": 1})
            out.append((time.perf_counter() - t0) * 1000)
    return out


def through_loop(n: int) -> tuple[list[float], list[float]]:
    """localrun's loop: each call parsed -> checked -> allowed -> run -> its result (ms each), and
    the loop's own part of that (overhead_ms)."""
    from localrun.tool_loop import Approvals, ToolLoop
    from localrun.tool_servers import ServerSpec, ToolServers
    from localrun.tools import ToolCall

    calls, overhead = [], []
    with ToolServers({"t": ServerSpec("t", SERVER[0], tuple(SERVER[1:]))}) as servers:
        loop = ToolLoop(servers, Approvals(["all"]), servers.tools())
        loop.use(ToolCall("warm", "add", {"a": 1, "b": 1}))
        for i in range(n):
            t0 = time.perf_counter()
            use = loop.use(ToolCall(f"c{i}", "add", {"a": i, "b": 1}))
            calls.append((time.perf_counter() - t0) * 1000)
            overhead.append(use.overhead_ms)
            assert use.result == str(i + 1)
    return calls, overhead


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    sdk: list[float] = []
    ours: list[float] = []
    own: list[float] = []
    for r in range(args.rounds):
        order = ["sdk", "loop"] if r % 2 == 0 else ["loop", "sdk"]
        for way in order:
            if way == "sdk":
                sdk += asyncio.run(direct(args.calls))
            else:
                c, o = through_loop(args.calls)
                ours += c
                own += o
    report = {
        "calls": args.calls * args.rounds,
        "sdk_call_ms": {"median": statistics.median(sdk), "p95": pct(sdk, 0.95)},
        "localrun_call_ms": {"median": statistics.median(ours), "p95": pct(ours, 0.95)},
        "loop_overhead_ms": {"median": statistics.median(own), "p95": pct(own, 0.95)},
    }
    print(f"{'per call (ms)':<44} {'median':>8} {'p95':>8}")
    print(f"{'SDK client alone (the floor)':<44} {report['sdk_call_ms']['median']:>8.3f} {report['sdk_call_ms']['p95']:>8.3f}")
    print(f"{'localrun loop: parsed -> result':<44} {report['localrun_call_ms']['median']:>8.3f} "
          f"{report['localrun_call_ms']['p95']:>8.3f}")
    print(f"{'  of which the loop itself (overhead_ms)':<44} {report['loop_overhead_ms']['median']:>8.3f} "
          f"{report['loop_overhead_ms']['p95']:>8.3f}")
    print(f"ratio localrun / SDK (medians): {report['localrun_call_ms']['median'] / report['sdk_call_ms']['median']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
