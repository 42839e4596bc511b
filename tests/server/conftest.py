"""The real server in-process: uvicorn on a socket bound to 127.0.0.1 port 0, over a real pool
running the starter model; the official clients talk to it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from localrun.server.app import RequestRecord, ServerConfig
from localrun.settings import LoadOptions

from ..hub.conftest import hub, hub_files  # noqa: F401 - the local Hub, for /api/pull

MODEL = "smollm2:135m"


class Records:
    """The access log, kept for tests: they wait on a record (a declared event), never a sleep."""

    def __init__(self) -> None:
        self.items: list[RequestRecord] = []
        self._cond = threading.Condition()

    def __call__(self, record: RequestRecord) -> None:
        with self._cond:
            self.items.append(record)
            self._cond.notify_all()

    def mark(self) -> int:
        """Where the log is now: wait(since=mark()) sees only later requests."""
        with self._cond:
            return len(self.items)

    def wait(self, match: Callable[[RequestRecord], bool], timeout: float = 120, since: int = 0) -> RequestRecord:
        """The first record (from `since` on) that matches, waiting for it to be logged."""
        with self._cond:
            found: list[RequestRecord] = []

            def ready() -> bool:
                found[:] = [r for r in self.items[since:] if match(r)]
                return bool(found)

            if not self._cond.wait_for(ready, timeout):
                raise AssertionError(f"no such request was logged; log: {[r.line() for r in self.items]}")
            return found[0]


@dataclass
class Served:
    """A running server: its URL, pool and access log, and clients for it."""

    url: str
    port: int
    pool: Any
    records: Records
    server: Any = field(repr=False)

    def openai(self, api_key: str = "unused", **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300, **kw)

    def async_openai(self, api_key: str = "unused", **kw: Any) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300, **kw)

    def ollama(self, **kw: Any) -> Any:
        import ollama

        return ollama.Client(host=self.url, timeout=300, **kw)

    def http(self, **kw: Any) -> Any:
        import httpx

        return httpx.Client(base_url=self.url, timeout=300, **kw)


def sse(served: Served, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """A streamed request's events (Server-Sent Events whose `event:` names the data's type)."""
    import json

    with served.http().stream("POST", path, json={**body, "stream": True}, headers=headers) as res:
        assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in res.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == kind
                yield data


@contextmanager
def serve(options: LoadOptions | None = None, *, keep_alive: float = 300.0, max_loaded: int = 1,
          **config: Any) -> Iterator[Served]:
    """Start the app on 127.0.0.1:0 in a thread and wait for uvicorn's startup to complete."""
    import uvicorn

    from localrun import api
    from localrun.server.app import create_app

    records = Records()
    pool = api.model_pool(options or LoadOptions(n_ctx=512, n_parallel=2), max_loaded=max_loaded,
                          keep_alive=keep_alive)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    app = create_app(pool, ServerConfig(**{"host": "127.0.0.1", "port": port, "log": records, **config}))
    ready = threading.Event()

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            ready.set()

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    try:
        assert ready.wait(60), "the server did not start"
        yield Served(f"http://127.0.0.1:{port}", port, pool, records, server)
    finally:
        server.should_exit = True
        thread.join(30)
        pool.close()
        sock.close()


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """One server per test module: contexts of 512 tokens, two parallel sequences."""
    with serve(LoadOptions(n_ctx=512, n_parallel=2, max_queue=16)) as s:
        yield s
