"""One sequence and a queue of one: a client that leaves frees its sequence or its queue place at
once, a full queue answers 503 in both API shapes, and a killed engine fails only the requests
in flight while the server stays up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Iterator

import httpx
import ollama
import openai
import pytest

from localrun.settings import LoadOptions

from .. import reliability
from .conftest import MODEL, Served, serve

COUNTING = "1, 2, 3, 4, 5, 6,"  # the model keeps counting: a reply that lasts until it is stopped
LONG = 900
# The server notices a client leaving on its event loop and cancels at once; the engine reads the
# cancel before its next step. What it may still generate meanwhile is what it decodes while the
# event loop gets to the disconnect: a few tokens (2 on a quiet machine), never the budget. The
# bound leaves room for a loaded machine, where the event loop and the engine share the cores.
LATE = 16


@pytest.fixture(scope="module")
def single() -> Iterator[Served]:
    with serve(LoadOptions(n_ctx=1024, n_parallel=1, max_queue=1)) as s:
        yield s


def _long_stream(path: str = "/v1/completions") -> dict[str, object]:
    if path == "/v1/completions":
        return {"model": MODEL, "prompt": COUNTING, "max_tokens": LONG, "temperature": 0, "stream": True}
    return {"model": MODEL, "prompt": COUNTING, "raw": True, "options": {"num_predict": LONG, "temperature": 0}}


def test_disconnecting_client_frees_its_sequence(single: Served) -> None:
    mark = single.records.mark()
    client = single.openai()
    stream = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=LONG, temperature=0, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    stream.close()  # the client goes away mid-stream, one token read
    gone = single.records.wait(lambda r: r.path == "/v1/completions" and r.finish_reason == "cancelled", since=mark)
    assert gone.status == 200 and 1 <= gone.tokens <= 1 + LATE  # the engine stopped it, not the budget
    # The only sequence is free again: the next request runs to its end.
    after = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert after.choices[0].text.startswith(" Paris")


def test_ollama_client_leaving_cancels_too(single: Served) -> None:
    mark = single.records.mark()
    with single.http() as http, http.stream("POST", "/api/generate", json=_long_stream("/api/generate")) as res:
        line = json.loads(next(res.iter_lines()))
        assert line["done"] is False  # one token read, then the client leaves
    gone = single.records.wait(lambda r: r.path == "/api/generate" and r.finish_reason == "cancelled", since=mark)
    assert 1 <= gone.tokens <= 1 + LATE


def test_full_queue_is_503_and_a_queued_client_leaving_frees_its_place(single: Served) -> None:
    mark = single.records.mark()

    async def main() -> None:
        async with httpx.AsyncClient(base_url=single.url, timeout=300) as http:
            async with http.stream("POST", "/v1/completions", json=_long_stream()) as running:
                assert running.status_code == 200
                lines = running.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # it holds the only sequence
                # Two more: one waits in the queue (its one place), the other finds it full.
                body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
                first_openai = asyncio.ensure_future(http.post("/v1/completions", json=body))
                then_ollama = asyncio.ensure_future(http.post("/api/generate", json={"model": MODEL, "prompt": "Hello"}))
                done, pending = await asyncio.wait({first_openai, then_ollama}, return_when=asyncio.FIRST_COMPLETED)
                busy = done.pop().result()
                assert busy.status_code == 503
                if "/v1/" in str(busy.url):
                    assert busy.json()["error"]["code"] == "server_busy"
                else:
                    assert "busy" in busy.json()["error"]
                queued = pending.pop()
                queued_path = "/api/generate" if queued is then_ollama else "/v1/completions"
                queued.cancel()  # the waiting client goes away
                with pytest.raises(asyncio.CancelledError):
                    await queued
                left = await asyncio.to_thread(single.records.wait,
                                               lambda r: r.path == queued_path and r.status == 499, 120, mark)
                assert left.finish_reason == "cancelled" and left.tokens == 0
                assert all(r.status == 503 for r in single.records.items[mark:] if r is not left), \
                    "the long reply ended on its own"
                # Its place is free: another request waits instead of getting 503.
                waiting = asyncio.ensure_future(http.post("/v1/completions", json=body))
            # Leaving the long stream lets the waiting request run.
            res = await waiting
            assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 4

    asyncio.run(main())


def test_killed_engine_fails_requests_in_flight_and_the_next_one_reloads() -> None:
    with serve(LoadOptions(n_ctx=512, n_parallel=2)) as s:
        client = s.openai()
        stream = client.completions.create(model=MODEL, prompt=COUNTING, max_tokens=400, temperature=0, stream=True)
        chunks = iter(stream)
        assert next(chunks).choices[0].text
        errors: list[BaseException] = []
        started = threading.Event()

        def ollama_stream() -> None:
            try:
                for _part in s.ollama().generate(model=MODEL, prompt=COUNTING, raw=True, stream=True,
                                                options={"num_predict": 400, "temperature": 0}):
                    started.set()
            except ollama.ResponseError as e:
                errors.append(e)
            finally:
                started.set()

        t = threading.Thread(target=ollama_stream)
        t.start()
        assert started.wait(120) and not errors  # both requests are streaming
        [loaded] = s.pool.loaded()
        os.kill(loaded.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="crashed"):
            for _ in chunks:
                pass
        t.join(120)
        assert len(errors) == 1 and "crashed" in errors[0].error
        with s.http() as http:
            assert http.get("/health").status_code == 200
        again = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
        assert again.choices[0].text.startswith(" Paris")
        [reloaded] = s.pool.loaded()
        assert reloaded.pid != loaded.pid
    reliability.fault("SIGKILL", "the engine during a served stream")
