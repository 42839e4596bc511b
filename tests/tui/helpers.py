"""Helpers for driving the real app headless."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from textual.pilot import Pilot

# Bounded waits: 0.05 s pauses, at most this many (a slow shared CI runner, a real engine).
MAX_PAUSES = 4000


async def wait_for(pilot: Pilot[Any], condition: Callable[[], bool], what: str, max_pauses: int = MAX_PAUSES) -> None:
    """Let the app run until `condition()` holds; fail naming `what` if it never does."""
    for _ in range(max_pauses):
        if condition():
            return
        await pilot.pause(0.05)
    raise AssertionError(f"timed out waiting for {what}")


