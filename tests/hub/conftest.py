"""A local Hub per test, selected with HF_ENDPOINT; the test files are built once per session.

`unruly_hub` is the same Hub with per-test switches for what real servers do wrong: ignore
Range, drop a resumed transfer, rate-limit with Retry-After, send a body shorter or longer
than its Content-Length. With no switch set it behaves exactly as `hub`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest

from ..conftest import STORIES, assets_or_skip
from .repos import build_files, populate
from .server import Fault, HubServer, RepoFile, _Handler

KINDS = ("ignore_range", "drop", "retry_after", "short", "long", "overlong", "unannounced")


@dataclass
class Misbehaviour:
    """What the server does wrong on the next `times` GETs of a body whose path contains `match`.

    kind: "ignore_range" (200 with the whole body, whatever Range asked), "drop" (close after
    `after` body bytes), "retry_after" (429 with `Retry-After: retry_after`), "short" (announce
    the full Content-Length, close `after` bytes before its end), "long" (`after` junk bytes past
    the announced Content-Length), "overlong" (announce and send `after` bytes more than the
    file), "unannounced" (no Content-Length, the body plus `after` junk bytes, then close).
    Bounded range reads (`bytes=a-b`, the fit estimate's header read) are never hit; with
    `resumes_only`, only resumed downloads (`bytes=N-`, N > 0) are. `times=-1`: every request.
    """

    match: str
    kind: str
    after: int = 0
    times: int = 1
    resumes_only: bool = False
    retry_after: str = "1"
    hits: list[float] = field(default_factory=list)  # when each misbehaving answer was sent

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind


class Misbehaviours:
    def __init__(self) -> None:
        self.rules: list[Misbehaviour] = []
        self.arrivals: list[tuple[float, str, str | None]] = []  # (time, path, Range) of body GETs
        self.lock = threading.Lock()

    def take(self, path: str, rng: str | None) -> Misbehaviour | None:
        with self.lock:
            self.arrivals.append((time.monotonic(), path, rng))
            spec = (rng or "").strip().removeprefix("bytes=")
            if spec and not spec.endswith("-"):
                return None  # a bounded read, e.g. a GGUF header
            resumed = bool(spec) and spec != "0-"
            for rule in self.rules:
                if rule.times != 0 and rule.match in path and (resumed or not rule.resumes_only):
                    rule.times -= 1 if rule.times > 0 else 0
                    return rule
        return None


class _UnrulyHandler(_Handler):
    unruly: Misbehaviours

    def _body(self, method: str, f: RepoFile, headers: dict[str, str], fault: Fault | None) -> None:
        if method != "GET" or fault is not None:
            return super()._body(method, f, headers, fault)
        rng = self.headers.get("Range")
        rule = self.unruly.take(unquote(urlsplit(self.path).path), rng)
        if rule is None:
            return super()._body(method, f, headers, fault)
        if rule.kind == "retry_after":
            self._error(429, "TooManyRequests", "slow down", {"Retry-After": rule.retry_after})
            rule.hits.append(time.monotonic())
            return None
        start = 0
        spec = (rng or "").strip().removeprefix("bytes=")
        if rng and rule.kind != "ignore_range":
            start = int(spec.split("-")[0] or 0)
            headers = {**headers, "Content-Range": f"bytes {start}-{f.size - 1}/{f.size}"}
        length = f.size - start
        announced: int | None = length
        send, junk, close = length, 0, False
        if rule.kind == "drop":
            send, close = min(rule.after, length), True
        elif rule.kind == "short":
            send, close = max(length - rule.after, 0), True
        elif rule.kind == "long":
            junk = rule.after
        elif rule.kind == "overlong":
            announced, junk = length + rule.after, rule.after
        elif rule.kind == "unannounced":
            announced, junk, close = None, rule.after, True
        status = 206 if "Content-Range" in headers else 200
        extra = (
            {"Content-Length": str(announced)} if announced is not None else {"Connection": "close"}
        )
        self._start(
            status,
            {
                **headers,
                **extra,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            },
        )
        with open(f.source, "rb") as src:
            src.seek(start)
            self.wfile.write(src.read(send) + b"\0" * junk)
            self._sent = send + junk
        self.wfile.flush()
        rule.hits.append(time.monotonic())
        if close or announced is None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
        return None


class UnrulyHub(HubServer):
    """The local Hub with switches for misbehaviour (`misbehave`), off until a test sets one."""

    def __init__(self) -> None:
        super().__init__()
        self.unruly = Misbehaviours()

    def _listen(self, role: str) -> str:
        handler = type(
            f"{role}UnrulyHandler",
            (_UnrulyHandler,),
            {"state": self.state, "role": role, "unruly": self.unruly},
        )
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        thread.start()
        self._servers.append(server)
        self._threads.append(thread)
        return f"http://127.0.0.1:{server.server_address[1]}"

    def misbehave(self, match: str, kind: str, **kw: Any) -> Misbehaviour:
        rule = Misbehaviour(match, kind, **kw)
        with self.unruly.lock:
            self.unruly.rules.append(rule)
        return rule


@pytest.fixture(scope="session")
def hub_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    return build_files(assets_or_skip(STORIES), tmp_path_factory.mktemp("hub-files"))


def _serve(
    server: HubServer,
    hub_files: dict[str, dict[str, Path]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[HubServer]:
    import huggingface_hub.constants as constants

    with server:
        populate(server, hub_files)
        for key, value in server.env().items():
            if key != "HOME":
                monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token stored on this machine
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        yield server


@pytest.fixture
def hub(
    hub_files: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[HubServer]:
    """The local Hub, online: HF_ENDPOINT points at it, offline mode off, no stored token."""
    yield from _serve(HubServer(), hub_files, tmp_path, monkeypatch)


@pytest.fixture
def unruly_hub(
    hub_files: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[UnrulyHub]:
    """The local Hub as `hub` sets it up, with `misbehave(match, kind, ...)` switches."""
    server = UnrulyHub()
    yield from _serve(server, hub_files, tmp_path, monkeypatch)  # type: ignore[misc]
