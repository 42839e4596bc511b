"""Engines behind one protocol; the model's format decides which may run it."""

from __future__ import annotations

from localrun.backends.base import Backend, Session, backend_names, backends_for, get_backend

__all__ = ["Backend", "Session", "get_backend", "backend_names", "backends_for"]
