"""Fixtures for the TUI tests: apps on the isolated store, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from localrun.settings import LoadOptions

GREEDY = {"temperature": 0, "seed": 1}


@pytest.fixture
def make_app() -> Iterator[Callable[..., Any]]:
    """Build LocalrunApp instances (greedy, small context); their engines are closed at teardown."""
    from tui.app import LocalrunApp

    apps: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("settings", GREEDY)
        kwargs.setdefault("load_options", LoadOptions(n_ctx=1024))
        app = LocalrunApp(**kwargs)
        apps.append(app)
        return app

    yield make
    for app in apps:
        app.models.close()
