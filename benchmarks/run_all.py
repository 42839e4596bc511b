"""Run every benchmark in this folder, one after another (each prints its own table)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = ["bench_run.py", "bench_batch.py", "bench_ray.py", "bench_convert.py", "bench_pull.py", "bench_mlx.py",
           "bench_tui.py", "bench_serve.py", "bench_agents.py", "bench_structured.py", "bench_thinking.py",
           "bench_speculative.py", "bench_speculative_mlx.py", "bench_vision.py", "bench_workbench.py",
           "fit_vs_llama.py", "bench_lora.py", "rerank_agreement.py", "bench_tool_loop.py"]
# bench_workbench.py runs workbench_speed, workbench_eval and workbench_imatrix; llama_tools.py builds
# the llama.cpp tools the others compare with.


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for name in BENCHES:
        path = here / name
        if not path.exists():
            continue
        print(f"\n== {name}", flush=True)
        if subprocess.run([sys.executable, str(path)]).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
