"""Engine isolation: every engine runs in a worker process.

A native engine can abort the whole process on a bad file (llama.cpp throws std::out_of_range
from tokenization, for one), so localrun talks to it over pipes, as Ollama and LM Studio do:
a crash becomes an EngineCrashedError and the caller keeps running.

Protocol: one JSON object per line. Parent -> worker: {"op": "load" | "stream" | "batch" |
"cancel" | "call" | "close", ...}. Worker -> parent: {"ok": ...}, {"t": text} then {"chunk": {...}}
(stream), {"r": row} / {"p": [prompt, completion tokens]} then {"done": {...}} (batch), or
{"error": {...}}.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Generator, Iterator
from contextlib import closing
from typing import Any

from localrun import errors
from localrun.backends.base import Cancel
from localrun.errors import EngineCrashedError, EngineError, LocalrunError
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request
from localrun.store import ModelInfo


class _Channel:
    """Newline-delimited JSON over a pair of raw file descriptors."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.buf = b""
        self.lines: deque[bytes] = deque()
        self.eof = False

    def send(self, obj: Any) -> None:
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            n = os.write(self.wfd, view)
            view = view[n:]

    def _fill(self, timeout: float | None) -> None:
        if timeout is not None:
            ready, _, _ = select.select([self.rfd], [], [], timeout)
            if not ready:
                return
        data = os.read(self.rfd, 1 << 16)
        if not data:
            self.eof = True
            return
        self.buf += data
        if b"\n" in self.buf:
            *complete, self.buf = self.buf.split(b"\n")
            self.lines.extend(complete)

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; None on timeout or end of stream (check .eof)."""
        if not self.lines and not self.eof:
            self._fill(timeout)
        if self.lines:
            return json.loads(self.lines.popleft())
        return None


def _error_payload(e: BaseException) -> dict[str, Any]:
    if isinstance(e, LocalrunError):
        return {"type": type(e).__name__, "message": e.message, "hint": e.hint}
    return {"type": "EngineError", "message": f"{type(e).__name__}: {e}", "hint": None}


def _raise_payload(p: dict[str, Any]) -> None:
    cls = getattr(errors, p.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, LocalrunError)):
        cls = EngineError
    raise cls(p.get("message", "engine error"), p.get("hint"))


# -- parent side -------------------------------------------------------------------------------


class WorkerSession:
    """A Session whose engine lives in a child process."""

    def __init__(self, backend: str, model: ModelInfo, options: LoadOptions) -> None:
        self.backend = backend
        self.model = model
        self.stderr_tail: deque[str] = deque(maxlen=50)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localrun.backends.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.chan = _Channel(self.proc.stdout.fileno(), self.proc.stdin.fileno())
        self._stderr_thread = threading.Thread(target=self._drain_stderr, daemon=True)
        self._stderr_thread.start()
        self.busy = False
        self._info = self._call({"op": "load", "backend": backend, "model": model.to_dict(), "options": options.to_dict()},
                                "loading the model")

    def _drain_stderr(self) -> None:
        assert self.proc.stderr
        debug = bool(os.environ.get("LOCALRUN_DEBUG"))
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip()
            self.stderr_tail.append(line)
            if debug:
                print(f"[engine] {line}", file=sys.stderr)

    def _crashed(self, activity: str) -> EngineCrashedError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        reason = ""
        for line in reversed(self.stderr_tail):
            if any(k in line for k in ("what()", "terminate called", "error", "Error", "GGML_ASSERT")):
                reason = line.strip()
                break
        detail = f"{how}{': ' + reason if reason else ''}"
        return EngineCrashedError(
            f"the {self.backend} engine crashed while {activity} model '{self.model.name}' ({detail})",
            "the model file may be damaged or unsupported; localrun is still running, try another model",
        )

    def _recv(self, activity: str, timeout: float | None = None) -> Any:
        msg = self.chan.recv(timeout)
        if msg is None and self.chan.eof:
            raise self._crashed(activity)
        return msg

    def _call(self, message: dict[str, Any], activity: str) -> Any:
        if self.proc.poll() is not None:
            raise EngineError("the engine process has stopped", "load the model again")
        self.chan.send(message)
        msg = self._recv(activity)
        if "error" in msg:
            _raise_payload(msg["error"])
        return msg.get("ok")

    def info(self) -> dict[str, Any]:
        return dict(self._info or {})

    def call(self, method: str, *args: Any) -> Any:
        """Run a named engine method in the worker (e.g. tokenize)."""
        return self._call({"op": "call", "method": method, "args": list(args)}, f"running {method} on")

    def _exchange(self, request: dict[str, Any], cancel: Cancel | None) -> Generator[dict[str, Any], None, None]:
        """Send one generation request and yield the worker's messages up to the final one
        ("chunk" or "done"). A set cancel or Ctrl-C stops the engine between tokens; a consumer
        that stops early cancels and drains, so the next request starts clean."""
        if self.busy:
            raise EngineError("this model is already generating", "wait for the reply to finish")
        if self.proc.poll() is not None:
            raise EngineError("the engine process has stopped", "load the model again")
        self.busy = True
        self.chan.send(request)
        cancelled = finished = False
        try:
            while True:
                try:
                    if not cancelled and cancel is not None and cancel.is_set():
                        cancelled = True
                        self.chan.send({"op": "cancel"})
                    msg = self._recv("generating with", 0.05 if cancel is not None and not cancelled else None)
                except KeyboardInterrupt:
                    # Ctrl-C: stop the reply, keep the engine (it ignores SIGINT).
                    if not cancelled:
                        cancelled = True
                        self.chan.send({"op": "cancel"})
                    continue
                if msg is None:
                    continue
                if "error" in msg:
                    finished = True
                    _raise_payload(msg["error"])
                finished = "chunk" in msg or "done" in msg
                yield msg
                if finished:
                    return
        except GeneratorExit:
            if not finished:
                self.chan.send({"op": "cancel"})
                while True:
                    msg = self._recv("generating with")
                    if "error" in msg or "chunk" in msg or "done" in msg:
                        break
            raise
        finally:
            self.busy = False

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Iterator[Chunk]:
        message = {"op": "stream", "request": request.to_dict(), "params": params.to_dict()}
        with closing(self._exchange(message, cancel)) as messages:
            for msg in messages:
                text = msg.get("t")
                yield Chunk(text=text) if text is not None else Chunk.from_dict(msg["chunk"])

    def batch(self, rows: list[dict[str, Any]], params: GenerationParams,
              cancel: Cancel | None = None) -> Iterator[dict[str, Any]]:
        """Generate many rows concurrently in the engine; yields events as rows finish.

        rows are {"id", "request", "params"?} (params: a full GenerationParams dict overriding
        `params`); events are {"row": {"id", "text", ...} | {"id", "error"}},
        {"progress": {"prompt_tokens", "completion_tokens"}} and a last {"done": {...}}.
        When cancel is set (or on Ctrl-C) the engine stops; rows it finished are still yielded.
        """
        message = {"op": "batch", "rows": rows, "params": params.to_dict()}
        with closing(self._exchange(message, cancel)) as messages:
            for msg in messages:
                if "r" in msg:
                    yield {"row": msg["r"]}
                elif "p" in msg:
                    yield {"progress": {"prompt_tokens": msg["p"][0], "completion_tokens": msg["p"][1]}}
                elif "done" in msg:
                    yield {"done": msg["done"]}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.chan.send({"op": "close"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._stderr_thread.join(timeout=5)  # it ends at EOF; closing its file under it would race
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f:
                f.close()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


# -- worker side -------------------------------------------------------------------------------


class _PipeCancel:
    """Cancel flag that polls the parent's pipe between tokens."""

    def __init__(self, chan: _Channel) -> None:
        self.chan = chan
        self.flag = False

    def is_set(self) -> bool:
        if not self.flag:
            msg = self.chan.recv(0)
            if msg is not None and msg.get("op") == "cancel":
                self.flag = True
            elif self.chan.eof:
                self.flag = True
        return self.flag


def _batch_events(session: Any, rows: list[dict[str, Any]], params: dict[str, Any],
                  cancel: _PipeCancel, n_parallel: int) -> Iterator[dict[str, Any]]:
    """The session's batch events; engines whose batch() returns every result at once (MLX) run
    groups of n_parallel rows with the same settings, so finished groups come back as they end."""
    import inspect
    import time

    if inspect.isgeneratorfunction(type(session).batch):
        yield from session.batch(rows, params, cancel)
        return
    t0 = time.perf_counter()
    size = max(1, n_parallel)
    totals = [0, 0]
    i = 0
    while i < len(rows) and not cancel.is_set():
        group = [rows[i]]
        while len(group) < size and i + len(group) < len(rows) and \
                rows[i + len(group)].get("params") == rows[i].get("params"):
            group.append(rows[i + len(group)])
        i += len(group)
        gp = group[0].get("params") or params
        try:
            results = session.batch([r["request"] for r in group], gp, cancel)
        except LocalrunError:
            if len(group) == 1:
                raise
            # One bad row fails the whole group: run them one by one to find it.
            results = []
            for r in group:
                try:
                    results.extend(session.batch([r["request"]], gp, cancel))
                except LocalrunError as e:
                    results.append({"error": str(e)})
        if cancel.is_set():
            break
        for r, res in zip(group, results, strict=True):
            totals[0] += res.get("prompt_tokens", 0)
            totals[1] += res.get("completion_tokens", 0)
            yield {"row": {"id": r.get("id"), **res}}
        yield {"progress": {"prompt_tokens": totals[0], "completion_tokens": totals[1]}}
    yield {"done": {"prompt_tokens": totals[0], "completion_tokens": totals[1], "reused_tokens": 0,
                    "cancelled": cancel.is_set(), "seconds": time.perf_counter() - t0}}


def serve() -> None:
    """The worker's main loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which cancels
    proto = os.dup(1)
    os.dup2(2, 1)  # stray prints from native code must not corrupt the protocol
    chan = _Channel(0, proto)
    session: Any = None
    n_parallel = 1
    while True:
        msg = chan.recv()
        if msg is None:
            if chan.eof:
                break
            continue
        op = msg.get("op")
        try:
            if op == "load":
                from localrun.backends.base import get_backend

                model = ModelInfo(**msg["model"])
                options = LoadOptions(**msg["options"])
                session = get_backend(msg["backend"]).load(model, options)
                n_parallel = options.n_parallel
                chan.send({"ok": session.info()})
            elif op == "stream":
                cancel = _PipeCancel(chan)
                send = chan.send
                for chunk in session.stream(Request.from_dict(msg["request"]),
                                            GenerationParams.from_dict(msg["params"]), cancel):
                    if not chunk.done:
                        send({"t": chunk.text})  # the per-token message stays tiny
                        continue
                    final = chunk.to_dict()
                    if cancel.flag:
                        final["finish_reason"] = "cancelled"
                    send({"chunk": final})
            elif op == "batch":
                cancel = _PipeCancel(chan)
                send = chan.send
                for event in _batch_events(session, msg["rows"], msg["params"], cancel, n_parallel):
                    if "row" in event:
                        send({"r": event["row"]})
                    elif "progress" in event:
                        p = event["progress"]
                        send({"p": [p["prompt_tokens"], p["completion_tokens"]]})
                    else:
                        send({"done": {**event["done"], "cancelled": cancel.flag}})
            elif op == "call":
                chan.send({"ok": getattr(session, msg["method"])(*msg.get("args", []))})
            elif op == "system_info":
                from localrun.backends.base import get_backend

                backend = get_backend(msg["backend"])
                chan.send({"ok": backend.system_info()})  # type: ignore[attr-defined]
            elif op == "cancel":
                continue  # arrived after the reply ended
            elif op == "close":
                break
            else:
                chan.send({"error": {"type": "EngineError", "message": f"unknown op {op!r}"}})
        except Exception as e:  # noqa: BLE001 - every failure goes back to the parent
            chan.send({"error": _error_payload(e)})
    if session is not None:
        session.close()


if __name__ == "__main__":
    serve()
