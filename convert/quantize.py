"""llama.cpp quantization of a GGUF file, run in a child process so that a native abort is an error."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from convert import outtypes
from convert.errors import ConvertError
from convert.progress import Progress, ProgressCallback
from convert.writer import check_space, check_target, remove_stale_temps, temp_path

_TENSOR_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
# Runs the worker module in a child that dies with this process: a killed quantize leaves no
# orphan still writing its temporary file.
_BOOT = (
    "import runpy, sys; from convert.quantize import _die_with_parent; "
    "_die_with_parent(int(sys.argv.pop(1))); "
    "runpy.run_module('convert._quantize_worker', run_name='__main__', alter_sys=True)"
)


def quantize_file(
    src: Path,
    dst: Path,
    outtype: str,
    imatrix: Path | None = None,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
) -> None:
    """Quantize src into dst (dst is written in place: callers pass a temporary name)."""
    ftype = outtypes.F.MOSTLY_Q8_0 if outtype == "q8_0" else outtypes.LLAMA_CPP[outtype]
    cmd = [
        sys.executable,
        "-c",
        _BOOT,
        str(os.getpid()),
        str(src),
        str(dst),
        str(int(ftype)),
        str(threads or os.cpu_count() or 1),
        str(imatrix or ""),
    ]
    start = time.monotonic()
    size = src.stat().st_size
    tail: list[str] = []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**os.environ, "PYTHONPATH": _pythonpath()},
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = (tail + [line.rstrip()])[-20:]
            m = _TENSOR_LINE.search(line)
            if m and progress is not None:
                i, n = int(m.group(1)), int(m.group(2))
                progress(
                    Progress(
                        "quantize",
                        m.group(3).rstrip(","),
                        i,
                        n,
                        size * i // n,
                        size,
                        time.monotonic() - start,
                    )
                )
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if rc != 0:
        # llama.cpp's own reason ("... requires an imatrix!") says more than the worker's exit line.
        detail = next(
            (t for t in reversed(tail) if "requires" in t.lower() or "failed to quantize" in t.lower()),
            next((t for t in reversed(tail) if "error" in t.lower()), tail[-1] if tail else f"exit status {rc}"),
        )
        raise ConvertError(
            f"llama.cpp could not quantize to {outtype}: {detail.strip()}",
            "check the input file and the type; LOCALRUN_DEBUG=1 shows more",
        )


def _die_with_parent(parent: int) -> None:
    """In the worker: be killed when the parent dies (Linux), and exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _pythonpath() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    old = os.environ.get("PYTHONPATH")
    return root if not old else f"{root}{os.pathsep}{old}"


def quantize(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    outtype: str,
    *,
    imatrix: str | os.PathLike[str] | None = None,
    force: bool = False,
    threads: int | None = None,
    progress: ProgressCallback | None = None,
) -> Path:
    """Re-quantize an existing GGUF file with llama.cpp; returns the output path."""
    src_p = Path(src)
    if not src_p.is_file():
        raise ConvertError(f"{src_p} does not exist", "pass a .gguf file")
    name = outtypes.normalize(outtype)
    if name not in outtypes.LLAMA_CPP and name != "q8_0":
        raise ConvertError(
            f"quantize makes llama.cpp types, not {outtype!r}",
            f"choose one of: q8_0, {', '.join(outtypes.LLAMA_CPP)}",
        )
    if name in outtypes.NEEDS_IMATRIX and imatrix is None:
        raise ConvertError(f"{name} needs an importance matrix", "pass --imatrix FILE")
    out_p = Path(out) if out is not None else src_p.with_name(f"{_stem(src_p)}-{name.upper()}.gguf")
    if out_p.resolve() == src_p.resolve():
        raise ConvertError("the output would overwrite the input", "choose another -o")
    check_target(out_p, force)
    remove_stale_temps(out_p)
    check_space(out_p.parent, src_p.stat().st_size)
    tmp = temp_path(out_p)
    try:
        quantize_file(src_p, tmp, name, Path(imatrix) if imatrix else None, threads, progress)
        os.replace(tmp, out_p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return out_p


def _stem(p: Path) -> str:
    stem = p.stem
    return re.sub(r"[-.](F32|F16|BF16|Q\d\w*)$", "", stem, flags=re.IGNORECASE)
