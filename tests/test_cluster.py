"""`localrun batch --ray` on a real Ray cluster started by the tests on this machine: a head and a
worker node bound to 127.0.0.1, one CPU each, so two actors land on two nodes.

The batch runs as the real CLI in a child process (the Ray driver). Waits are on what the CLI
declares (its "actor N ready (pid P ...)" lines, rows in the output file), never on time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import reliability

ROWS = 64


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A head node and a worker node; the worker's Hugging Face cache is empty and offline."""
    from ray.cluster_utils import Cluster

    root = tmp_path_factory.mktemp("ray")
    head_cache, worker_cache = root / "hf-head", root / "hf-worker"
    head_cache.mkdir()
    worker_cache.mkdir()
    common = {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "OMP_WAIT_POLICY": "PASSIVE"}
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False,
        "env_vars": {**common, "HF_HUB_CACHE": str(head_cache)}})
    c.add_node(num_cpus=1, node_ip_address="127.0.0.1", env_vars={**common, "HF_HUB_CACHE": str(worker_cache)})
    try:
        yield {"address": c.address, "head_cache": head_cache}
    finally:
        c.shutdown()


def _rows(path: Path, n: int = ROWS) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Write a word about the number {i}."}) + "\n"
                            for i in range(n)))
    return path


def _batch_args(model: str, rows: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "localrun", "batch", model, "-i", str(rows), "-o", str(out),
            "--temperature", "0", "-p", "4", *extra]


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _texts(out: Path) -> dict[str, str]:
    recs = _records(out)
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), "an id was written twice"
    return {r["id"]: r["text"] for r in recs}


def test_ray_batch_equals_the_local_batch_row_for_row(cluster: dict[str, Any], starter: Path, tmp_path: Path) -> None:
    rows = _rows(tmp_path / "in.jsonl")
    local = subprocess.run(_batch_args("smollm2:135m", rows, tmp_path / "local.jsonl", "-n", "8"),
                           capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr
    ray_run = subprocess.run(_batch_args("smollm2:135m", rows, tmp_path / "ray.jsonl", "-n", "8",
                                         "--ray", cluster["address"], "--ray-actors", "2"),
                             capture_output=True, text=True, timeout=600)
    assert ray_run.returncode == 0, ray_run.stderr
    expected = _texts(tmp_path / "local.jsonl")
    assert len(expected) == ROWS and _texts(tmp_path / "ray.jsonl") == expected
    per_actor = [line for line in ray_run.stderr.splitlines() if "rows," in line and "actor " in line]
    assert len(per_actor) == 2 and all(" 0 rows" not in line for line in per_actor), ray_run.stderr


class _Driver:
    """A `localrun batch --ray` child process whose stderr lines are read as they come."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.lines: list[str] = []

    def wait_line(self, needle: str) -> str:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"the driver ended without printing {needle!r}: {''.join(self.lines)}")

    def wait_rows(self, out: Path, n: int) -> None:
        """Until the output holds n rows: the driver prints a progress line after each row it writes."""
        while not (out.exists() and len([ln for ln in out.read_text().splitlines() if ln.endswith("}")]) >= n):
            self.wait_line("rows,")

    def finish(self) -> tuple[int, str]:
        assert self.proc.stderr is not None
        rest = self.proc.stderr.read()
        return self.proc.wait(timeout=600), "".join(self.lines) + rest


def test_an_actor_killed_mid_block_loses_no_row(cluster: dict[str, Any], starter: Path, tmp_path: Path) -> None:
    rows, out = _rows(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    driver = _Driver(_batch_args("smollm2:135m", rows, out, "-n", "12", "--ray", cluster["address"],
                                 "--ray-actors", "2"))
    line = driver.wait_line("actor 1 ready (pid ")
    pid = int(line.split("(pid ")[1].split()[0])
    driver.wait_rows(out, 2)  # both actors hold blocks now; some rows are done
    os.kill(pid, signal.SIGKILL)
    code, err = driver.finish()
    assert code == 0, err
    assert "actor 1" in err and "died" in err
    texts = _texts(out)
    assert sorted(texts) == sorted(f"r{i}" for i in range(ROWS)) and all(texts.values())
    reliability.fault("SIGKILL", "a Ray actor")


def test_a_killed_driver_resumes_with_every_id_once(cluster: dict[str, Any], starter: Path, tmp_path: Path) -> None:
    rows, out = _rows(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    args = _batch_args("smollm2:135m", rows, out, "-n", "12", "--ray", cluster["address"], "--ray-actors", "2")
    driver = _Driver(args)
    driver.wait_rows(out, 5)
    driver.proc.kill()
    driver.proc.wait(timeout=60)
    before = _records(out)
    written = len(before)
    assert 5 <= written < ROWS
    again = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert f"{written} already done" in again.stderr
    assert sorted(_texts(out)) == sorted(f"r{i}" for i in range(ROWS))
    reliability.fault("SIGKILL", "a Ray batch driver")
    after = _records(out)
    reliability.rows(ROWS, sum(1 for r in before if r not in after))


def test_an_actor_that_cannot_get_the_model_leaves_its_rows_to_the_other(cluster: dict[str, Any], starter: Path,
                                                                         tmp_path: Path) -> None:
    # The model is in the head node's Hugging Face cache only; the worker node is offline.
    snap = cluster["head_cache"] / "models--test--tiny-chat" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True, exist_ok=True)
    if not (snap / "tiny-chat-Q4_1.gguf").exists():
        shutil.copyfile(starter, snap / "tiny-chat-Q4_1.gguf")  # a copy: the store shows one model per file
    (cluster["head_cache"] / "models--test--tiny-chat" / "refs").mkdir(exist_ok=True)
    (cluster["head_cache"] / "models--test--tiny-chat" / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_CACHE": str(cluster["head_cache"])}
    rows, out = _rows(tmp_path / "in.jsonl", 8), tmp_path / "out.jsonl"
    done = subprocess.run(_batch_args("tiny-chat:q4_1", rows, out, "-n", "4", "--ray", cluster["address"],
                                      "--ray-actors", "2"), capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    assert "cannot get test/tiny-chat/tiny-chat-Q4_1.gguf" in done.stderr, done.stderr
    assert sorted(_texts(out)) == sorted(f"r{i}" for i in range(8))


def test_ray_missing_gives_the_install_hint(tmp_path: Path) -> None:
    rows = _rows(tmp_path / "in.jsonl", 2)
    code = ("import sys; sys.modules['ray'] = None; from localrun.cli import main; "
            f"sys.exit(main(['batch', 'smollm2:135m', '-i', {str(rows)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}, '--ray']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--ray needs Ray" in done.stderr and "pip install 'localrun[ray]'" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o.jsonl").exists()
