"""Progress events for conversion and quantization, and a stderr reporter."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO


@dataclass(frozen=True)
class Progress:
    """One step of a conversion: a tensor written (or quantized) and the running totals."""

    stage: str  # "convert" or "quantize"
    tensor: str
    index: int  # 1-based number of tensors done
    total_tensors: int
    bytes_done: int
    total_bytes: int
    elapsed_s: float

    @property
    def rate(self) -> float:
        """Bytes per second so far."""
        return self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate, or None before the rate is known."""
        if self.rate <= 0:
            return None
        return max(self.total_bytes - self.bytes_done, 0) / self.rate


ProgressCallback = Callable[[Progress], None]


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class StderrProgress:
    """Prints one updating line per stage: tensors, bytes, rate and ETA."""

    def __init__(self, stream: TextIO | None = None, min_interval_s: float = 0.2) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._tty = getattr(self.stream, "isatty", lambda: False)()

    def __call__(self, p: Progress) -> None:
        done = p.index >= p.total_tensors
        now = time.monotonic()
        # a log file gets a line every few seconds, a terminal an updating line
        interval = self.min_interval_s if self._tty else 5.0
        if not done and now - self._last < interval:
            return
        self._last = now
        eta = p.eta_s
        line = (
            f"{p.stage}: {p.index}/{p.total_tensors} tensors, "
            f"{_size(p.bytes_done)}/{_size(p.total_bytes)}, {_size(p.rate)}/s"
            + (f", ETA {eta:.0f}s" if eta is not None and not done else "")
        )
        if self._tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if done else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
