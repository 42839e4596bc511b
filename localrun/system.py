"""Facts about this machine: memory, GPUs, accelerators."""

from __future__ import annotations

import errno
import os
import platform
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any


def mount_point(path: str | os.PathLike[str]) -> Path:
    """The mount point of the filesystem that holds path: the disk a user would free."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    p = p.resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def disk_full(e: BaseException, path: str | os.PathLike[str]) -> tuple[Path, str] | None:
    """For a write to path that failed because its disk is full or over quota: (the disk's mount
    point, "full" or "over its quota"); None for any other error."""
    if not isinstance(e, OSError) or e.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return mount_point(path), "full" if e.errno == errno.ENOSPC else "over its quota"


def ram_bytes() -> tuple[int | None, int | None]:
    """(total, available) system memory in bytes, None where unknown."""
    if sys.platform.startswith("linux"):
        info: dict[str, int] = {}
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    key, _, rest = line.partition(":")
                    info[key] = int(rest.split()[0]) * 1024
        except (OSError, ValueError):
            return None, None
        return info.get("MemTotal"), info.get("MemAvailable")
    if sys.platform == "darwin":
        try:
            total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5).stdout)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None, None
        return total, None
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
        return pages * size, None
    except (ValueError, OSError, AttributeError):
        return None, None


@lru_cache(maxsize=1)
def gpus() -> list[dict[str, Any]]:
    """GPUs with name and total/free memory: NVIDIA via nvidia-smi, Apple Silicon via Metal."""
    out: list[dict[str, Any]] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run(
                [smi, "--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            )
            for line in res.stdout.strip().splitlines():
                name, total, free, driver = [x.strip() for x in line.split(",")]
                out.append({"name": name, "kind": "cuda", "total_bytes": int(float(total)) << 20,
                            "free_bytes": int(float(free)) << 20, "driver": driver})
        except (OSError, ValueError, subprocess.SubprocessError):
            pass
    if sys.platform == "darwin" and platform.machine() == "arm64":
        total, _ = ram_bytes()
        # Unified memory: Metal may use about three quarters of it by default.
        out.append({"name": "Apple Silicon GPU", "kind": "metal",
                    "total_bytes": int(total * 0.75) if total else None, "free_bytes": None})
    return out
