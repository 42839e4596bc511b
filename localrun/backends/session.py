"""The parent side of engine isolation: a loaded model as a Session whose engine loop runs in a
worker process (worker.py). Many threads (or one asyncio loop) share it; each request has an id,
and the worker's messages are routed to the request they belong to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from localrun.backends.base import Cancel, Embeddings, Ranked, RowResult, TokenCounts
from localrun.backends.channel import error_from_wire
from localrun.backends.isolation import Child
from localrun.errors import EngineCrashedError, EngineError, LocalrunError
from localrun.generation import Chunk, Request, TokenLogprob
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo

_EARLY: list[Child] = []  # engine processes started early, not yet taken
_EARLY_LOCK = threading.Lock()


def _take_early() -> Child | None:
    with _EARLY_LOCK:
        child = _EARLY.pop() if _EARLY else None
    return child if child is not None and child.alive else None


@contextlib.contextmanager
def early_worker(guess: Callable[[], str | None]) -> Iterator[None]:
    """Start an engine process now, for the first model loaded in the block; one not taken is
    closed at its end.

    A one-shot command (run) starts it before finding its model, so the process's start (the
    interpreter and the engine loop's modules, about 0.15 s) overlaps with the command's own work
    instead of following it. `guess()`, asked once the process is starting, names the engine whose
    libraries it imports while it waits for its model (None: none)."""
    child = Child("localrun.backends.worker")
    backend = guess()
    if backend:
        child.send({"op": "warm", "backend": backend})
    with _EARLY_LOCK:
        _EARLY.append(child)
    try:
        yield
    finally:
        with _EARLY_LOCK:
            unused = child in _EARLY
            if unused:
                _EARLY.remove(child)
        if unused:
            child.close()


class WorkerSession:
    """A model loaded in a child process, running its engine loop; safe to use from many threads."""

    def __init__(self, backend: str, model: ModelInfo, options: LoadOptions, event_loop: Any = None) -> None:
        """Start the worker and load the model. With an asyncio event_loop, that loop reads the
        worker's messages (the server); else the threads waiting for them take turns reading, so
        a lone stream reads its own tokens with no thread hop (run, the TUI)."""
        self.backend = backend
        self.model = model
        self.options = options
        self.child = _take_early() or Child("localrun.backends.worker")
        self.child.name = f"the {backend} engine"
        self.proc, self.chan, self.stderr_tail = self.child.proc, self.child.chan, self.child.stderr_tail
        self._send_lock = threading.Lock()
        self._queues: dict[int, queue.SimpleQueue[Any]] = {}
        self._ids = itertools.count(1)
        self._dead: EngineCrashedError | None = None
        self.stats = (0, 0)  # prompt and completion tokens evaluated, as the worker last reported
        # the experts the store read from the model's headers (--cpu-moe's overrides), so the worker parses none
        sent = {**model.to_dict(), "details": {k: v for k, v in model.details.items() if k in ("experts", "mmproj")}}
        self.chan.send({"op": "load", "i": 0, "backend": backend, "model": sent, "options": options.to_dict()})
        msg = None
        while msg is None:
            msg = self.chan.recv()
            if msg is None and self.chan.eof:
                raise self._crashed("loading")
        if "error" in msg:
            self.close()
            raise error_from_wire(msg["error"])
        self._info: dict[str, Any] = dict(msg.get("ok") or {})
        self._read_lock = threading.Lock()
        self._event_loop = event_loop
        if event_loop is not None:
            event_loop.call_soon_threadsafe(event_loop.add_reader, self.chan.rfd, self._readable)

    # -- plumbing ---------------------------------------------------------------------------
    def _crashed(self, activity: str) -> EngineCrashedError:
        return self.child.crashed(f"{activity} model '{self.model.name}'",
                                  "the model file may be damaged or unsupported; localrun is still running, "
                                  "try again or another model")

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
                    raise error_from_wire(msg["error"])
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

    def embed(self, texts: list[str | list[int]]) -> Embeddings:
        out = self._call("embed", list(texts))
        return Embeddings(out["vectors"], out["prompt_tokens"])

    def rerank(self, query: str, documents: list[str]) -> Ranked:
        out = self._call("rerank", query, list(documents))
        return Ranked(out["scores"], out["prompt_tokens"])

    def start(self, request: Request, params: GenerationParams, deliver: Callable[[Chunk], None],
              stream: bool = True, report: bool = False) -> Ticket:
        """Submit a request whose chunks are handed to `deliver` on the engine's reader thread as
        they arrive (no thread of the caller wakes per token: the server's path). With stream
        False the engine keeps the reply until it ends and sends it in one message (one text chunk,
        then the final one): a reply nobody reads as it grows costs no message per token. With
        report, a first empty chunk says the prompt's size and cached part when it is admitted."""
        ticket = Ticket(self)
        rid, _ = self._open(_Delivery(deliver, ticket))  # type: ignore[arg-type]
        ticket.rid = rid
        self._send({"op": "submit", "i": rid, "request": request.to_dict(), "params": params.to_dict(),
                    "stream": stream, "report": report})
        return ticket

    def cancel_request(self, rid: int) -> None:
        """Ask the engine to stop one request (its last chunk still comes)."""
        self._send({"op": "cancel", "i": rid})

    def forget(self, rid: int) -> None:
        """The request ended: its messages have nowhere to go."""
        self._queues.pop(rid, None)

    def wait_for(self, done: threading.Event, timeout: float | None) -> None:
        """Wait until done is set or timeout passes, reading the worker's messages meanwhile
        unless an event loop (or another thread) reads them."""
        end = None if timeout is None else time.monotonic() + timeout
        while not done.is_set():
            left = 0.5 if end is None else end - time.monotonic()
            if left <= 0:
                return
            if self._event_loop is not None:
                done.wait(left)
            elif not self._pump(min(left, 0.5)):
                done.wait(min(left, 0.005))

    def stream(self, request: Request, params: GenerationParams, cancel: Cancel | None = None) -> Generator[Chunk, None, None]:
        q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        ticket = self.start(request, params, q.put)
        finished = False
        try:
            while True:
                try:
                    if cancel is not None and cancel.is_set():
                        ticket.cancel()
                    chunk = self._get(q, 0.05 if cancel is not None and not ticket.cancelled else 0.5)
                except KeyboardInterrupt:
                    ticket.cancel()  # Ctrl-C stops the reply and keeps the engine (it ignores SIGINT)
                    continue
                if chunk is None:
                    if ticket.done.is_set() and q.empty():
                        finished = True
                        if ticket.error is not None:
                            raise ticket.error
                    continue
                yield chunk
                if chunk.done:
                    finished = True
                    return
        finally:
            if not finished:
                ticket.cancel()  # the consumer stopped early

    def generate_many(self, rows: list[tuple[Any, Request, GenerationParams]],
                      cancel: Cancel | None = None) -> Iterator[RowResult | TokenCounts]:
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

        def stop() -> None:
            nonlocal cancelled
            if not cancelled:
                cancelled = True
                for rid in inflight:
                    self._send({"op": "cancel", "i": rid})

        try:
            submit_more()
            while inflight:
                try:
                    if cancel is not None and cancel.is_set():
                        stop()
                    msg = self._get(q, 0.25)
                except KeyboardInterrupt:
                    stop()
                    continue
                if isinstance(msg, LocalrunError):
                    raise msg
                if msg is not None:
                    rid = msg["i"]
                    row_id = inflight.pop(rid)
                    self._queues.pop(rid, None)
                    if "error" in msg:
                        yield RowResult(row_id, error=str(error_from_wire(msg["error"])))
                    else:
                        c = msg["chunk"]
                        if c["finish_reason"] != "cancelled":
                            yield RowResult(row_id, msg.get("text") or "", c["finish_reason"], c["prompt_tokens"],
                                            c["completion_tokens"], c["seed"], c.get("cached_tokens", 0),
                                            thinking=c.get("thinking", ""), thinking_tokens=c.get("thinking_tokens", 0),
                                            drafted_tokens=c.get("drafted_tokens", 0),
                                            accepted_tokens=c.get("accepted_tokens", 0))
                    submit_more()
                if self.stats != last_stats:
                    last_stats = self.stats
                    yield TokenCounts(*last_stats)
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
        self.child.close()

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()


class Ticket:
    """A request submitted with WorkerSession.start: cancel it, wait for its end."""

    def __init__(self, session: WorkerSession) -> None:
        self._session = session
        self.rid = 0
        self.cancelled = False
        self.done = threading.Event()
        self.error: LocalrunError | None = None
        self.final: Chunk | None = None

    def cancel(self) -> None:
        """Stop the request; its last chunk (finish_reason "cancelled") is still delivered."""
        if not self.done.is_set() and not self.cancelled:
            self.cancelled = True
            self._session.cancel_request(self.rid)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the end (reading the worker's messages meanwhile unless an event loop does)."""
        self._session.wait_for(self.done, timeout)
        return self.done.is_set()

    def ended(self) -> None:
        """The last message came: nothing more is routed to it."""
        self._session.forget(self.rid)
        self.done.set()


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
            counts = msg.get("p")
            if counts is not None:  # admitted: an empty chunk with the prompt's counts
                self.deliver(Chunk(prompt_tokens=counts[0], cached_tokens=counts[1]))
                return
            text = msg.get("t")
            if text is not None:
                lps = msg.get("l")
                self.deliver(Chunk(text=text, thinking=msg.get("r", ""),
                                   logprobs=tuple(TokenLogprob.from_list(x) for x in lps) if lps else ()))
                return
            if "error" in msg:
                t.error = error_from_wire(msg["error"])
            else:
                final = Chunk.from_dict(msg["chunk"])
                whole = msg.get("text")
                if whole is not None:  # a reply that was not streamed: its text, as one chunk
                    lps = msg.get("l")
                    self.deliver(Chunk(text=whole, thinking=final.thinking,
                                       logprobs=tuple(TokenLogprob.from_list(x) for x in lps) if lps else ()))
                    final = dataclasses.replace(final, thinking="")
                t.final = final
                self.deliver(final)
        t.ended()
