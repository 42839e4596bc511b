"""Resumable, verified downloads into the Hugging Face cache's blob layout.

huggingface_hub 2.4.0 names its partial files per process and deletes them on failure, so an
interrupted download restarts from byte 0, and it checks sizes only. Here each blob is fetched
with ranged requests into `blobs/<etag>.incomplete` (the name older huggingface_hub versions also
resumed from), under the same lock file huggingface_hub takes, hashed while it streams, and
renamed into place only when its sha256 (LFS files) or git blob id (small files) matches.
A server that ignores Range has the bytes already held skipped, a Retry-After is honoured up to
RETRY_AFTER_MAX, and a body that would run past the listed size is refused, never installed.
"""

from __future__ import annotations

import datetime
import email.utils
import errno
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
RETRY_AFTER_MAX = 60.0  # seconds; a server asking for longer gets a clear error, not a silent wait
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


def partial_path(dest: Path) -> Path:
    """Where fetch keeps the bytes of dest downloaded so far (huggingface_hub's name for it)."""
    return dest.with_name(dest.name + ".incomplete")


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
    the finished file fails verification or the server sent more than the file holds.
    """
    import httpx2

    part = partial_path(dest)
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
            before = offset
            try:
                timeout = httpx2.Timeout(READ_TIMEOUT, connect=READ_TIMEOUT)
                with session.stream("GET", blob.url, headers=req, timeout=timeout) as r:
                    if r.status_code in _RETRY_STATUS:
                        raise _RetryableStatus(r.status_code, retry_after(r.headers.get("Retry-After")))
                    if r.status_code >= 400:
                        r.read()
                        raise_for_status(r)
                    skip = offset - _body_start(r, blob, offset)
                    f.seek(offset)
                    for chunk in r.iter_raw():
                        if skip:  # bytes before `offset` that the server resent (it ignored Range)
                            cut = min(skip, len(chunk))
                            chunk, skip = chunk[cut:], skip - cut
                            if not chunk:
                                continue
                        if offset + len(chunk) > blob.size:
                            f.close()
                            part.unlink(missing_ok=True)
                            raise HubError(
                                f"the server sent more than the {blob.size} bytes of '{blob.filename}';"
                                " the partial file was deleted and nothing was installed",
                                "run the pull again; if it keeps failing, a proxy or the Hub is serving another file",
                            )
                        _write_all(f, chunk)
                        hasher.update(chunk)
                        offset += len(chunk)
                        fetched += len(chunk)
                        failures = 0
                        meter.update(offset)
                        if cancel is not None and cancel.is_set():
                            break
                if offset == before and not (cancel is not None and cancel.is_set()):
                    raise _Unusable("the server's answer ended before any new byte")
            except (httpx2.TransportError, _RetryableStatus, _Unusable) as e:
                failures += 1
                wait = _retry_wait(e, failures)
                if failures > MAX_RETRIES or wait > RETRY_AFTER_MAX:
                    raise _gave_up(blob, offset, failures, wait, e) from e
                _wait(wait, cancel)
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
        if part.exists() and part.stat().st_size == 0:
            part.unlink()  # nothing held: leave no empty partial file behind


def _write_all(f: Any, data: bytes) -> None:
    """Write every byte: an unbuffered write may take only part of it (a disk about to be full)."""
    view = memoryview(data)
    while view:
        n = f.write(view)
        if not n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[n:]


class _RetryableStatus(Exception):
    def __init__(self, status: int, retry_after: float | None = None) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.retry_after = retry_after


class _Unusable(Exception):
    """An answer that brought no byte past what was already held, or a range that cannot be used."""


def retry_after(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks to wait (delay-seconds or an HTTP date); None if absent or bad."""
    if not value or not value.strip():
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max((when - datetime.datetime.now(datetime.timezone.utc)).total_seconds(), 0.0)


def _retry_wait(e: BaseException, failures: int) -> float:
    """The server's Retry-After when it gave one, else exponential backoff."""
    if isinstance(e, _RetryableStatus) and e.retry_after is not None:
        return e.retry_after
    return min(BACKOFF_BASE * 2 ** (failures - 1), BACKOFF_MAX)


def _gave_up(blob: Blob, offset: int, failures: int, wait: float, e: BaseException) -> HubError:
    kept = f"{offset} of {blob.size} bytes are kept"
    if wait > RETRY_AFTER_MAX:
        return HubError(
            f"downloading '{blob.filename}': the server answered {_describe(e)} and asked to wait"
            f" {wait:.0f} s before retrying, longer than the {RETRY_AFTER_MAX:.0f} s localrun waits; {kept}",
            "run the same pull again later: it resumes where it stopped",
        )
    return HubError(
        f"downloading '{blob.filename}' failed after {failures - 1} retries ({_describe(e)}); {kept}",
        "check the connection and run the same pull again: it resumes where it stopped",
    )


def _body_start(r: Any, blob: Blob, offset: int) -> int:
    """Where the answer's body starts in the file, checked against what is held and the Hub's size.

    A 200 starts at 0 (the server ignored Range); a 206 where its Content-Range says. A body that
    would end past the file's size, or a range that starts past what is held, is refused.
    """
    length = _int_or_none(r.headers.get("Content-Length"))
    if r.status_code == 206:
        first, last, total = _content_range(r.headers.get("Content-Range"))
        if total is not None and total != blob.size:
            raise _wrong_size(blob, f"a size of {total} bytes")
        if first < 0 or first > offset or (last is not None and last >= blob.size):
            raise _Unusable(f"the server answered a range from byte {first} for a resume at byte {offset}")
        start = first
    else:
        start = 0
    if length is not None and start + length > blob.size:
        raise _wrong_size(blob, f"{length} bytes from byte {start}")
    return start


def _wrong_size(blob: Blob, announced: str) -> HubError:
    return HubError(
        f"the server announced {announced} for '{blob.filename}', but the Hub lists {blob.size} bytes;"
        " nothing was written",
        "run the pull again; if it keeps failing, a proxy or the Hub is serving another file",
    )


def _content_range(value: str | None) -> tuple[int, int | None, int | None]:
    """(first, last, total) of `Content-Range: bytes a-b/n`; first is -1 when absent or malformed."""
    try:
        unit, spec = (value or "").split(None, 1)
        span, total = spec.split("/")
        first, last = span.split("-")
        if unit != "bytes":
            raise ValueError(unit)
        return int(first), int(last), None if total.strip() == "*" else int(total)
    except ValueError:
        return -1, None, None


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _describe(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
