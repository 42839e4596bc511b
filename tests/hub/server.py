"""A local Hugging Face Hub: the endpoints and headers huggingface_hub 2.4.0 uses, with faults.

Two listening sockets share one state: the "hub" (API, `resolve`) and a "CDN" on another port,
so LFS files are redirected cross-origin exactly as on huggingface.co (the redirect carries the
X-Linked-Etag / X-Linked-Size metadata and the Authorization header does not follow it).
Every request is logged with its Range header and the body bytes actually sent, so tests can prove
a resumed download fetched only what was missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

GOOD_TOKEN = "hf_test_good_token"
LFS_THRESHOLD = 1024  # files at least this big, or with a weights suffix, are served as LFS
PAUSE_MAX_S = 600  # a paused transfer waits this long at most for its test to release it
_WEIGHTS = (".gguf", ".safetensors", ".bin", ".pth", ".onnx", ".pt")


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@dataclass
class RepoFile:
    path: str
    source: Path  # the bytes served
    size: int
    lfs: bool
    sha256: str | None  # LFS files
    blob_id: str  # git oid: of the pointer file for LFS, of the content otherwise


@dataclass
class Repo:
    repo_id: str
    files: dict[str, RepoFile]
    sha: str
    tags: list[str] = field(default_factory=list)
    gated: str | bool = False
    downloads: int = 0
    likes: int = 0
    last_modified: str = "2025-01-01T00:00:00.000Z"
    library_name: str | None = None

    def info(self, blobs: bool) -> dict[str, Any]:
        siblings = []
        for f in self.files.values():
            entry: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                entry.update({"size": f.size, "blobId": f.blob_id})
                if f.lfs:
                    entry["lfs"] = {"size": f.size, "sha256": f.sha256, "pointerSize": 134}
            siblings.append(entry)
        return {
            "_id": self.sha[:24], "id": self.repo_id, "modelId": self.repo_id, "author": self.repo_id.split("/")[0],
            "sha": self.sha, "lastModified": self.last_modified, "createdAt": "2024-06-01T00:00:00.000Z",
            "private": False, "gated": self.gated, "disabled": False, "downloads": self.downloads,
            "likes": self.likes, "tags": self.tags, "library_name": self.library_name, "siblings": siblings,
        }

    def tree_entry(self, f: RepoFile) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
        if f.lfs:
            entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        return entry


@dataclass
class Fault:
    """A misbehaviour applied to the next `times` requests whose path contains `match`.

    kind: "drop" (close the connection after `after` body bytes), "corrupt" (flip bytes, same
    length), "status" (answer `status`), "pause" (send `after` bytes, then wait for `release`),
    "throttle" (send `after` bytes every `delay` seconds: a slow link).
    """

    match: str
    kind: str
    after: int = 0
    status: int = 500
    times: int = 1
    method: str = "GET"
    delay: float = 0.05
    release: threading.Event = field(default_factory=threading.Event)
    reached: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class LogEntry:
    port: str  # "hub" or "cdn"
    method: str
    path: str
    range: str | None
    status: int
    sent: int  # body bytes written to the socket
    auth: bool


class HubState:
    """Repositories, faults and the request log, shared by both sockets."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, RepoFile] = {}
        self.faults: list[Fault] = []
        self.log: list[LogEntry] = []
        self.lock = threading.Lock()
        self.cdn_url = ""

    def add_repo(self, repo_id: str, files: dict[str, Path], claimed_sizes: dict[str, int] | None = None,
                 **attrs: Any) -> Repo:
        entries = {}
        for path, source in files.items():
            size = (claimed_sizes or {}).get(path) or source.stat().st_size
            lfs = size >= LFS_THRESHOLD or path.endswith(_WEIGHTS)
            if lfs:
                sha = file_sha256(source)
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n".encode()
                entry = RepoFile(path, source, size, True, sha, git_blob_sha1(pointer))
                self.blobs[sha] = entry
            else:
                entry = RepoFile(path, source, size, False, None, git_blob_sha1(source.read_bytes()))
            entries[path] = entry
        sha = hashlib.sha1(repr(sorted((p, f.blob_id) for p, f in entries.items())).encode()).hexdigest()
        repo = Repo(repo_id, entries, sha, **attrs)
        self.repos[repo_id] = repo
        return repo

    def add_fault(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, method: str, path: str, ranged: bool) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.kind != "status" and ranged:
                    continue  # body faults hit whole-file downloads, not header reads or resumes
                if fault.times > 0 and fault.match in path and fault.method in (method, "*"):
                    fault.times -= 1
                    return fault
        return None

    def requests(self, contains: str = "", method: str | None = None) -> list[LogEntry]:
        with self.lock:
            return [e for e in self.log if contains in e.path and (method is None or e.method == method)]


_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+?)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LocalHub/1.0"
    state: HubState
    role: str

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    # -- plumbing --------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        query = parse_qs(url.query)
        self._sent = 0
        self._status = 0
        try:
            fault = self.state.take_fault(method, path, self.headers.get("Range") is not None)
            if fault is not None and fault.kind == "status":
                self._error(fault.status, "Injected", f"injected {fault.status}")
            elif self.role == "cdn":
                self._cdn(method, path, fault)
            else:
                self._hub(method, path, query, fault)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        finally:
            with self.state.lock:
                self.state.log.append(LogEntry(
                    self.role, method, path, self.headers.get("Range"), self._status, self._sent,
                    self.headers.get("Authorization") is not None,
                ))

    def _start(self, status: int, headers: dict[str, str]) -> None:
        self._status = status
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()

    def _json(self, obj: Any, headers: dict[str, str] | None = None) -> None:
        body = json.dumps(obj).encode()
        self._start(200, {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})})
        if self.command != "HEAD":
            self.wfile.write(body)
            self._sent = len(body)

    def _error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._start(status, {"Content-Type": "application/json", "Content-Length": str(len(body)),
                             "X-Error-Code": code, "X-Error-Message": message, **(headers or {})})
        if self.command != "HEAD":
            self.wfile.write(body)
            self._sent = len(body)

    # -- hub ---------------------------------------------------------------------------------
    def _hub(self, method: str, path: str, query: dict[str, list[str]], fault: Fault | None) -> None:
        if path == "/api/models":
            return self._search(query)
        m = _TREE.match(path)
        if m:
            repo = self._repo(m["repo"], m["rev"])
            if repo:
                prefix = (m["path"] or "").strip("/")
                files = [f for f in repo.files.values() if not prefix or f.path.startswith(prefix + "/")]
                self._json([repo.tree_entry(f) for f in files])
            return None
        m = _INFO.match(path)
        if m:
            repo = self._repo(m["repo"], m["rev"] or "main")
            if repo:
                self._json(repo.info(blobs=query.get("blobs", ["false"])[0].lower() == "true"))
            return None
        m = _RESOLVE.match(path)
        if m:
            return self._resolve(method, m["repo"], unquote(m["rev"]), m["file"], fault)
        return self._error(404, "NotFound", f"no route for {path}")

    def _repo(self, repo_id: str, rev: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404 if self._auth() else 401, "RepoNotFound", "Repository not found")
            return None
        if rev not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo

    def _auth(self) -> str | None:
        value = self.headers.get("Authorization", "")
        return value[len("Bearer "):] if value.startswith("Bearer ") else None

    def _search(self, query: dict[str, list[str]]) -> None:
        term = (query.get("search") or [""])[0].lower()
        filters = query.get("filter", [])
        repos = [r for r in self.state.repos.values()
                 if term in r.repo_id.lower() and all(f in r.tags for f in filters)]
        sort = (query.get("sort") or [""])[0]
        key = {"downloads": "downloads", "likes": "likes", "lastModified": "lastModified"}.get(sort)
        infos = [r.info(blobs=False) for r in repos]
        for info in infos:
            info.pop("siblings")
        if key:
            infos.sort(key=lambda i: i[key], reverse=True)
        limit = int((query.get("limit") or ["1000"])[0])
        self._json(infos[:limit])

    def _resolve(self, method: str, repo_id: str, rev: str, filename: str, fault: Fault | None) -> None:
        repo = self._repo(repo_id, rev)
        if repo is None:
            return
        if repo.gated:
            token = self._auth()
            if token is None:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access"
                                   " to it and be authenticated to access it. Please log in.")
            if token != GOOD_TOKEN:
                return self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted and you are not in"
                                   f" the authorized list. Visit https://huggingface.co/{repo_id} to ask for access.")
        f = repo.files.get(filename)
        commit = {"X-Repo-Commit": repo.sha}
        if f is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{rev}\"", commit)
        if f.lfs:
            location = f"{self.state.cdn_url}/lfs/{f.sha256}?name={filename.rsplit('/', 1)[-1]}"
            self._start(302, {**commit, "Location": location, "ETag": f'"{f.blob_id}"',
                              "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
                              "Content-Length": "0"})
            return None
        return self._body(method, f, {**commit, "ETag": f'"{f.blob_id}"'}, fault)

    # -- CDN ----------------------------------------------------------------------------------
    def _cdn(self, method: str, path: str, fault: Fault | None) -> None:
        sha = path.rsplit("/", 1)[-1]
        f = self.state.blobs.get(sha)
        if not path.startswith("/lfs/") or f is None:
            return self._error(404, "NotFound", "no such object")
        return self._body(method, f, {"ETag": f'"{f.sha256}"'}, fault)

    def _body(self, method: str, f: RepoFile, headers: dict[str, str], fault: Fault | None) -> None:
        start, end = 0, f.size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (m[1] == "" and m[2] == ""):
                return self._error(400, "BadRange", f"bad range {rng}")
            if m[1] == "":
                start, end = max(f.size - int(m[2]), 0), f.size - 1
            else:
                start = int(m[1])
                end = min(int(m[2]), f.size - 1) if m[2] else f.size - 1
            if start >= f.size or start > end:
                return self._error(416, "RangeNotSatisfiable", "range not satisfiable",
                                   {"Content-Range": f"bytes */{f.size}"})
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{f.size}"}
        length = end - start + 1
        self._start(status, {**headers, "Content-Length": str(length), "Accept-Ranges": "bytes",
                             "Content-Type": "application/octet-stream"})
        if method == "HEAD":
            return None
        with open(f.source, "rb") as src:
            if fault is None:
                self.wfile.flush()
                self._sent = self.connection.sendfile(src, start, length)
                return None
            src.seek(start)
            limit = length if fault.kind in ("corrupt", "throttle") else min(fault.after, length)
            step = fault.after if fault.kind == "throttle" else 1 << 16
            while self._sent < limit:
                if fault.kind == "throttle" and self._sent:
                    self.wfile.flush()
                    time.sleep(fault.delay)  # the slow link itself, not synchronisation
                block = src.read(min(step, limit - self._sent))
                if fault.kind == "corrupt" and self._sent == 0:
                    block = bytes(b ^ 0xFF for b in block[:64]) + block[64:]
                self.wfile.write(block)
                self._sent += len(block)
            self.wfile.flush()
            if fault.kind == "pause":
                fault.reached.set()
                fault.release.wait(PAUSE_MAX_S)  # the test releases it; this only bounds a crashed one
            if fault.kind in ("drop", "pause"):
                # Close mid-body: the client sees a short read, as with a dropped connection.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
        return None


class HubServer:
    """Start with `with HubServer() as hub:`; `hub.url` goes in HF_ENDPOINT."""

    def __init__(self) -> None:
        self.state = HubState()
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []

    def _listen(self, role: str) -> str:
        handler = type(f"{role}Handler", (_Handler,), {"state": self.state, "role": role})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        thread.start()
        self._servers.append(server)
        self._threads.append(thread)
        return f"http://127.0.0.1:{server.server_address[1]}"

    def start(self) -> HubServer:
        self.url = self._listen("hub")
        self.state.cdn_url = self._listen("cdn")
        return self

    def stop(self) -> None:
        for fault in self.state.faults:
            fault.release.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # conveniences for tests
    def add_repo(self, repo_id: str, files: dict[str, Path], **attrs: Any) -> Repo:
        return self.state.add_repo(repo_id, files, **attrs)

    def sha256(self, repo_id: str, path: str) -> str:
        sha = self.state.repos[repo_id].files[path].sha256
        assert sha is not None
        return sha

    def fault(self, match: str, kind: str, **kw: Any) -> Fault:
        return self.state.add_fault(Fault(match, kind, **kw))

    def requests(self, contains: str = "", method: str | None = None) -> list[LogEntry]:
        return self.state.requests(contains, method)

    def env(self) -> dict[str, str]:
        """Environment for a child process that talks to this server."""
        return {"HF_ENDPOINT": self.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
                "HF_HUB_DISABLE_XET": "1", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1",
                "HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "10",
                "HOME": os.environ.get("HOME", "/tmp")}
