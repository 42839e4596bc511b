"""The one loaded model of the TUI, shared by the chat screen's worker threads."""

from __future__ import annotations

import threading
from typing import Any

from localrun import api
from localrun.generation import LoadOptions


class Engine:
    """Loads a model on demand (off the UI thread) and keeps it until another one is needed."""

    def __init__(self, options: LoadOptions | None = None, engine: str | None = None) -> None:
        self.options = options or LoadOptions()
        self.engine = engine
        self._lock = threading.Lock()
        self._session: Any = None
        self._model: str | None = None

    @property
    def model(self) -> str | None:
        return self._model

    def session(self, model: str) -> Any:
        """The session for `model`, loading it (and closing the previous one) when needed."""
        with self._lock:
            if self._session is not None and self._model == model:
                return self._session
            self._close_locked()
            self._session = api.load(model, self.options, engine=self.engine)
            self._model = model
            return self._session

    def info(self) -> dict[str, Any]:
        """What the engine reports about the loaded model (n_ctx, threads...)."""
        session = self._session
        return session.info() if session is not None else {}

    def drop(self) -> None:
        """Forget the session (after a crash): the next request loads the model again."""
        with self._lock:
            self._close_locked()

    def release(self, model: str) -> None:
        """Close the session if it holds `model` (before the model is deleted)."""
        with self._lock:
            if self._model == model:
                self._close_locked()

    def close(self) -> None:
        """Close the engine process."""
        self.drop()

    def _close_locked(self) -> None:
        session, self._session, self._model = self._session, None, None
        if session is not None:
            try:
                session.close()
            except Exception:  # noqa: BLE001 - a dead engine process is already closed
                pass
