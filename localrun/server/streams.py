"""The bridge from the engine's threads to asyncio, shared by the OpenAI and Ollama routes.

Every endpoint resolves a model name through the store (never as a path), hands its jobs to the
pool (one session.start per job, as parallel sequences), and reads the chunks back here. A client
that disconnects cancels its run, so the engine frees its sequences at once.
"""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from localrun import api, settings
from localrun.errors import EngineError, LocalrunError, UsageError
from localrun.generation import Chunk, Request
from localrun.server import display_name, is_loopback
from localrun.settings import GenerationParams, LoadOptions
from localrun.store import ModelInfo

if TYPE_CHECKING:
    from localrun.adapters import Target
    from localrun.backends.base import Embeddings
    from localrun.constraint import Constraint
    from localrun.pool import Pool
    from localrun.tools import ToolPlan

MAX_BODY = 32 << 20  # bytes; a bigger request body gets 413
T = TypeVar("T")


# -- configuration and the per-request log ---------------------------------------------------


@dataclass(frozen=True)
class RequestRecord:
    """What the log line of one request says."""

    method: str
    path: str
    status: int
    seconds: float
    model: str | None = None
    tokens: int = 0
    tokens_per_second: float = 0.0
    finish_reason: str | None = None

    def line(self) -> str:
        speed = f" {self.tokens} tokens {self.tokens_per_second:.1f} tok/s" if self.model and self.tokens else ""
        return f"{self.method} {self.path} {self.model or '-'} {self.status}{speed} {self.seconds:.2f}s"


def _stderr_log(record: RequestRecord) -> None:
    print(record.line(), file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ServerConfig:
    """How `localrun serve` was started: the bound address and the access rules."""

    host: str = "127.0.0.1"
    port: int = 11434
    api_key: str | None = None
    origins: tuple[str, ...] = ()
    allow_pull: bool = False  # pulling is always allowed on a loopback address
    max_body: int = MAX_BODY
    # `serve --lora`: adapters (store name, scale) that requests for their base model run with
    # when they name no adapters of their own
    lora: tuple[tuple[str, float], ...] = ()
    # `serve`'s generation flags (--temperature, --draft, ...): settings under every request's,
    # its preset's and its model's (settings.resolve's defaults)
    settings: Mapping[str, Any] = field(default_factory=dict)
    # `serve --alias PATTERN=MODEL`: requested names (an agent's claude-haiku-4-5) and the models they run
    aliases: tuple[tuple[str, str], ...] = ()
    media_dir: str | None = None  # `serve --media-dir`: where OpenAI file:// image URLs may point
    allow_fetch: bool = False  # `serve --allow-fetch`: OpenAI image URLs over http(s) are fetched
    # `serve --mcp FILE`: the MCP servers (a ToolServers) whose tools the Responses API's mcp tools use
    mcp: Any = field(default=None, compare=False)
    log: Callable[[RequestRecord], None] = field(default=_stderr_log, compare=False)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def pull_allowed(self) -> bool:
        return self.allow_pull or self.loopback


async def check_images(request: HttpRequest, req: Request, model: ModelInfo, name: str) -> None:
    """A request with images for a model that reads none is refused before the model loads."""
    if req.images:
        engine = pool_of(request).engine
        caps = await asyncio.to_thread(api.capabilities, model, engine)
        if "vision" not in caps:
            raise UsageError(f"'{name}' does not support images",
                             "send text only, or use a vision model (registered with its projector: "
                             "'localrun add MODEL.gguf --mmproj FILE')")


async def resolve(request: HttpRequest, target: Target, given: Mapping[str, Any], constraint: Constraint | None = None,
                  tools: ToolPlan | None = None, fallback: Mapping[str, Any] | None = None) -> GenerationParams:
    """A request's settings, decided once (settings.resolve) for the engine that will run its model:
    what it gives over its preset's, its model's and the server's (over the API's own `fallback`)."""
    engine = await asyncio.to_thread(api.choose_engine, target.model, pool_of(request).engine)
    defaults = settings.layers(fallback, config_of(request).settings)
    return settings.resolve(given, target, engine, defaults=defaults, constraint=constraint, tools=tools)


# -- the bridge from the engine's threads to asyncio --------------------------------------------


@dataclass(frozen=True)
class Job:
    """One sequence to generate: a request, its settings, and which prompt of the body it answers."""

    request: Request
    params: GenerationParams
    prompt_index: int = 0


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


Emit = Callable[[Any], None]
Worker = Callable[["Run", Emit], None]


class Run:
    """Blocking workers for one HTTP request, each in its own thread, whose items come back
    through an asyncio queue. close() (or the client leaving) sets the shared cancel event."""

    def __init__(self, workers: list[Worker], request: HttpRequest, name: str) -> None:
        self.request, self.name = request, name
        self.cancel = threading.Event()
        self.loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.started = time.perf_counter()
        self.load_seconds = 0.0
        self.finals: dict[int, Chunk] = {}  # written by the workers, so the log sees cancelled ones too
        self.count = len(workers)
        self._early: list[tuple[int, Any]] = []
        self.begun = False  # every worker has sent its first item (begin)
        self._open = len(workers)
        self._running = len(workers)
        self._lock = threading.Lock()
        self._hooks: list[Callable[[], None]] = []
        self._ended = asyncio.Event()
        for i, work in enumerate(workers):
            threading.Thread(target=self._work, args=(i, work), daemon=True, name=f"localrun-request-{i}").start()

    def _put(self, item: tuple[int, Any]) -> None:
        if threading.get_ident() == self._loop_thread:  # chunks read on the event loop itself
            self.queue.put_nowait(item)
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shutting down)
            self.cancel.set()

    def _work(self, i: int, work: Worker) -> None:
        def emit(item: Any) -> None:
            if isinstance(item, Chunk) and item.done:
                self.finals[i] = item
            self._put((i, item))

        try:
            work(self, emit)
        except BaseException as e:  # noqa: BLE001 - every failure goes to the client
            self._put((i, _Failed(e)))
        finally:
            self._put((i, _END))
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                try:
                    self.loop.call_soon_threadsafe(self._ended.set)
                except RuntimeError:
                    pass

    def close(self) -> None:
        self.cancel.set()
        with self._lock:
            hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def on_cancel(self, hook: Callable[[], None]) -> None:
        """Call hook when the run is cancelled (at once if it already is)."""
        with self._lock:
            if not self.cancel.is_set():
                self._hooks.append(hook)
                return
        hook()

    async def settle(self) -> None:
        """Cancel what still runs, wait until every worker has let go of the engine (its
        sequence is free), and leave the model and token counts for the access log."""
        self.close()
        await self._ended.wait()
        finals = list(self.finals.values())
        tokens = sum(c.completion_tokens for c in finals)
        decode = max((c.decode_ms for c in finals), default=0.0) / 1000
        self.request.state.log = {"model": self.name, "tokens": tokens,
                                  "tokens_per_second": tokens / decode if decode else 0.0,
                                  "finish_reason": finals[0].finish_reason if finals else None}

    async def begin(self) -> None:
        """Wait until every worker has sent its first item; raise the first error (queue full,
        prompt too long, model failed to load) so the endpoint can still answer with its
        status. A client that leaves meanwhile cancels the run (ClientGone). Once begun, again
        returns at once."""
        if self.begun:
            return

        async def first_items() -> None:
            begun: set[int] = set()
            while len(begun) < self.count:
                i, item = await self.queue.get()
                self._early.append((i, item))
                if isinstance(item, _Failed):
                    raise _as_localrun(item.error)
                begun.add(i)

        try:
            await unless_disconnected(self.request, first_items(), self.close)
        except BaseException:
            await asyncio.shield(self.settle())
            raise
        self.begun = True

    async def items(self) -> AsyncIterator[tuple[int, Any]]:
        """(worker index, item) until every worker ends; a worker's failure is raised."""
        try:
            while self._open:
                i, item = self._early.pop(0) if self._early else await self.queue.get()
                if item is _END:
                    self._open -= 1
                elif isinstance(item, _Failed):
                    raise _as_localrun(item.error)
                else:
                    yield i, item
        finally:
            self.close()

    async def complete(self, consume: Awaitable[T]) -> T:
        """Await `consume` (which reads items()) for a whole, non-streamed answer; a client that
        leaves meanwhile cancels the run."""
        try:
            return await unless_disconnected(self.request, consume, self.close)
        finally:
            await asyncio.shield(self.settle())


@dataclass(frozen=True)
class _Failed:
    error: BaseException


_END = object()


def start_run(request: HttpRequest, target: Target, jobs: list[Job], keep_alive: float | None,
              options: LoadOptions | None = None, stream: bool = True, report: bool = False) -> Run:
    """Start the jobs on the pooled model (with the target's adapters): one session.start per
    job, as parallel sequences. `options`: the client's load options (an Ollama num_ctx or
    kv_cache_type over the server's), which choose the instance that answers. With stream False
    (an answer sent whole) each job's reply comes as one text chunk when it ends."""
    pool = pool_of(request)
    if pool.event_loop is None:
        pool.event_loop = asyncio.get_running_loop()

    def worker(job: Job) -> Worker:
        def work(run: Run, emit: Emit) -> None:
            t0 = time.perf_counter()
            with api.use_target(pool, target, keep_alive, options) as (session, _):
                run.load_seconds = max(run.load_seconds, time.perf_counter() - t0)
                if run.cancel.is_set():
                    return
                # Chunks go from the engine's reader thread straight to the event loop; this
                # thread only holds the model until the request ends. With report, the first
                # chunk (empty) says how much of the prompt the KV cache held when it was admitted.
                ticket = session.start(target.request(job.request), job.params, emit, stream, report)
                run.on_cancel(ticket.cancel)
                ticket.wait()
                if ticket.error is not None:
                    raise ticket.error
        return work

    return Run([worker(job) for job in jobs], request, display_name(target.model.name))


class Settles(Protocol):
    """What a streamed answer ends: a Run, or a response's several runs (Responses' MCP steps)."""

    async def settle(self) -> None: ...


class RunResponse(StreamingResponse):
    """A streamed answer whose run is cancelled when the response ends for any reason (the
    client disconnected, the server is stopping), not only when its generator is finalized."""

    def __init__(self, content: AsyncIterator[bytes], run: Settles, media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        if media_type == "text/event-stream":
            self.headers["Cache-Control"] = "no-cache"
            self.headers["X-Accel-Buffering"] = "no"
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self.run.settle())


def _as_localrun(e: BaseException) -> BaseException:
    if isinstance(e, LocalrunError | KeyboardInterrupt | SystemExit):
        return e
    return EngineError(f"the engine failed: {type(e).__name__}: {e}")


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: HttpRequest, aw: Awaitable[T], on_gone: Callable[[], None]) -> T:
    """Await `aw`; if the client disconnects first, call on_gone (cancel the work) and raise
    ClientGone. Used until a response starts; after that Starlette watches the connection."""
    task = asyncio.ensure_future(aw)
    gone = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the server is stopping
        on_gone()
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    on_gone()
    task.cancel()
    raise ClientGone


async def run_blocking(request: HttpRequest, fn: Callable[[], T], cancel: threading.Event | None = None) -> T:
    """Run a blocking call (an embedding, a pull) in a thread; a disconnect sets `cancel`."""
    return await unless_disconnected(request, asyncio.to_thread(fn), cancel.set if cancel else (lambda: None))


def embed(pool: Pool, model: ModelInfo, texts: Sequence[str | list[int]], keep_alive: float | None,
          options: LoadOptions | None = None) -> tuple[Embeddings | None, float]:
    """The session's embeddings of `texts` (blocking) and the seconds spent loading the model."""
    t0 = time.perf_counter()
    with pool.use(model, keep_alive, options) as session:
        loaded = time.perf_counter() - t0
        return (session.embed(list(texts)) if texts else None), loaded


def fit_vector(vector: list[float], dimensions: int | None, normalize: bool = True) -> list[float]:
    """Truncate an embedding to `dimensions` (Matryoshka style) and scale it to unit length."""
    if dimensions is not None:
        if dimensions > len(vector):
            raise UsageError(f"dimensions {dimensions} is more than the model's {len(vector)}",
                             f"ask for at most {len(vector)}")
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(sum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else list(vector)


def pool_of(request: HttpRequest) -> Pool:
    """The server's model pool."""
    return request.app.state.pool  # type: ignore[no-any-return]


def config_of(request: HttpRequest) -> ServerConfig:
    return request.app.state.config  # type: ignore[no-any-return]
