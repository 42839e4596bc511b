"""Resumable, verified downloads into the Hugging Face cache's blob layout.

huggingface_hub 2.4.0 names its partial files per process and deletes them on failure, so an
interrupted download restarts from byte 0, and it checks sizes only. Here each blob is fetched
with ranged requests into `blobs/<etag>.incomplete` (the name older huggingface_hub versions also
resumed from), under the same lock file huggingface_hub takes, hashed while it streams, and
renamed into place only when its sha256 (LFS files) or git blob id (small files) matches.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from localrun.errors import CancelledError, HubError

MAX_RETRIES = 6  # consecutive failures without progress before giving up
BACKOFF_BASE = 0.5  # seconds; doubled after each failure, capped at BACKOFF_MAX
BACKOFF_MAX = 8.0
READ_TIMEOUT = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or 10)
_RETRY_STATUS = {408, 429, 500, 502, 503, 504}


class Cancel(Protocol):
    """Anything with is_set(), e.g. threading.Event."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class Progress:
    """One file's download progress, as the CLI bar and the TUI show it."""

    filename: str
    done: int
    total: int
    speed: float  # bytes per second over the last few seconds
    eta: float | None  # seconds
    resumed: int = 0  # bytes that were already on disk when this file started
    phase: str = "download"  # "download", "verify", "cached" or "done"

    @property
    def fraction(self) -> float:
        return self.done / self.total if self.total else 1.0


ProgressFn = Callable[[Progress], None]


@dataclass(frozen=True)
class Blob:
    """A file to fetch: where from, how big, and the digest it must have."""

    filename: str
    url: str
    size: int
    sha256: str | None  # LFS files
    git_sha1: str | None  # small files stored in git

    @property
    def etag(self) -> str:
        """The blob's name in the cache, as huggingface_hub names it."""
        return self.sha256 or self.git_sha1 or ""


class _Hasher:
    """Digest computed on a worker thread so hashing overlaps the network (hashlib drops the GIL)."""

    def __init__(self, blob: Blob) -> None:
        self.blob = blob
        if blob.sha256:
            self._h = hashlib.sha256()
        else:
            self._h = hashlib.sha1(b"blob %d\0" % blob.size)
        self._q: queue.Queue[bytes | None] = queue.Queue(maxsize=256)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._q.get()) is not None:
            self._h.update(chunk)

    def update(self, chunk: bytes) -> None:
        self._q.put(chunk)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._thread.join()
        return self._h.hexdigest()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()

    @property
    def expected(self) -> str:
        return self.blob.sha256 or self.blob.git_sha1 or ""


class _Meter:
    """Throttled progress events with a sliding-window speed."""

    def __init__(self, blob: Blob, resumed: int, callback: ProgressFn | None) -> None:
        self.blob, self.resumed, self.callback = blob, resumed, callback
        now = time.monotonic()
        self.samples: list[tuple[float, int]] = [(now, resumed)]
        self.last_emit = 0.0

    def update(self, done: int, force: bool = False, phase: str = "download") -> None:
        if self.callback is None:
            return
        now = time.monotonic()
        if not force and now - self.last_emit < 0.1:
            return
        self.last_emit = now
        self.samples.append((now, done))
        while len(self.samples) > 2 and now - self.samples[0][0] > 5:
            self.samples.pop(0)
        t0, d0 = self.samples[0]
        speed = (done - d0) / (now - t0) if now > t0 else 0.0
        eta = (self.blob.size - done) / speed if speed > 0 else None
        self.callback(Progress(self.blob.filename, done, self.blob.size, speed, eta, self.resumed, phase))


def hash_file(path: Path, blob: Blob, progress: ProgressFn | None = None, cancel: Cancel | None = None) -> str:
    """The digest of a file on disk, in the blob's scheme (sha256 or git blob sha1)."""
    hasher = _Hasher(blob)
    meter = _Meter(blob, 0, progress)
    done = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                if cancel is not None and cancel.is_set():
                    raise CancelledError(f"verification of '{blob.filename}' cancelled")
                hasher.update(block)
                done += len(block)
                meter.update(done, phase="verify")
        return hasher.hexdigest()
    finally:
        hasher.close()


def _wait(seconds: float, cancel: Cancel | None) -> None:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if cancel is not None and cancel.is_set():
            return
        time.sleep(min(left, 0.1))


def fetch(
    blob: Blob,
    dest: Path,
    *,
    headers: dict[str, str],
    session: Any,
    raise_for_status: Callable[[Any], None],
    progress: ProgressFn | None = None,
    cancel: Cancel | None = None,
) -> int:
    """Download `blob` to `dest` (resuming `dest.incomplete`); returns the bytes fetched this time.

    The partial file survives errors, cancellation and killed processes; it is deleted only when
    the finished file fails verification.
    """
    import httpx2

    part = dest.with_name(dest.name + ".incomplete")
    dest.parent.mkdir(parents=True, exist_ok=True)
    f = open(part, "r+b" if part.exists() else "w+b", buffering=0)  # noqa: SIM115 - closed below
    hasher: _Hasher | None = None
    fetched = 0
    try:
        offset = f.seek(0, os.SEEK_END)
        if offset > blob.size:
            f.truncate(0)
            offset = f.seek(0)
        hasher = _Hasher(blob)
        f.seek(0)
        while f.tell() < offset:  # the digest covers the bytes already on disk
            hasher.update(f.read(min(1 << 22, offset - f.tell())))
        meter = _Meter(blob, offset, progress)
        meter.update(offset, force=True)
        failures = 0
        while offset < blob.size:
            if cancel is not None and cancel.is_set():
                raise CancelledError(
                    f"download of '{blob.filename}' cancelled at {offset} of {blob.size} bytes",
                    "run the same pull again to resume",
                )
            req = {**headers, "Accept-Encoding": "identity"}
            if offset:
                req["Range"] = f"bytes={offset}-"
            try:
                timeout = httpx2.Timeout(READ_TIMEOUT, connect=READ_TIMEOUT)
                with session.stream("GET", blob.url, headers=req, timeout=timeout) as r:
                    if r.status_code in _RETRY_STATUS:
                        raise _RetryableStatus(r.status_code)
                    if r.status_code >= 400:
                        r.read()
                        raise_for_status(r)
                    start = _range_start(r.headers.get("Content-Range")) if r.status_code == 206 else 0
                    if start != offset:
                        # The server ignored or changed the range: start over from its offset (0).
                        f.truncate(0)
                        f.seek(0)
                        offset = 0
                        hasher.close()
                        hasher = _Hasher(blob)
                    f.seek(offset)
                    for chunk in r.iter_raw():
                        f.write(chunk)
                        hasher.update(chunk)
                        offset += len(chunk)
                        fetched += len(chunk)
                        failures = 0
                        if offset > blob.size:
                            raise HubError(
                                f"the server sent more than the {blob.size} bytes of '{blob.filename}'",
                                "run the pull again",
                            )
                        meter.update(offset)
                        if cancel is not None and cancel.is_set():
                            break
            except (httpx2.TransportError, _RetryableStatus) as e:
                failures += 1
                if failures > MAX_RETRIES:
                    raise HubError(
                        f"downloading '{blob.filename}' failed after {MAX_RETRIES} retries ({_describe(e)});"
                        f" {offset} of {blob.size} bytes are kept",
                        "check the connection and run the same pull again: it resumes where it stopped",
                    ) from e
                _wait(min(BACKOFF_BASE * 2 ** (failures - 1), BACKOFF_MAX), cancel)
        meter.update(offset, force=True)
        digest = hasher.hexdigest()
        if digest != hasher.expected:
            f.close()
            part.unlink(missing_ok=True)
            kind = "sha256" if blob.sha256 else "git blob id"
            raise HubError(
                f"'{blob.filename}' is corrupted: its {kind} is {digest[:12]}… but the Hub lists"
                f" {hasher.expected[:12]}…; the file was deleted and not installed",
                "run the pull again; if it keeps failing, the file on the Hub or a proxy is at fault",
            )
        f.close()
        os.replace(part, dest)
        meter.update(offset, force=True, phase="done")
        return fetched
    finally:
        if hasher is not None:
            hasher.close()
        if not f.closed:
            f.close()


class _RetryableStatus(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


def _range_start(content_range: str | None) -> int:
    """The first byte of a `Content-Range: bytes a-b/n` header (-1 when absent or malformed)."""
    try:
        return int((content_range or "").split()[1].split("-")[0])
    except (IndexError, ValueError):
        return -1


def _describe(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
