"""Engine isolation: every engine runs in a worker process.

A native engine can abort the whole process on a bad file (llama.cpp throws std::out_of_range
from tokenization, for one), so localrun talks to it over pipes, as Ollama and LM Studio do:
a crash becomes an EngineCrashedError and the caller keeps running.

The worker runs the model's engine loop (loop.py); many requests are in flight at once, each
with its own id. Protocol: one JSON object per line. Parent -> worker: {"op": "load" | "submit" |
"cancel" | "call" | "close", "i": id, ...}. Worker -> parent: {"i": id, "t": text, "l"?: logprobs}
while a reply streams, then {"i": id, "chunk": final, "text"?: whole reply}; {"i": id, "ok": value}
for calls; {"i": id, "error": {...}}; and {"s": [prompt, completion tokens]} (totals, every
0.25 s while a batch runs).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

from localrun import errors
from localrun.backends.base import Cancel, Embeddings
from localrun.errors import EngineCrashedError, EngineError, LocalrunError
from localrun.generation import Chunk, GenerationParams, LoadOptions, Request, TokenLogprob
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
        while not self.lines and not self.eof:
            self._fill(timeout)
            if timeout is not None:
                break
        if self.lines:
            return json.loads(self.lines.popleft())
        return None

    def recv_all(self, timeout: float | None) -> list[Any]:
        """Every message that has arrived (waiting up to timeout for one; None: until one comes)."""
        if not self.lines and not self.eof:
            self._fill(timeout)
            while timeout is None and not self.lines and not self.eof:
                self._fill(None)
        out = [json.loads(line) for line in self.lines]
        self.lines.clear()
        return out


def _error_payload(e: BaseException) -> dict[str, Any]:
    if isinstance(e, LocalrunError):
        return {"type": type(e).__name__, "message": e.message, "hint": e.hint}
    return {"type": "EngineError", "message": f"{type(e).__name__}: {e}", "hint": None}


def _raise_payload(p: dict[str, Any]) -> None:
    cls = getattr(errors, p.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, LocalrunError)):
        cls = EngineError
    raise cls(p.get("message", "engine error"), p.get("hint"))


def _payload_error(p: dict[str, Any]) -> LocalrunError:
    try:
        _raise_payload(p)
    except LocalrunError as e:
        return e
    raise AssertionError("unreachable")


# -- parent side -------------------------------------------------------------------------------


class WorkerSession:
    """A model loaded in a child process, running its engine loop; safe to use from many threads."""

    def __init__(self, backend: str, model: ModelInfo, options: LoadOptions, event_loop: Any = None) -> None:
        """Start the worker and load the model. With an asyncio event_loop, that loop reads the
        worker's messages (the server); else the threads waiting for them take turns reading, so
        a lone stream reads its own tokens with no thread hop (run, the TUI)."""
        self.backend = backend
        self.model = model
        self.options = options
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
        self._send_lock = threading.Lock()
        self._queues: dict[int, queue.SimpleQueue[Any]] = {}
        self._ids = itertools.count(1)
        self._dead: EngineCrashedError | None = None
        self.stats = (0, 0)  # prompt and completion tokens evaluated, as the worker last reported
        self.chan.send({"op": "load", "i": 0, "backend": backend, "model": model.to_dict(), "options": options.to_dict()})
        msg = None
        while msg is None:
            msg = self.chan.recv()
            if msg is None and self.chan.eof:
                raise self._crashed("loading")
        if "error" in msg:
            self.close()
            _raise_payload(msg["error"])
        self._info: dict[str, Any] = dict(msg.get("ok") or {})
        self._read_lock = threading.Lock()
        self._event_loop = event_loop
        if event_loop is not None:
            event_loop.call_soon_threadsafe(event_loop.add_reader, self.chan.rfd, self._readable)

    # -- plumbing ---------------------------------------------------------------------------
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
        self._stderr_thread.join(timeout=2)
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        reason = ""
        for line in reversed(self.stderr_tail):
            if any(k in line for k in ("what()", "terminate called", "error", "Error", "GGML_ASSERT")):
                reason = line.strip()
                break
        detail = f"{how}{': ' + reason if reason else ''}"
        return EngineCrashedError(
            f"the {self.backend} engine crashed while {activity} model '{self.model.name}' ({detail})",
            "the model file may be damaged or unsupported; localrun is still running, try again or another model",
        )

    def _dispatch(self, msg: dict[str, Any]) -> None:
        """Route one of the worker's messages to the request waiting for it."""
        rid = msg.get("i")
        if rid is None:
            if "s" in msg:
                self.stats = (msg["s"][0], msg["s"][1])
            return
        q = self._queues.get(rid)
        if q is not None:
            q.put(msg)

    def _pump(self, timeout: float) -> bool:
        """Read and route what the worker sent, waiting up to timeout; False if another thread
        is reading (it routes this thread's messages too)."""
        if not self._read_lock.acquire(blocking=False):
            return False
        try:
            chan = self.chan
            if chan.eof:
                return True
            for msg in chan.recv_all(timeout):
                self._dispatch(msg)
            if chan.eof:
                self._fail_all()
        finally:
            self._read_lock.release()
        return True

    def _readable(self) -> None:
        """The event loop's reader: everything that has arrived, without blocking."""
        chan = self.chan
        chan._fill(None)  # the fd is readable: one read returns what is there
        while chan.lines:
            self._dispatch(json.loads(chan.lines.popleft()))
        if chan.eof:
            self._event_loop.remove_reader(chan.rfd)
            threading.Thread(target=self._fail_all, daemon=True).start()  # waits for the process

    def _fail_all(self) -> None:
        queues = self._queues
        closing = self.proc.poll() is not None and self.proc.returncode == 0
        self._dead = EngineCrashedError(f"the {self.backend} engine of '{self.model.name}' was closed") \
            if closing else self._crashed("generating with")
        for q in list(queues.values()):
            q.put(self._dead)

    def _send(self, obj: dict[str, Any]) -> None:
        with self._send_lock:
            try:
                self.chan.send(obj)
            except OSError:
                pass  # the worker is gone; the reader reports it

    def _open(self, q: queue.SimpleQueue[Any] | None = None) -> tuple[int, queue.SimpleQueue[Any]]:
        if self._dead is not None:
            raise self._dead
        if self.proc.poll() is not None:
            raise EngineError("the engine process has stopped", "load the model again")
        rid = next(self._ids)
        q = q if q is not None else queue.SimpleQueue()
        self._queues[rid] = q
        return rid, q

    def _get(self, q: queue.SimpleQueue[Any], timeout: float) -> Any:
        """The next message for q, or None after about timeout."""
        try:
            return q.get_nowait()
        except queue.Empty:
            pass
        reading_elsewhere = self._event_loop is not None
        if not reading_elsewhere and self._pump(timeout):
            try:
                return q.get_nowait()
            except queue.Empty:
                return None
        try:  # another thread (or the event loop) reads: it hands our messages over
            return q.get(timeout=timeout if reading_elsewhere else min(timeout, 0.005))
        except queue.Empty:
            return None

    def _call(self, method: str, *args: Any) -> Any:
        rid, q = self._open()
        try:
            self._send({"op": "call", "i": rid, "method": method, "args": list(args)})
            while True:
                msg = self._get(q, 0.5)
                if isinstance(msg, LocalrunError):
                    raise msg
                if msg is None:
                    continue
                if "error" in msg:
                    _raise_payload(msg["error"])
                return msg.get("ok")
        finally:
            self._queues.pop(rid, None)

    # -- the Session protocol ---------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def tokenize(self, request: Request) -> list[int]:
        return list(self._call("tokenize", request.to_dict()))

    def embed(self, texts: list[str]) -> Embeddings:
        out = self._call("embed", list(texts))
        return Embeddings(out["vectors"], out["prompt_tokens"])

    def start(self, request: Request, params: GenerationParams, deliver: Callable[[Chunk], None]) -> Ticket:
        """Submit a request whose chunks are handed to `deliver` on the engine's reader thread as
        they arrive (no thread of the caller wakes per token: the server's path)."""
        ticket = Ticket(self)
        rid, _ = self._open(_Delivery(deliver, ticket))  # type: ignore[arg-type]
        ticket.rid = rid
        self._send({"op": "submit", "i": rid, "request": request.to_dict(), "params": params.to_dict()})
        return ticket

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Generator[Chunk, None, None]:
        rid, q = self._open()
        self._send({"op": "submit", "i": rid, "request": request.to_dict(), "params": params.to_dict()})
        cancelled = finished = False
        try:
            while True:
                try:
                    if not cancelled and cancel is not None and cancel.is_set():
                        cancelled = True
                        self._send({"op": "cancel", "i": rid})
                    msg = self._get(q, 0.05 if cancel is not None and not cancelled else 0.5)
                except KeyboardInterrupt:
                    # Ctrl-C: stop the reply, keep the engine (it ignores SIGINT).
                    if not cancelled:
                        cancelled = True
                        self._send({"op": "cancel", "i": rid})
                    continue
                if msg is None:
                    continue
                if isinstance(msg, LocalrunError):
                    finished = True
                    raise msg
                text = msg.get("t")
                if text is not None:
                    lps = msg.get("l")
                    yield Chunk(text=text, logprobs=tuple(TokenLogprob.from_list(x) for x in lps) if lps else ())
                    continue
                finished = True
                if "error" in msg:
                    _raise_payload(msg["error"])
                yield Chunk.from_dict(msg["chunk"])
                return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._send({"op": "cancel", "i": rid})  # the consumer stopped early

    def generate_many(self, rows: list[tuple[Any, Request, GenerationParams]],
                      cancel: Cancel | None = None) -> Iterator[dict[str, Any]]:
        """Run rows through the engine loop, a window of them in flight; yield each as it ends."""
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        window = max(2 * int(self._info.get("n_parallel") or 1), 8)
        pending = iter(rows)
        inflight: dict[int, Any] = {}
        last_stats = self.stats
        cancelled = False

        def submit_more() -> None:
            while not cancelled and len(inflight) < window:
                row = next(pending, None)
                if row is None:
                    return
                rid, _ = self._open(q)
                inflight[rid] = row[0]
                self._send({"op": "submit", "i": rid, "request": row[1].to_dict(), "params": row[2].to_dict(),
                            "stream": False})

        try:
            submit_more()
            while inflight:
                try:
                    if not cancelled and cancel is not None and cancel.is_set():
                        cancelled = True
                        for rid in inflight:
                            self._send({"op": "cancel", "i": rid})
                    msg = self._get(q, 0.25)
                except KeyboardInterrupt:
                    if not cancelled:
                        cancelled = True
                        for rid in inflight:
                            self._send({"op": "cancel", "i": rid})
                    continue
                if isinstance(msg, LocalrunError):
                    raise msg
                if msg is not None:
                    rid = msg["i"]
                    row_id = inflight.pop(rid)
                    self._queues.pop(rid, None)
                    if "error" in msg:
                        yield {"row": {"id": row_id, "error": str(_payload_error(msg["error"]))}}
                    else:
                        c = msg["chunk"]
                        if c["finish_reason"] != "cancelled":
                            yield {"row": {"id": row_id, "text": msg.get("text") or "", "finish_reason": c["finish_reason"],
                                           "prompt_tokens": c["prompt_tokens"], "completion_tokens": c["completion_tokens"],
                                           "seed": c["seed"], "cached_tokens": c.get("cached_tokens", 0)}}
                    submit_more()
                if self.stats != last_stats:
                    last_stats = self.stats
                    yield {"progress": {"prompt_tokens": last_stats[0], "completion_tokens": last_stats[1]}}
        finally:
            for rid in inflight:
                self._queues.pop(rid, None)
                self._send({"op": "cancel", "i": rid})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"op": "close"})
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        loop = getattr(self, "_event_loop", None)
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.remove_reader, self.chan.rfd)
            except RuntimeError:
                pass  # the loop has stopped
        self._stderr_thread.join(timeout=5)  # it ends at EOF; closing its file under it would race
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f:
                f.close()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


class Ticket:
    """A request submitted with WorkerSession.start: cancel it, wait for its end."""

    def __init__(self, session: WorkerSession) -> None:
        self.session = session
        self.rid = 0
        self.done = threading.Event()
        self.error: LocalrunError | None = None
        self.final: Chunk | None = None

    def cancel(self) -> None:
        """Stop the request; its last chunk (finish_reason "cancelled") is still delivered."""
        if not self.done.is_set():
            self.session._send({"op": "cancel", "i": self.rid})

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end (reading the worker's messages meanwhile unless an event loop does)."""
        s = self.session
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done.is_set():
            left = 0.5 if end is None else end - time.monotonic()
            if left <= 0:
                break
            if s._event_loop is not None:
                self.done.wait(left)
            elif not s._pump(min(left, 0.5)):
                self.done.wait(min(left, 0.005))
        return self.done.is_set()


class _Delivery:
    """Turns the worker's messages for one request into calls of a deliver callback."""

    __slots__ = ("deliver", "ticket")

    def __init__(self, deliver: Callable[[Chunk], None], ticket: Ticket) -> None:
        self.deliver, self.ticket = deliver, ticket

    def put(self, msg: Any) -> None:
        t = self.ticket
        if isinstance(msg, LocalrunError):
            t.error = msg
        else:
            text = msg.get("t")
            if text is not None:
                lps = msg.get("l")
                self.deliver(Chunk(text=text, logprobs=tuple(TokenLogprob.from_list(x) for x in lps) if lps else ()))
                return
            if "error" in msg:
                t.error = _payload_error(msg["error"])
            else:
                t.final = Chunk.from_dict(msg["chunk"])
                self.deliver(t.final)
        t.session._queues.pop(t.rid, None)
        t.done.set()


# -- worker side -------------------------------------------------------------------------------


class _PipeSink:
    """Sends the engine loop's output up the pipe; the per-token message stays tiny."""

    def __init__(self, chan: _Channel) -> None:
        self.send = chan.send

    def text(self, rid: Any, text: str, logprobs: list[TokenLogprob]) -> None:
        if logprobs:
            self.send({"i": rid, "t": text, "l": [lp.to_list() for lp in logprobs]})
        else:
            self.send({"i": rid, "t": text})

    def done(self, rid: Any, final: Chunk, text: str | None) -> None:
        d = final.to_dict()
        d.pop("extra", None)
        msg: dict[str, Any] = {"i": rid, "chunk": d}
        if text is not None:
            msg["text"] = text
        self.send(msg)

    def error(self, rid: Any, error: LocalrunError) -> None:
        self.send({"i": rid, "error": _error_payload(error)})


STATS_EVERY_S = 0.25


def serve() -> None:
    """The worker's main loop: read requests between engine steps, block when idle."""
    from localrun.backends.loop import EngineLoop

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which cancels
    proto = os.dup(1)
    os.dup2(2, 1)  # stray prints from native code must not corrupt the protocol
    chan = _Channel(0, proto)
    sink = _PipeSink(chan)
    engine: Any = None
    loop: EngineLoop | None = None
    last_stats = time.perf_counter()
    running = True
    while running:
        busy = loop is not None and loop.busy
        msgs = chan.recv_all(0 if busy else None)
        if not msgs and chan.eof:
            break
        for msg in msgs:
            op, rid = msg.get("op"), msg.get("i")
            try:
                if op == "submit" and loop is not None:
                    loop.submit(rid, Request.from_dict(msg["request"]), GenerationParams.from_dict(msg["params"]),
                                stream=msg.get("stream", True))
                elif op == "cancel" and loop is not None:
                    loop.cancel(rid)
                elif op == "call" and engine is not None:
                    chan.send({"i": rid, "ok": _call(engine, msg["method"], msg.get("args", []))})
                elif op == "load":
                    from localrun.backends.base import get_backend

                    options = LoadOptions(**msg["options"])
                    engine = get_backend(msg["backend"]).load(ModelInfo(**msg["model"]), options)
                    loop = EngineLoop(engine, sink, options.max_queue)
                    chan.send({"i": rid, "ok": engine.info()})
                elif op == "close":
                    running = False
                    break
                else:
                    chan.send({"i": rid, "error": {"type": "EngineError", "message": f"unexpected op {op!r}"}})
            except Exception as e:  # noqa: BLE001 - every failure goes back to the parent
                chan.send({"i": rid, "error": _error_payload(e)})
        if loop is not None and loop.busy and running:
            try:
                loop.step()
            except Exception as e:  # noqa: BLE001 - a bug must not leave requests hanging
                loop.fail_all(EngineError(f"the engine loop failed: {type(e).__name__}: {e}"))
            now = time.perf_counter()
            if now - last_stats >= STATS_EVERY_S:
                last_stats = now
                if any(not j.stream for j in loop.jobs.values()):
                    chan.send({"s": [loop.prompt_tokens, loop.completion_tokens]})
    if loop is not None:
        loop.cancel_all()
    if engine is not None:
        engine.close()


def _call(engine: Any, method: str, args: list[Any]) -> Any:
    if method == "tokenize":
        return engine.prompt_tokens(Request.from_dict(args[0]), [])
    if method == "embed":
        e = engine.embed(args[0])
        return {"vectors": e.vectors, "prompt_tokens": e.prompt_tokens}
    if method == "info":
        return engine.info()
    raise EngineError(f"unknown engine call {method!r}")


if __name__ == "__main__":
    serve()
