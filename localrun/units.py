"""Short human-readable numbers for tables and status lines."""

from __future__ import annotations


def size(n: float | None) -> str:
    """Bytes as '270.9 MB'."""
    if not n:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def count(n: int | None) -> str:
    """A parameter count as '135M' or '1.5B'."""
    if not n:
        return "-"
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.1f}{unit}" if v < 10 else f"{v:.0f}{unit}"
    return str(n)


def experts(count: int, used: int, shared: int = 0) -> str:
    """A mixture-of-experts layer as '128 (8 active per token, 1 shared)'."""
    return f"{count} ({used} active per token{f', {shared} shared' if shared else ''})"


def duration(seconds: float | None) -> str:
    """Seconds as '1m05s'; '-' when unknown."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds + 0.5)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"
