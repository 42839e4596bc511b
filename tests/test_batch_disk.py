"""`localrun batch` on a full disk, for real: a small tmpfs that the test mounts (the tests run as
root) and fills. The batch ends with one error line naming the disk, the output holds complete
rows only, and --resume finishes the batch once there is space again."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from . import disks, reliability
from .conftest import run_cli

ROWS = 60  # about 120 bytes of output each: more than the page left free


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs mounted for this test."""
    with disks.small_disk(tmp_path / "small-disk", "64k") as mnt:
        yield mnt


def complete_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL output, checking that each line is whole."""
    data = path.read_text(encoding="utf-8")
    assert data == "" or data.endswith("\n"), f"torn last line: {data[-200:]!r}"
    rows = [json.loads(line) for line in data.splitlines()]
    assert all(isinstance(r, dict) and "id" in r and "text" in r for r in rows)
    return rows


def test_full_disk_is_one_clear_error_and_resume_finishes(small_disk: Path, tmp_path: Path) -> None:
    ids = [f"row-{i:02d}" for i in range(ROWS)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"Say the number {n}."}) + "\n" for n, i in enumerate(ids)))
    out = small_disk / "out.jsonl"
    filler = disks.fill(small_disk, leave=disks.PAGE)
    batch = ("batch", "smollm2:135m", "--input", str(rows), "--output", str(out), "--temperature", "0",
             "--max-tokens", "8")

    res = run_cli(*batch)
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("localrun: ")]
    assert len(errors) == 1, res.stderr
    assert f"the disk at {small_disk} is full" in errors[0] and f"'{out}'" in errors[0], errors[0]
    assert "--resume" in errors[0]
    written = complete_rows(out)
    assert 0 < len(written) < ROWS
    assert len({r["id"] for r in written}) == len(written)

    filler.unlink()
    res = run_cli(*batch, "--resume")
    assert res.returncode == 0, res.stderr
    assert f"{len(written)} already done" in res.stderr
    final = complete_rows(out)
    assert sorted(r["id"] for r in final) == ids  # every row exactly once
    assert final[: len(written)] == written  # the rows from before the full disk are kept as they were
    reliability.fault("full disk", "batch output")
    reliability.rows(ROWS, sum(1 for r in written if r not in final))
