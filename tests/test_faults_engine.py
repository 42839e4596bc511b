"""The engine worker killed with SIGKILL in the middle of `run` and `batch` (the TUI's and the
server's own tests do the same for them): one clear error where the user is, no finished work
lost, and the next command works."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from . import reliability


def _children(pid: int) -> list[int]:
    """The processes whose parent is pid (the engine worker of a localrun command)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _kill_engine(proc: subprocess.Popen) -> str:
    """SIGKILL the command's engine worker; the command's return code and the rest of its stderr."""
    try:
        (worker,) = _children(proc.pid)
        os.kill(worker, signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err.decode() if isinstance(err, bytes) else err


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "localrun", *args]


def test_run_whose_engine_is_killed_says_so_and_the_next_run_works(starter: Path) -> None:
    proc = subprocess.Popen(_cmd("run", "smollm2:135m", "Write a long story about a dragon.", "--temperature", "0",
                                 "--max-tokens", "400"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.read(1)  # the reply has started streaming
    text = _kill_engine(proc)
    assert proc.returncode == 1, text
    assert "engine crashed" in text and "SIGKILL" in text and "Traceback" not in text
    again = subprocess.run(_cmd("run", "smollm2:135m", "The capital of France is", "--raw", "--temperature", "0",
                                "--max-tokens", "3"), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "Paris" in again.stdout
    reliability.fault("SIGKILL", "the engine during run")


def test_batch_whose_engine_is_killed_keeps_its_rows_and_resumes(starter: Path, tmp_path: Path) -> None:
    rows, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"Tell me about the number {i}."}) + "\n" for i in range(24)))
    args = _cmd("batch", "smollm2:135m", "-i", str(rows), "-o", str(out), "--temperature", "0", "--max-tokens", "24",
                "-p", "4")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # a progress line follows every written row
        seen.append(line)
        if "rows," in line and not line.startswith("localrun batch: 0/"):
            break
    else:
        pytest.fail(f"the batch ended before a row was written: {''.join(seen)[-2000:]}")
    assert proc.poll() is None, "the batch finished before its engine could be killed"
    err = _kill_engine(proc)
    assert proc.returncode == 1 and "engine crashed" in err and "Traceback" not in err, err
    kept = [json.loads(line) for line in out.read_text().splitlines()]  # only whole rows
    assert 1 <= len(kept) < 24 and all("text" in r for r in kept)
    again = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(24))
    reliability.fault("SIGKILL", "the engine during batch")
    reliability.rows(24, len({r["id"] for r in kept} - set(ids)))
