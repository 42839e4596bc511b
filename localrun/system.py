"""Facts about this machine: memory, GPUs, accelerators."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from functools import lru_cache
from typing import Any


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
