"""The quantization ladder on real models: rungs built, evaluated, benchmarked, registered and
reported; a ladder killed with SIGKILL resumes without redoing finished rungs; an importance
matrix lowers the KL divergence of an i-quant on the real starter model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.workbench.ladder import Ladder

from . import reliability
from .ggufs import dequantize_to_f16

FAST = ["--ctx", "64", "--chunks", "4", "--bench", "16,4,1", "--threads", "2"]


def _text(tmp_path: Path) -> Path:
    """A real text to evaluate on: this project's README."""
    readme = Path(__file__).parents[1] / "README.md"
    path = tmp_path / "eval.txt"
    path.write_text(readme.read_text(encoding="utf-8"), encoding="utf-8")
    return path


def _state(out: Path) -> Ladder | None:
    try:
        return Ladder.from_dict(json.loads((out / "ladder.json").read_text()))
    except (OSError, ValueError):
        return None


def _stopped(pid: int) -> bool:
    """Wait until the kernel says the process is stopped (state T in /proc/PID/stat): a signal is
    delivered later than kill() returns, and the ladder may still write until then. False when
    the process has ended instead."""
    while True:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        state = stat[stat.rindex(")") + 2]  # the field after the command's name, which may hold spaces
        if state in "Tt":
            return True
        if state in "ZX":
            return False
        time.sleep(0.001)


def _kill_between_rungs(cmd: list[str], out: Path, n_rungs: int, log: Path) -> Ladder:
    """Start the ladder and SIGKILL it once ladder.json lists a finished rung but not every rung.

    The declared state is read with the ladder stopped (SIGSTOP), so what was read is what the
    kill interrupted; a ladder that ends first fails the test instead of passing without a kill.
    """
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        try:
            while proc.poll() is None:
                os.kill(proc.pid, signal.SIGSTOP)
                if not _stopped(proc.pid):  # it ended on its own meanwhile
                    continue
                state = _state(out)
                if state is not None and 0 < len(state.rungs) < n_rungs:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                os.kill(proc.pid, signal.SIGCONT)
                time.sleep(0.05)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGKILL, (
        f"the ladder ended (rc {proc.returncode}) before it was killed: {log.read_text()[-2000:]}")
    assert state is not None and 0 < len(state.rungs) < n_rungs
    return state


def test_three_rungs_resume_after_sigkill(stories: Path, tmp_path: Path, cli: Any) -> None:
    text, out = _text(tmp_path), tmp_path / "ladder"
    types = "q8_0,q5_0,q4_0"
    cmd = [sys.executable, "-m", "localrun", "quantize", str(stories), "--ladder", types, "-o", str(out),
           "--text", str(text), "--imatrix", "none", "--name", "tiny", *FAST]
    killed = _kill_between_rungs(cmd, out, len(types.split(",")), tmp_path / "ladder.log")
    first = _state(out)
    assert first is not None and first.rungs == killed.rungs  # SIGKILL runs no cleanup, and none was needed
    kept = {r.type: Path(r.path).stat().st_mtime_ns for r in first.rungs}

    res = cli(*cmd[3:])
    assert res.returncode == 0, res.stderr
    for t in kept:
        assert f"{t}: already built and measured" in res.stderr
        assert Path(next(r.path for r in _state(out).rungs if r.type == t)).stat().st_mtime_ns == kept[t]
    ladder = _state(out)
    assert ladder is not None and [r.type for r in ladder.rungs] == types.split(",")
    for r in ladder.rungs:
        assert Path(r.path).is_file() and r.size == Path(r.path).stat().st_size
        assert r.kld_mean >= 0 and 0 < r.top_agreement <= 1 and r.ppl > 1 and r.pp_tps > 0 and r.tg_tps > 0
        assert api.get_model(f"tiny:{r.type}").path == r.path
    q8, q4 = ladder.rungs[0], ladder.rungs[2]
    assert q8.kld_mean < q4.kld_mean and q8.size > q4.size
    report = json.loads((out / "report.json").read_text())
    assert report["recommended"] in (None, *types.split(","))
    assert "| q4_0 |" in (out / "report.md").read_text() or "| q4_0 **(recommended)** |" in (out / "report.md").read_text()
    assert "| type | size MiB |" in res.stdout
    meta = api.get_model("tiny:q4_0").details["metadata"]
    assert meta["localrun.source"] == str(stories.resolve()) and meta["localrun.quantized_from"] == stories.name
    reliability.fault("SIGKILL", "a quantization ladder")


def test_imatrix_lowers_kld_of_an_iquant(starter: Path, tmp_path: Path) -> None:
    ref = dequantize_to_f16(starter, tmp_path / "starter-F16.gguf")
    text = _text(tmp_path)
    calibration = tmp_path / "calibration.txt"
    from localrun.workbench.texts import default_calibration

    calibration.write_text(default_calibration(12_000)[0], encoding="utf-8")
    common: dict[str, Any] = dict(text=text, n_ctx=128, chunks=4, bench=(16, 4, 1), threads=2)
    plain = api.quantize_ladder(ref, ["iq4_xs"], tmp_path / "plain", imatrix=None, name="plain", **common)
    weighted = api.quantize_ladder(ref, ["iq4_xs"], tmp_path / "weighted", imatrix="auto", calibration=calibration,
                                   name="weighted", **common)
    assert not plain.rungs[0].imatrix and weighted.rungs[0].imatrix
    assert weighted.rungs[0].kld_mean < plain.rungs[0].kld_mean
    meta = api.get_model("weighted:iq4_xs").details["metadata"]
    assert calibration.name in meta["localrun.imatrix.dataset"] and len(meta["localrun.imatrix.sha256"]) == 64


def test_quantized_source_and_bad_types_are_refused(starter: Path, tmp_path: Path, cli: Any) -> None:
    res = cli("quantize", str(starter), "--ladder", "q4_0", "-o", str(tmp_path / "x"))
    assert res.returncode == 2 and "16- or 32-bit" in res.stderr
    res = cli("quantize", str(starter))
    assert res.returncode == 2 and "--ladder" in res.stderr


@pytest.mark.parametrize("bad", ["512,128", "a,b,c"])
def test_bad_bench_setting(stories: Path, cli: Any, bad: str) -> None:
    res = cli("quantize", str(stories), "--ladder", "q8_0", "--bench", bad)
    assert res.returncode == 2 and "--bench" in res.stderr
