"""`localrun pull` against huggingface_hub's `hf download`: the same 500 MB file, same local Hub.

Both clients run as fresh processes with empty caches, alternating, several rounds; the table
shows each run's throughput and the ratio of medians (target: localrun >= 0.95x hf download).
localrun's time includes its sha256 verification and its remote-header fit estimate.

    .venv/bin/python benchmarks/bench_pull.py [--size-mb 500] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.hub.server import HubServer  # noqa: E402

STORIES = ROOT.parent / "shared" / "assets" / "models" / "stories260K.gguf"
REPO = "bench/Big-GGUF"
FILE = "big-Q4_K_M.gguf"


def make_file(path: Path, size_mb: int) -> None:
    """A valid GGUF header (stories260K) followed by random bytes up to the size."""
    with open(path, "wb") as f:
        f.write(STORIES.read_bytes())
        left = size_mb * 1_000_000 - f.tell()
        while left > 0:
            block = os.urandom(min(left, 16 << 20))
            f.write(block)
            left -= len(block)


def run(cmd: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    bin_dir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp_s, HubServer() as hub:
        tmp = Path(tmp_s)
        big = tmp / FILE
        make_file(big, args.size_mb)
        size = big.stat().st_size
        hub.add_repo(REPO, {FILE: big}, tags=["gguf"])
        base = {**os.environ, **hub.env()}
        base.pop("HF_TOKEN", None)
        clients = {
            "localrun pull": [str(bin_dir / "localrun"), "pull", f"{REPO}:Q4_K_M"],
            "hf download": [str(bin_dir / "hf"), "download", REPO, FILE],
        }
        times: dict[str, list[float]] = {name: [] for name in clients}
        for i in range(args.rounds):
            order = list(clients) if i % 2 == 0 else list(reversed(clients))
            for name in order:
                cache = tmp / f"cache-{name.split()[0]}-{i}"
                env = {**base, "HF_HUB_CACHE": str(cache / "hf"), "LOCALRUN_HOME": str(cache / "home"),
                       "HF_HOME": str(cache / "hf-home")}
                times[name].append(run(clients[name], env))
                shutil.rmtree(cache, ignore_errors=True)
        print(f"{size / 1e6:.0f} MB file from a local Hub ({hub.url}), {args.rounds} rounds, fresh caches\n")
        print(f"{'client':<16}{'median s':>10}{'best s':>9}{'MB/s (median)':>15}")
        speeds = {}
        for name, ts in times.items():
            med = statistics.median(ts)
            speeds[name] = size / med / 1e6
            print(f"{name:<16}{med:>10.2f}{min(ts):>9.2f}{speeds[name]:>15.0f}")
        ratio = speeds["localrun pull"] / speeds["hf download"]
        print(f"\nthroughput ratio localrun / hf download: {ratio:.2f}x (target >= 0.95x)"
              f" {'OK' if ratio >= 0.95 else 'BELOW TARGET'}")


if __name__ == "__main__":
    main()
