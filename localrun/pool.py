"""Loaded models: load on demand, keep alive for a while after use, evict, reload after a crash.

Used by the TUI and the server alike. Keep-alive follows Ollama's rule: a model stays loaded for
`keep_alive` seconds after its last use ends (negative or infinite: forever; 0: unload as soon as
nobody uses it). Models stay loaded side by side while the memory holds them all (their weights,
KV caches and compute buffers, as fit.model_memory estimates them), and at most `max_loaded` of
them when it is set; to load another, the ones idle longest are unloaded until it fits. When the
models that would have to go are in use, the new one waits for them to finish (a request never
fails because another model is loaded); a model that would not fit even alone is refused.

A loaded instance is a model under its load options: a use whose options differ (a KV-cache type,
a context larger than any loaded instance has) gets an instance of its own, beside the others when
max_loaded and the memory allow, else in place of the one idle longest. A use's n_ctx is the least
context it needs, so an instance with a larger context serves it; an instance is never loaded with
less than the pool's default context, so one serves every use that asks for no more than that.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from localrun.backends.base import Session
from localrun.errors import EngineError
from localrun.settings import LoadOptions
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
        self.options = options  # what it was loaded with
        self.settings = replace(options, n_ctx=None)  # the options that must match a use's exactly
        self.context: int | None = options.n_ctx  # per sequence; the engine's own once loaded
        self.session: Session | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.users = 0
        self.expires = math.inf  # monotonic time; inf while in use or kept forever
        self.last_used = time.monotonic()


class Pool:
    """The models loaded by one front end (the TUI, the server); thread-safe."""

    def __init__(self, loader: Callable[..., Session], resolve: Callable[[str], ModelInfo],
                 options: LoadOptions | None = None, engine: str | None = None, *, max_loaded: int = 0,
                 keep_alive: float = DEFAULT_KEEP_ALIVE,
                 on_load: Callable[[ModelInfo, Session], None] | None = None) -> None:
        """loader(model, options, engine=, event_loop=) loads a session (api.load); resolve(name)
        finds a model (api.get_model); on_load(model, session) is told of each load that succeeds."""
        self.options = options or LoadOptions()
        self.engine = engine
        self.max_loaded = max(0, max_loaded)  # 0: as many as the memory holds
        self.keep_alive = keep_alive
        self.event_loop: asyncio.AbstractEventLoop | None = None  # a server's: its sessions are read on that loop
        self._loader = loader
        self._on_load = on_load
        self._resolve = resolve
        self._lock = threading.Condition()
        self._entries: dict[tuple[str, LoadOptions], _Entry] = {}  # (model name, load options) -> instance
        self._defaults: dict[tuple[str, LoadOptions], int] = {}  # the default context of (name, settings)
        self._closed = False
        self.waiting = 0  # uses waiting for models in use to finish, so that theirs fits
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
            options: load options for this model instead of the pool's (a client's context or
                KV-cache type, MLX adapters applied at load: the model then goes under its own
                name, e.g. base+adapter). Their n_ctx is the least context the use needs.

        Raises:
            ModelNotFoundError, BadModelFileError, BackendUnavailableError, EngineError (load
            failed or not enough memory even alone).
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
        need = options.n_ctx or 0
        default = self._default_context(info, options) if need else None  # outside the lock: it reads the machine
        while True:
            with self._lock:
                if self._closed:
                    raise EngineError("the model pool is closed")
                entry = self._find(info.name, options, default)
                if entry is not None and entry.ready.is_set() and entry.error is None:
                    assert entry.session is not None
                    if entry.session.alive:
                        entry.users += 1
                        entry.expires = math.inf
                        return entry
                    self._drop(entry)  # the engine crashed: load it again
                    self._close_later(entry)
                    entry = None
                if entry is None:
                    # Never less than the default context, so that the instance serves the uses that ask for none
                    load = replace(options, n_ctx=max(need, default or 0)) if need else options
                    if not self._make_room(info, load):
                        self.waiting += 1  # models in use must finish first: a release wakes this
                        try:
                            self._lock.wait()
                        finally:
                            self.waiting -= 1
                        continue
                    entry = _Entry(info, load)
                    entry.users = 1
                    self._entries[info.name, load] = entry
                    loading = True
                else:
                    loading = False
            if loading:
                return self._load_entry(entry)
            entry.ready.wait()
            if entry.error is not None:
                raise entry.error

    def _find(self, name: str, options: LoadOptions, default: int | None) -> _Entry | None:
        """The instance that serves a use of these options: the same settings and at least the
        context asked for (a loading one without a known context is taken to get `default`), a
        loaded one before a loading one, the smallest context first; called with the lock held."""
        settings, need = replace(options, n_ctx=None), options.n_ctx or 0
        best: tuple[bool, int] | None = None
        found = None
        for e in self._entries.values():
            if e.model.name != name or e.settings != settings or e.error is not None:
                continue
            context = e.context or (default if not e.ready.is_set() else None) or 0
            if need and context < need:
                continue
            rank = (not e.ready.is_set(), context)
            if best is None or rank < best:
                best, found = rank, e
        return found

    def _default_context(self, info: ModelInfo, options: LoadOptions) -> int:
        """The context an instance loads with when a use asks for none: --ctx, else what the engine
        chooses (fit.context_for), as the first such instance reported it."""
        if self.options.n_ctx:
            return self.options.n_ctx
        settings = replace(options, n_ctx=None)
        known = self._defaults.get((info.name, settings))
        if known is None:
            from localrun.fit import context_for

            known = self._defaults.setdefault((info.name, settings), context_for(info, settings).tokens)
        return known

    def _load_entry(self, entry: _Entry) -> _Entry:
        try:
            entry.session = self._loader(entry.model, entry.options, engine=self.engine, event_loop=self.event_loop)
            context = (entry.session.info() or {}).get("n_ctx")
        except BaseException as e:
            entry.error = e
            with self._lock:
                self._drop(entry)
            entry.ready.set()
            raise
        with self._lock:
            if isinstance(context, int):
                entry.context = context
                if entry.options.n_ctx is None:  # the engine's own default for these settings
                    self._defaults[entry.model.name, entry.settings] = context
        entry.ready.set()
        if self._on_load is not None:
            try:
                self._on_load(entry.model, entry.session)
            except Exception:  # noqa: BLE001 - a listener's failure must not fail the load it hears of
                pass
        return entry

    def _drop(self, entry: _Entry) -> None:
        """Forget an instance (if it is still the pool's); called with the lock held."""
        key = (entry.model.name, entry.options)
        if self._entries.get(key) is entry:
            self._entries.pop(key)

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
            if keep_alive == 0 and self._entries.get((entry.model.name, entry.options)) is entry:
                self._drop(entry)
                self._close_later(entry)
            self._lock.notify_all()

    def _make_room(self, info: ModelInfo, options: LoadOptions) -> bool:
        """Unload idle models until one more fits (count and memory); False when it fits only once
        models in use are released. Called with the lock held.

        Raises:
            EngineError: the model does not fit even with every other model unloaded.
        """
        from localrun.system import ram_bytes

        def idle() -> list[_Entry]:
            return sorted((e for e in self._entries.values() if e.users == 0 and e.ready.is_set()),
                          key=lambda e: e.last_used)

        need = _memory(info, options.n_ctx, options)
        available = ram_bytes()[1]
        if available is not None:
            held = {id(e): _memory(e.model, e.context, e.options) for e in self._entries.values()}
            # A loaded model's weights are mapped from its file: the page cache counts them as available
            available -= sum(e.model.size for e in self._entries.values() if e.model.format == "gguf")
            if need > available + sum(held.values()):
                raise EngineError(
                    f"not enough memory to load '{info.name}': it needs about {need / 1e9:.1f} GB, "
                    f"{max(0, available + sum(held.values())) / 1e9:.1f} GB is available with every other model unloaded",
                    "close other programs, use a smaller quantization or a smaller --ctx")
        while (self.max_loaded and len(self._entries) >= self.max_loaded) or (
                available is not None and need > available):
            victims = idle()
            if not victims:
                return False
            self._evict(victims[0])
            if available is not None:
                available += held[id(victims[0])]
        return True

    def _evict(self, entry: _Entry) -> None:
        self._drop(entry)
        self._close_later(entry)

    @staticmethod
    def _close_later(entry: _Entry) -> None:
        """Close a session off the lock (a worker takes a moment to exit)."""
        session = entry.session
        if session is not None:
            threading.Thread(target=_close_quietly, args=(session,), daemon=True).start()

    # -- state ------------------------------------------------------------------------------
    def unload(self, name: str) -> bool:
        """Unload a model now (every instance of it); requests still running on it end with an error."""
        with self._lock:
            entries = [e for e in self._entries.values() if e.model.name == name]
            for e in entries:
                self._drop(e)
        for e in entries:
            if e.session is not None:
                _close_quietly(e.session)
        return bool(entries)

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


def _memory(model: ModelInfo, context: int | None, options: LoadOptions) -> int:
    """What an instance takes: for a GGUF, llama.cpp's own buffers (weights, every sequence's KV
    cache, compute and output buffers: fit.model_memory); for another format the weights with a
    margin, and the KV cache of every sequence when its context is known."""
    from localrun.fit import kv_cache_bytes, model_memory, shape_of

    if model.format == "gguf":
        return model_memory(model, options, context).total
    kv = kv_cache_bytes(shape_of(model), context * options.n_parallel, options.kv_type) if context else 0
    return int(model.size * MEMORY_MARGIN) + kv
