"""A bounded soak of the server: 64 concurrent clients send a fixed number of mixed requests
(streamed and not; chat, completion and embeddings in both API families; some clients leave
mid-stream) to one model with 4 sequences and a queue of 32. Every request is answered or refused
with 503 in its API's shape, none hangs or fails with a 500, every client set to leave leaves after
its first streamed text (refused, it comes back once a request has ended) and is cancelled,
memory after the run is what it was after a warm-up round, and every sequence is free at the end."""

from __future__ import annotations

import asyncio
import gc
import json
import os
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import httpx
import pytest

from localrun.settings import LoadOptions

from .. import reliability
from .conftest import MODEL, Served, serve

OPTIONS = LoadOptions(n_ctx=256, n_parallel=4, max_queue=32)
CLIENTS = 64
ROUND = 128  # requests per round: a warm-up round, then the measured ones
MEASURED_ROUNDS = 2
TOKENS = 6
COUNTING = "1, 2, 3, 4, 5, 6,"  # the model keeps counting: a reply that lasts until it is stopped
LONG = 200  # a leaving client's budget, far more than it reads: only the cancel can end its reply
# Only a request that never ends trips this (there is no timing assert): httpx's per-read timeout.
HANG_GUARD_S = 180
HANG_GUARD = httpx.Timeout(HANG_GUARD_S)
# A leak of a request's buffers, chunks or KV cache grows memory with every request; the first
# round has already filled the allocator's arenas, the engine's KV cache and every lazy cache
# (templates, schemas, connections), so after it memory stays flat up to allocator noise. The
# bound is that noise: 5% of the process (or 20 MB for a small one), i.e. a leak of more than
# ~80 KB per request over the 256 measured requests fails.
GROWTH = 0.05
GROWTH_MIN = 20 << 20

HI = [{"role": "user", "content": "Say hello to a new colleague."}]
SAMPLING = {"max_tokens": TOKENS, "temperature": 0}
OLLAMA_SAMPLING = {"num_predict": TOKENS, "temperature": 0}
TEXTS = ["hello there", "goodbye"]


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix: how it is sent and how its answer is read."""

    name: str
    path: str
    body: dict[str, Any]
    mode: str  # "json" (one answer), "sse" or "ndjson" (a stream read to its end), "leave"


KINDS = [
    Kind("chat", "/v1/chat/completions", {"model": MODEL, "messages": HI, **SAMPLING}, "json"),
    Kind("chat stream", "/v1/chat/completions", {"model": MODEL, "messages": HI, **SAMPLING, "stream": True}, "sse"),
    Kind("completion", "/v1/completions", {"model": MODEL, "prompt": "The capital of France is", **SAMPLING}, "json"),
    Kind("completion stream", "/v1/completions",
         {"model": MODEL, "prompt": "Once upon a time", **SAMPLING, "stream": True}, "sse"),
    Kind("embeddings", "/v1/embeddings", {"model": MODEL, "input": TEXTS, "encoding_format": "float"}, "json"),
    Kind("ollama chat", "/api/chat", {"model": MODEL, "messages": HI, "stream": False, "options": OLLAMA_SAMPLING},
         "json"),
    Kind("ollama chat stream", "/api/chat",
         {"model": MODEL, "messages": HI, "stream": True, "options": OLLAMA_SAMPLING}, "ndjson"),
    Kind("ollama generate", "/api/generate",
         {"model": MODEL, "prompt": "Why is the sky blue?", "stream": False, "options": OLLAMA_SAMPLING}, "json"),
    Kind("ollama generate stream", "/api/generate",
         {"model": MODEL, "prompt": "Name a colour.", "stream": True, "options": OLLAMA_SAMPLING}, "ndjson"),
    Kind("ollama embed", "/api/embed", {"model": MODEL, "input": TEXTS}, "json"),
    Kind("leaving completion", "/v1/completions",
         {"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0, "stream": True}, "leave"),
    Kind("leaving generate", "/api/generate",
         {"model": MODEL, "prompt": COUNTING, "raw": True, "stream": True,
          "options": {"num_predict": LONG, "temperature": 0}}, "leave"),
]


@dataclass(frozen=True)
class Outcome:
    kind: str
    status: int
    left: bool = False  # the client read generated text from an unfinished 200 stream, then closed it


# -- what a client accepts --------------------------------------------------------------------


def _check_refusal(kind: Kind, body: Any) -> None:
    if kind.path.startswith("/v1/"):
        error = body["error"]
        assert error["code"] == "server_busy" and error["type"] == "server_error" and "busy" in error["message"], body
    else:
        assert set(body) == {"error"} and "busy" in body["error"], body


def _check_answer(kind: Kind, body: Any) -> None:
    path = kind.path
    if path == "/v1/embeddings":
        assert [len(d["embedding"]) for d in body["data"]] == [576, 576], kind.name
    elif path == "/api/embed":
        assert [len(v) for v in body["embeddings"]] == [576, 576], kind.name
    elif path.startswith("/v1/"):
        [choice] = body["choices"]
        text = choice["message"]["content"] if path == "/v1/chat/completions" else choice["text"]
        assert isinstance(text, str) and choice["finish_reason"] in ("stop", "length"), body
        assert 1 <= body["usage"]["completion_tokens"] <= TOKENS, body
    else:
        assert body["done"] is True and body["done_reason"] in ("stop", "length"), body
        assert 1 <= body["eval_count"] <= TOKENS, body


def _check_stream(kind: Kind, lines: list[str]) -> None:
    if kind.mode == "sse":
        assert lines[-1] == "data: [DONE]", (kind.name, lines[-3:])
        events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
        assert not any("error" in e for e in events), (kind.name, events)
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert len(finishes) == 1 and finishes[0] in ("stop", "length"), (kind.name, finishes)
    else:
        parts = [json.loads(line) for line in lines]
        assert not any("error" in p for p in parts), (kind.name, parts)
        assert [p["done"] for p in parts].count(True) == 1 and parts[-1]["done"] is True, (kind.name, parts)
        assert parts[-1]["done_reason"] in ("stop", "length"), parts[-1]


async def _send(http: httpx.AsyncClient, kind: Kind) -> Outcome:
    """One request of the mix, its answer checked; a hang fails it (the guard's timeout)."""
    try:
        if kind.mode == "json":
            res = await http.post(kind.path, json=kind.body)
            if res.status_code == 503:
                _check_refusal(kind, res.json())
            else:
                assert res.status_code == 200, (kind.name, res.status_code, res.text)
                _check_answer(kind, res.json())
            return Outcome(kind.name, res.status_code)
        async with http.stream("POST", kind.path, json=kind.body) as res:
            if res.status_code != 200:
                await res.aread()
                assert res.status_code == 503, (kind.name, res.status_code, res.text)
                _check_refusal(kind, res.json())
                return Outcome(kind.name, res.status_code)
            if kind.mode == "leave":
                await _read_until_text(kind, res)
                return Outcome(kind.name, 200, left=True)  # leaving the block closes the connection
            _check_stream(kind, [line async for line in _nonblank(res)])
            return Outcome(kind.name, 200)
    except httpx.TimeoutException as e:
        raise AssertionError(f"a '{kind.name}' request hung: {e!r}") from e


async def _nonblank(res: httpx.Response) -> Any:
    async for line in res.aiter_lines():
        if line:
            yield line


async def _read_until_text(kind: Kind, res: httpx.Response) -> None:
    """A leaving client's reading: up to the first event that carries generated text, which must
    not be the stream's last (the client then leaves mid-stream, not after the end)."""
    async for line in _nonblank(res):
        event = json.loads(line.removeprefix("data: ")) if kind.path.startswith("/v1/") else json.loads(line)
        assert "error" not in event, (kind.name, event)
        if kind.path.startswith("/v1/"):
            [choice] = event["choices"]
            text, last = choice["text"], choice["finish_reason"] is not None
        else:
            text, last = event["response"], event["done"]
        assert not last, (kind.name, event)
        if text:
            return
    raise AssertionError(f"a '{kind.name}' stream ended before any text")


def _plan(n: int) -> list[Kind]:
    """A round's requests: the mix, in turn."""
    return [KINDS[i % len(KINDS)] for i in range(n)]


async def _round(url: str, n: int) -> list[Outcome]:
    """n requests of the mix (in turn), taken by CLIENTS concurrent clients, each on its own connection.

    A client set to leave that is refused (503, before any stream) sends again once another request
    has ended and freed a place, so every planned leaver is seen leaving mid-stream; its refusals are
    outcomes too (each is a request the server answered).
    """
    plan = deque(_plan(n))
    outcomes: list[Outcome] = []
    ended = 0  # requests of this round that were answered or left (their place is then freed)
    changed = asyncio.Condition()

    def ended_since(mark: int) -> Callable[[], bool]:
        return lambda: ended > mark

    async def client() -> None:
        nonlocal ended
        async with httpx.AsyncClient(base_url=url, timeout=HANG_GUARD) as http:
            while plan:
                kind = plan.popleft()
                while True:
                    before = ended
                    outcome = await _send(http, kind)
                    outcomes.append(outcome)
                    if outcome.status == 200:
                        async with changed:
                            ended += 1
                            changed.notify_all()
                    if outcome.status == 200 or kind.mode != "leave":
                        break
                    async with changed:  # refused while every place was taken: one of them ends later
                        await asyncio.wait_for(changed.wait_for(ended_since(before)), HANG_GUARD_S)

    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return outcomes


# -- what the server shows --------------------------------------------------------------------


def _rss(pid: int) -> int:
    """A process's resident memory in bytes (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _soak_round(s: Served) -> list[Outcome]:
    """One round, and its access log checked against what the clients saw."""
    mark = s.records.mark()
    outcomes = asyncio.run(_round(s.url, ROUND))
    # Every planned request had one final outcome; leavers were sent again after a refusal, and
    # each of them left mid-stream.
    leaving = {k.name for k in KINDS if k.mode == "leave"}
    final = [o.kind for o in outcomes if o.kind not in leaving or o.left]
    assert Counter(final) == Counter(k.name for k in _plan(ROUND)), Counter(final)
    assert all(o.left == (o.kind in leaving and o.status == 200) for o in outcomes)
    n = len(outcomes)
    s.records.wait(lambda r: True, since=mark + n - 1)  # one record per request, the last included
    records = s.records.items[mark:]
    assert len(records) == n, [r.line() for r in records]
    assert Counter(r.status for r in records) == Counter(o.status for o in outcomes)
    assert {r.status for r in records} <= {200, 503}, [r.line() for r in records if r.status not in (200, 503)]
    # Each client that left mid-stream was cancelled (not ended by its budget), and only those.
    cancelled = [r for r in records if r.finish_reason == "cancelled"]
    assert len(cancelled) == sum(o.left for o in outcomes), [r.line() for r in cancelled]
    assert all(r.status == 200 and r.path in ("/v1/completions", "/api/generate") for r in cancelled)
    return outcomes


def _memory(pid: int) -> tuple[int, int]:
    """RSS of this process (the server runs in it) and of the engine's worker process."""
    gc.collect()
    return _rss(os.getpid()), _rss(pid)


def _all_sequences_free(s: Served) -> None:
    """n = n_parallel choices in one request: if every sequence is free they all start at once,
    so each choice's first text comes before any choice ends (a sequence still held would make
    the last choice wait for another one to finish)."""
    n = OPTIONS.n_parallel
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": 48, "temperature": 0, "n": n, "stream": True}
    with s.http() as http, http.stream("POST", "/v1/completions", json=body) as res:
        assert res.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in res.iter_lines()
                  if line.startswith("data: {")]
    first: dict[int, int] = {}
    ends: dict[int, int] = {}
    for k, event in enumerate(events):
        for c in event["choices"]:
            if c["text"]:
                first.setdefault(c["index"], k)
            if c["finish_reason"]:
                ends[c["index"]] = k
    assert sorted(first) == sorted(ends) == list(range(n)), events
    assert max(first.values()) < min(ends.values()), (first, ends)


@pytest.mark.slow
def test_soak_mixed_clients_all_answered_no_leak_all_sequences_free() -> None:
    with serve(OPTIONS) as s:
        warm = _soak_round(s)
        [loaded] = s.pool.loaded()
        pid = loaded.pid
        assert pid is not None
        before = _memory(pid)
        measured = [o for _ in range(MEASURED_ROUNDS) for o in _soak_round(s)]
        after = _memory(pid)
        everything = warm + measured
        left = sum(o.left for o in everything)
        print(f"soak: {len(everything)} requests, {sum(o.status == 503 for o in everything)} refused, "
              f"{left} left mid-stream; RSS after warm-up -> after: "
              f"server {before[0] / 2**20:.1f} -> {after[0] / 2**20:.1f} MB, "
              f"engine {before[1] / 2**20:.1f} -> {after[1] / 2**20:.1f} MB")

        # The load was real: the queue filled (some refusals) and clients left mid-stream.
        assert any(o.status == 503 for o in measured) and any(o.left for o in measured)
        assert any(o.status == 200 for o in measured if o.kind not in ("embeddings", "ollama embed"))
        for what, b, a in (("server", before[0], after[0]), ("engine", before[1], after[1])):
            assert a - b <= max(GROWTH * b, GROWTH_MIN), f"the {what} grew from {b >> 20} MB to {a >> 20} MB"

        # Nothing is running: a normal request completes, every sequence is free at once, the
        # pool holds the model for nobody (it expires; in use it would not), the engine is the
        # same process, and every request left exactly one log record.
        mark = s.records.mark()
        with s.http() as http:
            res = http.post("/v1/chat/completions", json={"model": MODEL, "messages": HI, **SAMPLING})
            assert res.status_code == 200 and res.json()["choices"][0]["finish_reason"] in ("stop", "length")
            _all_sequences_free(s)
            s.records.wait(lambda r: True, since=mark + 1)
            [model] = http.get("/api/ps").json()["models"]
        expires = datetime.fromisoformat(model["expires_at"].replace("Z", "+00:00"))
        assert expires < datetime.now(expires.tzinfo) + timedelta(days=1), model
        assert [m.pid for m in s.pool.loaded()] == [pid]
        sent = len(everything) + 3  # the rounds, the chat, the n-choice stream, /api/ps
        s.records.wait(lambda r: r.path == "/api/ps", since=mark + 2)
        assert len(s.records.items) == sent, [r.line() for r in s.records.items[-5:]]
    # The planned requests (a leaver's refusals before it got its stream are not counted again),
    # and the clients seen leaving mid-stream, each asserted cancelled in its round's log.
    reliability.inputs("soak request", ROUND * (1 + MEASURED_ROUNDS))
    reliability.fault("dropped client", "served streams", left)
