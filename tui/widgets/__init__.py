"""Widgets shared by the screens."""

from __future__ import annotations
