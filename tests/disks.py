"""Small filesystems the tests mount and fill, for the full-disk tests (mounting needs root)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import skip_or_fail

PAGE = 4096


@contextlib.contextmanager
def small_disk(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (e.g. "64k", "96m") mounted at `where` for the block."""
    if os.geteuid() != 0:
        skip_or_fail("mounting a small filesystem for the full-disk test needs root")
    where.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs for the full-disk test: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill the disk with one file, then give back `leave` bytes (whole pages) of it."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f:
        with pytest.raises(OSError) as e:
            while True:
                f.write(b"\0" * (PAGE * 256))
        # the last write may have been short: fill the remaining pages one by one
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * PAGE)
        assert e.value.errno == errno.ENOSPC
        if leave:
            f.truncate(os.fstat(f.fileno()).st_size // PAGE * PAGE - leave)
    return filler
