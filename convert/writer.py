"""Streaming GGUF output: header from gguf-py's writer, tensor data block by block, atomic rename."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np

from convert import outtypes
from convert.archs import TensorSpec
from convert.checkpoint import Checkpoint
from convert.errors import ConvertError
from convert.plan import Plan, PlannedTensor
from convert.progress import Progress, ProgressCallback
from convert.source import SourceTensor

log = logging.getLogger(__name__)

BLOCK_BYTES = (
    8 << 20
)  # source bytes per work item: small enough to bound memory, big enough for numpy
_MARGIN = 16 << 20
# Written bytes between hints to the kernel that it may write back and drop them: a page cache
# of our own recycled pages is far cheaper than fresh ones, and the final fsync finds little to do.
_DROP_BYTES = 64 << 20


def check_target(out: Path, force: bool) -> None:
    """Refuse to overwrite without force, and a target folder that does not exist."""
    if out.exists() and not force:
        raise ConvertError(
            f"{out} already exists", "pass --force to overwrite it or choose another -o"
        )
    if not out.parent.is_dir():
        raise ConvertError(f"folder {out.parent} does not exist", "create it or choose another -o")


def check_space(folder: Path, needed: int) -> None:
    """Fail before any work when the target folder's disk cannot hold the output."""
    free = shutil.disk_usage(folder).free
    if free < needed + _MARGIN:
        raise ConvertError(
            f"not enough disk space in {folder}: {needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free",
            "free some space or write elsewhere with -o",
        )


def temp_path(out: Path, tag: str = "partial") -> Path:
    """A hidden temporary name next to out (same filesystem, so the rename is atomic)."""
    return out.with_name(f".{out.name}.{os.getpid()}.{tag}")


def _alive(pid: int) -> bool:
    """Whether a process with this id runs (one of another user counts as running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: Path) -> int:
    """Remove out's temporary files whose writer no longer runs (a killed run); returns the bytes freed."""
    prefix = f".{out.name}."
    freed, count = 0, 0
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(out.parent):
            if not entry.name.startswith(prefix) or not entry.is_file(follow_symlinks=False):
                continue
            pid, _, tag = entry.name[len(prefix) :].partition(".")
            # A live process may be writing it, and this one may hold it in a finally block.
            if (
                not pid.isdigit()
                or not tag
                or "." in tag
                or int(pid) == os.getpid()
                or _alive(int(pid))
            ):
                continue
            with contextlib.suppress(FileNotFoundError):
                size = entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                freed, count = freed + size, count + 1
    if count:
        log.warning(
            "removed %d temporary file%s of %s left by an interrupted run (%.1f MB)",
            count,
            "" if count == 1 else "s",
            out,
            freed / 1e6,
        )
    return freed


@contextlib.contextmanager
def atomic_output(out: Path) -> Iterator[Path]:
    """Yield a temporary path; rename it to out on success, remove it on any failure or Ctrl-C."""
    tmp = temp_path(out)
    try:
        yield tmp
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _work_items(
    ckpt: Checkpoint, spec: TensorSpec, planned: PlannedTensor
) -> Iterator[Callable[[], np.ndarray]]:
    """Closures that each produce the next bytes of one tensor, in order."""
    qtype = planned.qtype
    if spec.data is not None:
        data = spec.data
        yield lambda: outtypes.encode(data, "F32", qtype)
        return
    if spec.produce is not None:
        yield from spec.produce(ckpt.tensors)
        return
    if spec.pieces:
        for piece in spec.pieces:
            src = ckpt.tensors[piece.source]
            stop = src.matrix_rows if piece.stop is None else piece.stop
            yield from _blocks(
                src.read_matrix, src, piece.start, stop, src.matrix_rows, None, qtype
            )
        return
    src = ckpt.tensors[spec.source]
    fn = spec.fn
    # a function that moves rows across blocks (e.g. a permutation) gets the whole tensor at once
    whole = fn is not None and spec.whole
    yield from _blocks(src.read, src, 0, src.rows, src.rows, fn, qtype, whole)


def _blocks(
    read: Callable[[int, int], np.ndarray],
    src: SourceTensor,
    start: int,
    stop: int,
    rows: int,
    fn: Callable[[np.ndarray], np.ndarray] | None,
    qtype: gguf.GGMLQuantizationType,
    whole: bool = False,
) -> Iterator[Callable[[], np.ndarray]]:
    """Closures that encode rows [start, stop) of src (of `rows` in all), about BLOCK_BYTES each
    (or all of them in one, when whole)."""
    step = max(1, stop - start if whole else BLOCK_BYTES // max(src.nbytes // max(rows, 1), 1))
    for a in range(start, stop, step):
        yield functools.partial(_encode_rows, read, a, min(a + step, stop), src.dtype, fn, qtype)


def _encode_rows(
    read: Callable[[int, int], np.ndarray],
    a: int,
    b: int,
    dtype: str,
    fn: Callable[[np.ndarray], np.ndarray] | None,
    qtype: gguf.GGMLQuantizationType,
) -> np.ndarray:
    """Rows [a, b) as the output type's bytes, through a row-wise function on float32 if any."""
    rows = read(a, b)
    if fn is None:
        return outtypes.encode(rows, dtype, qtype)
    return outtypes.encode(fn(outtypes.to_f32(rows, dtype)), dtype, qtype, converted=True)


def write_model(
    ckpt: Checkpoint,
    plan: Plan,
    specs: list[TensorSpec],
    path: Path,
    metadata: Callable[[gguf.GGUFWriter], None],
    progress: ProgressCallback | None = None,
    threads: int | None = None,
) -> None:
    """Write the GGUF file at path: metadata first, then each tensor as it is produced."""
    w = gguf.GGUFWriter(path=None, arch=plan.arch)
    for t in plan.tensors:
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    metadata(w)  # after the tensor infos: the size label counts their parameters
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fout = w.fout[0]
    align = w.data_alignment

    def pad(n: int) -> None:
        if n % align:
            fout.write(b"\0" * (align - n % align))

    pad(fout.tell())
    n_threads = threads or min(4, os.cpu_count() or 1)
    start = time.monotonic()
    done_bytes = 0
    # Work items of all tensors flow through one bounded queue, so threads never idle at
    # tensor boundaries and at most `depth` blocks are in memory.
    items = (
        (i, fn)
        for i, (spec, planned) in enumerate(zip(specs, plan.tensors, strict=False))
        for fn in _work_items(ckpt, spec, planned)
    )
    written = [0] * len(plan.tensors)
    depth = 2 * n_threads
    # Not for an intermediate that llama.cpp quantizes next: that one is read right back.
    drop, undropped = hasattr(os, "posix_fadvise") and not plan.quantized, 0
    try:
        with ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="convert") as pool:
            queue: deque[tuple[int, Future[np.ndarray]]] = deque()
            current = 0

            def finish_until(index: int) -> None:
                nonlocal current, done_bytes
                while current < index:
                    t = plan.tensors[current]
                    if written[current] != t.nbytes:
                        raise ConvertError(
                            f"tensor {t.name} produced {written[current]} bytes, expected {t.nbytes}"
                        )
                    pad(t.nbytes)
                    done_bytes += t.nbytes
                    current += 1
                    if progress is not None:
                        progress(
                            Progress(
                                "convert",
                                t.name,
                                current,
                                len(plan.tensors),
                                done_bytes,
                                plan.gguf_bytes,
                                time.monotonic() - start,
                            )
                        )

            def drain_one() -> None:
                nonlocal undropped, drop
                i, fut = queue.popleft()
                finish_until(i)
                data = fut.result()
                fout.write(np.ascontiguousarray(data).data.cast("B"))
                written[i] += data.nbytes
                undropped += data.nbytes
                if drop and undropped >= _DROP_BYTES:
                    fout.flush()
                    try:
                        os.posix_fadvise(fout.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                    except OSError:  # a file system without the hint: write as usual
                        drop = False
                    undropped = 0

            for i, fn in items:
                queue.append((i, pool.submit(fn)))
                if len(queue) >= depth:
                    drain_one()
            while queue:
                drain_one()
            finish_until(len(plan.tensors))
        fout.flush()
        os.fsync(fout.fileno())
    finally:
        w.close()
