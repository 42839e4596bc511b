"""`localrun convert` / `localrun quantize` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from convert_helpers import ROOT


def run(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LOCALRUN_HOME": str(home), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "localrun", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_convert_registers_and_prints_path(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    out = tmp_path / "tiny-q8.gguf"
    p = run(
        "convert",
        str(folder),
        "-o",
        str(out),
        "--outtype",
        "q8_0",
        "--name",
        "tiny:q8",
        home=tmp_path / "h",
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    assert out.read_bytes()[:4] == b"GGUF"
    listed = run("list", "--json", home=tmp_path / "h")
    assert "tiny:q8" in [m["name"] for m in json.loads(listed.stdout)]
    # an existing output is an error on one line, with the next step
    again = run(
        "convert",
        str(folder),
        "-o",
        str(out),
        "--outtype",
        "q8_0",
        "--no-register",
        home=tmp_path / "h",
    )
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"localrun: {out} already exists; pass --force to overwrite it or choose another -o"
    ]


def test_dry_run_and_quantize(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    folder, _, _ = checkpoints("llama")
    plan = run(
        "convert",
        str(folder),
        "-o",
        str(tmp_path / "x.gguf"),
        "--outtype",
        "q4_k_m",
        "--dry-run",
        home=tmp_path / "h",
    )
    assert plan.returncode == 0, plan.stderr
    assert "token_embd.weight" in plan.stdout and "q4_k_m" in plan.stdout
    assert not (tmp_path / "x.gguf").exists()
    f16 = tmp_path / "f16.gguf"
    assert (
        run(
            "convert",
            str(folder),
            "-o",
            str(f16),
            "--outtype",
            "f16",
            "--no-register",
            home=tmp_path / "h",
        ).returncode
        == 0
    )
    q = run(
        "quantize",
        str(f16),
        "q4_0",
        "-o",
        str(tmp_path / "q4.gguf"),
        "--no-register",
        home=tmp_path / "h",
    )
    assert q.returncode == 0, q.stderr
    assert q.stdout.strip() == str(tmp_path / "q4.gguf")
    bad = run("convert", str(tmp_path / "nope"), home=tmp_path / "h")
    assert bad.returncode == 1 and "is not a folder" in bad.stderr


def test_same_file_name_in_two_folders(checkpoints, tmp_path: Path) -> None:  # noqa: ANN001
    """The second conversion is named after the model; a --name another model holds fails first."""
    folder, _, _ = checkpoints("llama")
    home = tmp_path / "h"
    outs = {}
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
        outs[sub] = tmp_path / sub / "model-f32.gguf"
    first = run("convert", str(folder), "-o", str(outs["a"]), "--outtype", "f32", home=home)
    assert first.returncode == 0, first.stderr
    assert "registered as model:f32" in first.stderr
    second = run("convert", str(folder), "-o", str(outs["b"]), "--outtype", "f32", home=home)
    assert second.returncode == 0, second.stderr
    family = folder.name.lower()
    assert f"registered as {family}:f32" in second.stderr
    listed = {m["name"]: m["path"] for m in json.loads(run("list", "--json", home=home).stdout)}
    assert listed["model:f32"] == str(outs["a"]) and listed[f"{family}:f32"] == str(outs["b"])
    # converting the same file again keeps its name
    again = run("convert", str(folder), "-o", str(outs["b"]), "--outtype", "f32", "--force", home=home)
    assert again.returncode == 0 and f"registered as {family}:f32" in again.stderr, again.stderr
    # a name another model holds is an error before anything is written
    taken = run("convert", str(folder), "-o", str(outs["c"]), "--outtype", "f32", "--name", "model:f32", home=home)
    assert taken.returncode == 2
    assert taken.stderr.strip().splitlines() == [
        "localrun: a model named 'model:f32' is already installed; choose another name with --name, "
        "or remove it first with 'localrun rm'"
    ]
    assert list((tmp_path / "c").iterdir()) == []
