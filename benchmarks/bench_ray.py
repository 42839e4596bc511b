"""Benchmark: `localrun batch --ray` against plain `localrun batch` on the same rows.

On one small machine scaling cannot be shown; this measures what can be:

- overhead: the Ray path with one actor (2 threads) against the local batch (2 threads), both the
  real CLI in a fresh process on the same rows and settings, (a) with the cluster started by the
  command itself (`--ray`, the cost a first try pays) and (b) on a cluster that is already
  running (`--ray ADDRESS`, the cost on a real cluster). Targets: (a) <= 1.15x, (b) <= 1.05x.
- actors: 2 actors of 1 thread each against 1 actor of 2 threads on the running cluster.

Each configuration runs once per round, in alternating order, for several rounds; the table
shows median wall times and the ratio to the local batch.

    .venv/bin/python benchmarks/bench_ray.py [--rounds 3] [--rows 64] [--tokens 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rows(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Write one sentence about the number {i}."}) + "\n"
                            for i in range(n)))


def _run(args: list[str], work: Path, tag: str) -> float:
    out = work / f"{tag}.jsonl"
    out.unlink(missing_ok=True)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "localrun", "batch", *args, "-o", str(out)], capture_output=True,
                          text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{tag} failed:\n{done.stderr[-2000:]}")
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--model", default="smollm2:135m")
    args = ap.parse_args()
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    rows = work / "in.jsonl"
    _rows(rows, args.rows)
    common = [args.model, "-i", str(rows), "--temperature", "0", "-n", str(args.tokens), "-p", "16", "--ctx", "512"]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "node_ip_address": "127.0.0.1",
                                                             "include_dashboard": False})
    try:
        configs = {
            "local batch, 2 threads (baseline)": common + ["--threads", "2"],
            "--ray (starts a local cluster), 1 actor x 2 threads": common + ["--ray", "--ray-actors", "1",
                                                                            "--ray-cpus-per-actor", "2"],
            "--ray ADDRESS (running cluster), 1 actor x 2 threads": common + ["--ray", cluster.address,
                                                                             "--ray-actors", "1",
                                                                             "--ray-cpus-per-actor", "2"],
            "--ray ADDRESS, 2 actors x 1 thread": common + ["--ray", cluster.address, "--ray-actors", "2",
                                                           "--ray-cpus-per-actor", "1"],
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        _run(configs["local batch, 2 threads (baseline)"], work, "warmup")
        for r in range(args.rounds):
            order = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in order:
                times[name].append(_run(configs[name], work, f"c{list(configs).index(name)}"))
                print(f"round {r + 1}: {name}: {times[name][-1]:.1f}s", file=sys.stderr, flush=True)
    finally:
        cluster.shutdown()
    base = statistics.median(times["local batch, 2 threads (baseline)"])
    print(f"\n## batch --ray: {args.rows} rows x {args.tokens} tokens, {args.model}, greedy "
          f"({args.rounds} rounds, median wall time of the whole command)\n")
    print("| configuration | wall s | x local |")
    print("|---|---|---|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
