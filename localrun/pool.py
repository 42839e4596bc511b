"""Loaded models: load on demand, keep alive for a while after use, evict, reload after a crash.

Used by the TUI and the server alike. Keep-alive follows Ollama's rule: a model stays loaded for
`keep_alive` seconds after its last use ends (negative or infinite: forever; 0: unload as soon as
nobody uses it). At most `max_loaded` models are loaded at once; to load another, the one idle
longest is unloaded, and a model that would not fit in the available memory is refused.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from localrun.backends.base import Session
from localrun.errors import EngineError, ServerBusyError
from localrun.generation import LoadOptions
from localrun.store import ModelInfo

if TYPE_CHECKING:
    import asyncio

DEFAULT_KEEP_ALIVE = 300.0
# Beyond the weights (mapped from the file): compute buffers, the KV cache of small contexts.
MEMORY_MARGIN = 1.2


@dataclass(frozen=True)
class LoadedModel:
    """A model in the pool, as `localrun ps` and /api/ps show it."""

    name: str
    model: ModelInfo
    engine: str
    info: dict[str, Any]
    expires_at: float | None  # epoch seconds; None: kept until unloaded (or in use now)
    size: int
    pid: int | None = None  # the engine process


class _Entry:
    def __init__(self, model: ModelInfo, options: LoadOptions) -> None:
        self.model = model
        self.options = options
        self.session: Session | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.users = 0
        self.expires = math.inf  # monotonic time; inf while in use or kept forever
        self.last_used = time.monotonic()


class Pool:
    """The models loaded by one front end (the TUI, the server); thread-safe."""

    def __init__(self, loader: Callable[..., Session], resolve: Callable[[str], ModelInfo],
                 options: LoadOptions | None = None, engine: str | None = None, *, max_loaded: int = 1,
                 keep_alive: float = DEFAULT_KEEP_ALIVE) -> None:
        """loader(model, options, engine=, event_loop=) loads a session (api.load); resolve(name)
        finds a model (api.get_model)."""
        self.options = options or LoadOptions()
        self.engine = engine
        self.max_loaded = max(1, max_loaded)
        self.keep_alive = keep_alive
        self.event_loop: asyncio.AbstractEventLoop | None = None  # a server's: its sessions are read on that loop
        self._loader = loader
        self._resolve = resolve
        self._lock = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="pool-reaper")
        self._reaper.start()

    # -- using a model ----------------------------------------------------------------------
    @contextmanager
    def use(self, model: str | ModelInfo, keep_alive: float | None = None,
            options: LoadOptions | None = None) -> Iterator[Session]:
        """The model's session, loaded if needed, held for the block.

        Args:
            model: a store name or a ModelInfo (loaded models are told apart by its name).
            keep_alive: seconds to stay loaded after this use (None: the pool's default;
                negative or inf: forever; 0: unload when the last user leaves).
            options: load options for this model instead of the pool's (MLX adapters applied at
                load: the model then goes under its own name, e.g. base+adapter).

        Raises:
            ModelNotFoundError, BadModelFileError, BackendUnavailableError, EngineError (load
            failed or not enough memory), ServerBusyError (every loaded model is in use).
        """
        info = model if isinstance(model, ModelInfo) else self._resolve(model)
        entry = self._acquire(info, options or self.options)
        try:
            assert entry.session is not None
            yield entry.session
        finally:
            self._release(entry, self.keep_alive if keep_alive is None else keep_alive)

    def session(self, model: str | ModelInfo) -> Session:
        """The model's session, loaded if needed (kept until unloaded or replaced: the TUI's use)."""
        with self.use(model, keep_alive=-1) as s:
            return s

    def _acquire(self, info: ModelInfo, options: LoadOptions) -> _Entry:
        while True:
            with self._lock:
                if self._closed:
                    raise EngineError("the model pool is closed")
                entry = self._entries.get(info.name)
                if entry is not None and entry.ready.is_set() and entry.error is None:
                    assert entry.session is not None
                    if entry.session.alive:
                        entry.users += 1
                        entry.expires = math.inf
                        return entry
                    self._entries.pop(info.name)  # the engine crashed: load it again
                    self._close_later(entry)
                    entry = None
                if entry is None:
                    self._make_room(info)
                    entry = _Entry(info, options)
                    entry.users = 1
                    self._entries[info.name] = entry
                    loading = True
                else:
                    loading = False
            if loading:
                return self._load_entry(entry)
            entry.ready.wait()
            if entry.error is not None:
                raise entry.error

    def _load_entry(self, entry: _Entry) -> _Entry:
        try:
            entry.session = self._loader(entry.model, entry.options, engine=self.engine, event_loop=self.event_loop)
        except BaseException as e:
            entry.error = e
            with self._lock:
                if self._entries.get(entry.model.name) is entry:
                    self._entries.pop(entry.model.name)
            entry.ready.set()
            raise
        entry.ready.set()
        return entry

    def _release(self, entry: _Entry, keep_alive: float) -> None:
        with self._lock:
            entry.users -= 1
            entry.last_used = time.monotonic()
            if entry.users > 0:
                return
            if keep_alive < 0 or math.isinf(keep_alive):
                entry.expires = math.inf
            else:
                entry.expires = time.monotonic() + keep_alive
            if keep_alive == 0 and self._entries.get(entry.model.name) is entry:
                self._entries.pop(entry.model.name)
                self._close_later(entry)
            self._lock.notify_all()

    def _make_room(self, info: ModelInfo) -> None:
        """Unload idle models until one more fits (count and memory); called with the lock held."""
        from localrun.system import ram_bytes

        def idle() -> list[_Entry]:
            return sorted((e for e in self._entries.values() if e.users == 0 and e.ready.is_set()),
                          key=lambda e: e.last_used)

        while len(self._entries) >= self.max_loaded:
            victims = idle()
            if not victims:
                raise ServerBusyError(f"cannot load '{info.name}': {len(self._entries)} model(s) are loaded and in use",
                                      "retry when a request ends, or start the server with a larger --max-loaded")
            self._evict(victims[0])
        need = int(info.size * MEMORY_MARGIN)
        available = ram_bytes()[1]
        if available is None:
            return
        for victim in idle():
            if need <= available:
                break
            self._evict(victim)
            available += victim.model.size
        if need > available:
            raise EngineError(
                f"not enough memory to load '{info.name}': it needs about {need / 1e9:.1f} GB, "
                f"{available / 1e9:.1f} GB is available",
                "unload other models, close other programs, or use a smaller quantization")

    def _evict(self, entry: _Entry) -> None:
        self._entries.pop(entry.model.name, None)
        self._close_later(entry)

    @staticmethod
    def _close_later(entry: _Entry) -> None:
        """Close a session off the lock (a worker takes a moment to exit)."""
        session = entry.session
        if session is not None:
            threading.Thread(target=_close_quietly, args=(session,), daemon=True).start()

    # -- state ------------------------------------------------------------------------------
    def unload(self, name: str) -> bool:
        """Unload a model now; requests still running on it end with an error."""
        with self._lock:
            entry = self._entries.pop(name, None)
        if entry is None:
            return False
        if entry.session is not None:
            _close_quietly(entry.session)
        return True

    def loaded(self) -> list[LoadedModel]:
        """The models loaded now, most recently used first."""
        now_wall, now = time.time(), time.monotonic()
        out = []
        with self._lock:
            for e in sorted(self._entries.values(), key=lambda e: -e.last_used):
                if not e.ready.is_set() or e.session is None:
                    continue
                expires = None if math.isinf(e.expires) else now_wall + (e.expires - now)
                out.append(LoadedModel(e.model.name, e.model, e.session.backend, e.session.info(), expires,
                                       e.model.size, e.session.pid))
        return out

    @property
    def loading(self) -> bool:
        """Whether a model is being loaded now."""
        with self._lock:
            return any(not e.ready.is_set() for e in self._entries.values())

    def _reap(self) -> None:
        """Unload models whose keep-alive has run out."""
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                for e in list(self._entries.values()):
                    if e.users == 0 and e.ready.is_set() and e.expires <= now:
                        self._evict(e)
                nearest = min((e.expires for e in self._entries.values() if e.users == 0), default=math.inf)
                # A keep-alive of 1e308 s is finite but no timeout the OS takes: it would kill this thread.
                wait = min(threading.TIMEOUT_MAX, max(0.01, nearest - time.monotonic()))
                self._lock.wait(None if math.isinf(nearest) else wait)

    def close(self) -> None:
        """Unload every model."""
        with self._lock:
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._lock.notify_all()
        for e in entries:
            if e.session is not None:
                _close_quietly(e.session)


def _close_quietly(session: Session) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - a dead engine process is already closed
        pass
