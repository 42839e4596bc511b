"""Engine isolation: every engine runs in a worker process (this module; the parent side is
session.py), started and read through isolation.py as every child process of localrun is, so a
crash becomes an EngineCrashedError and the caller keeps running.

The worker runs the model's engine loop (loop.py); many requests are in flight at once, each
with its own id. Protocol: one JSON object per line. Parent -> worker: {"op": "warm" | "load" | "submit" |
"cancel" | "call" | "close", "i": id, ...}. Worker -> parent: {"i": id, "t": text, "l"?: logprobs}
while a reply streams, then {"i": id, "chunk": final, "text"?: whole reply, "l"?: its logprobs}; {"i": id, "ok": value}
for calls; {"i": id, "error": {...}}; and {"s": [prompt, completion tokens]} (totals, every
0.25 s while a batch runs).
"""

from __future__ import annotations

import os
import time
from typing import Any

from localrun.backends.channel import Channel, Inbox, error_to_wire
from localrun.backends.isolation import child_channel
from localrun.errors import EngineError, LocalrunError
from localrun.generation import Chunk, Request, TokenLogprob
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo


class _PipeSink:
    """Sends the engine loop's output up the pipe; the per-token message stays tiny."""

    def __init__(self, chan: Channel) -> None:
        self.send = chan.send

    def text(self, rid: Any, text: str, logprobs: list[TokenLogprob], thinking: str = "") -> None:
        msg: dict[str, Any] = {"i": rid, "t": text}
        if logprobs:
            msg["l"] = [lp.to_list() for lp in logprobs]
        if thinking:
            msg["r"] = thinking
        self.send(msg)

    def done(self, rid: Any, final: Chunk, text: str | None, logprobs: list[TokenLogprob] | None = None) -> None:
        d = final.to_dict()
        d.pop("extra", None)
        msg: dict[str, Any] = {"i": rid, "chunk": d}
        if text is not None:
            msg["text"] = text
        if logprobs:
            msg["l"] = [lp.to_list() for lp in logprobs]
        self.send(msg)

    def error(self, rid: Any, error: LocalrunError) -> None:
        self.send({"i": rid, "error": error_to_wire(error)})

    def admitted(self, rid: Any, prompt_tokens: int, cached_tokens: int) -> None:
        self.send({"i": rid, "p": [prompt_tokens, cached_tokens]})


STATS_EVERY_S = 0.25


def serve() -> None:
    """The worker's main loop: read requests between engine steps, block when idle."""
    from localrun.backends.loop import EngineLoop

    chan = child_channel()
    inbox = Inbox(chan)
    sink = _PipeSink(chan)
    engine: Any = None
    loop: EngineLoop | None = None
    last_stats = time.perf_counter()
    running = True
    while running:
        busy = loop is not None and loop.busy
        msgs = inbox.recv_all(0 if busy else None)
        if not msgs and inbox.eof:
            break
        for msg in msgs:
            op, rid = msg.get("op"), msg.get("i")
            try:
                if op == "submit" and loop is not None:
                    loop.submit(rid, Request.from_dict(msg["request"]), GenerationParams.from_dict(msg["params"]),
                                stream=msg.get("stream", True), report=msg.get("report", False))
                elif op == "cancel" and loop is not None:
                    loop.cancel(rid)
                elif op == "call" and engine is not None:
                    chan.send({"i": rid, "ok": _call(engine, msg["method"], msg.get("args", []))})
                elif op == "warm" and engine is None:  # a guess, before the load: any engine still loads
                    _warm(msg["backend"])
                elif op == "load":
                    from localrun.backends.base import get_backend

                    options = LoadOptions(**msg["options"])
                    engine = get_backend(msg["backend"]).load(ModelInfo(**msg["model"]), options)
                    loop = EngineLoop(engine, sink, options.max_queue, options.cache_ram)
                    chan.send({"i": rid, "ok": engine.info()})
                elif op == "close":
                    running = False
                    break
                else:
                    chan.send({"i": rid, "error": {"type": "EngineError", "message": f"unexpected op {op!r}"}})
            except Exception as e:  # noqa: BLE001 - every failure goes back to the parent
                chan.send({"i": rid, "error": error_to_wire(e)})
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


def _warm(backend: str) -> None:
    from localrun.backends.base import backend_class

    try:
        backend_class(backend)().warm()
    except Exception:  # noqa: BLE001 - a wrong guess or a missing engine shows when the model loads
        pass


def _call(engine: Any, method: str, args: list[Any]) -> Any:
    if method == "tokenize":
        return engine.prompt_tokens(Request.from_dict(args[0]), [])
    if method == "embed":
        e = engine.embed(args[0])
        return {"vectors": e.vectors, "prompt_tokens": e.prompt_tokens}
    if method == "rerank":
        r = engine.rerank(args[0], args[1])
        return {"scores": r.scores, "prompt_tokens": r.prompt_tokens}
    if method == "info":
        return engine.info()
    raise EngineError(f"unknown engine call {method!r}")


if __name__ == "__main__":
    serve()
    # Out without freeing the engine or tearing down the interpreter: everything this process holds
    # is the engine's, its exit releases it at once, and nothing is left to write (the channel and
    # stderr are unbuffered). Freeing it first kept a one-shot `run` waiting about 50 ms after its reply.
    os._exit(0)
