"""The Discover screen: the real Hub facade offline, and the screen's own logic on a fake Hub.

The fake Hub below stands in only for the network (search results, a listing, progress events);
the store, the Library and the app are real. It claims nothing about the Hub code itself.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from localrun import api
from localrun.errors import CancelledError
from tests.tui.helpers import wait_for
from tui.screens.discover import DiscoverScreen
from tui.screens.library import LibraryScreen

SIZE = (80, 24)
REPO = "ggml-org/stories260K-GGUF"
FILE = "stories260K.gguf"


def discover(app: Any) -> DiscoverScreen:
    screen = app.mode_screens["discover"]
    assert isinstance(screen, DiscoverScreen)
    return screen


def test_offline_search_is_a_notification(make_app: Any) -> None:
    # HF_HUB_OFFLINE=1 (tests/conftest.py): the real facade refuses and the screen says why.
    app = make_app()

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f3")
            await wait_for(pilot, lambda: isinstance(app.screen, DiscoverScreen), "the discover screen")
            await pilot.press(*"coder")
            await wait_for(pilot, lambda: discover(app).searches == 1, "the debounced search")
            errors = [m for sev, m in app.notices if sev == "error"]
            assert errors and "HF_HUB_OFFLINE" in errors[-1]
            assert app.screen.query_one("#search").value == "coder"  # 'c' etc. typed, not bound

    asyncio.run(run())


class FakeHub:
    """Search, listing and fit answers, and a pull that streams progress until released or cancelled."""

    def __init__(self, stories: Path) -> None:
        self.stories = stories
        self.queries: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def search_models(self, query: str, limit: int = 20, **_: Any) -> list[Any]:
        self.queries.append(query)
        return [SimpleNamespace(id=REPO, downloads=1234, likes=5, formats=("gguf",))]

    def list_repo_files(self, repo: str, revision: str | None = None) -> Any:
        f = SimpleNamespace(path=FILE, size=1_185_376, quant="F32", split=None, is_weights=True)
        readme = SimpleNamespace(path="README.md", size=10, quant=None, split=None, is_weights=False)
        return SimpleNamespace(repo=repo, files=(f, readme))

    def estimate_fit(self, spec: str, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(verdict="ram")

    def pull(self, spec: str, *args: Any, progress: Any = None, cancel: Any = None, **kwargs: Any) -> Any:
        total = 1_185_376
        progress(SimpleNamespace(filename=FILE, done=total // 4, total=total, speed=1e6, eta=1.0, phase="download"))
        self.started.set()
        while not self.release.wait(0.01):
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"the download of {spec} was cancelled")
        progress(SimpleNamespace(filename=FILE, done=total, total=total, speed=1e6, eta=0.0, phase="done"))
        return SimpleNamespace(model=api.add_model(self.stories, name="stories:f32"))


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, stories: Path) -> FakeHub:
    hub = FakeHub(stories)
    for name in ("search_models", "list_repo_files", "estimate_fit", "pull"):
        monkeypatch.setattr(api, name, getattr(hub, name), raising=False)
    return hub


def test_search_files_download_cancel_resume(make_app: Any, fake_hub: FakeHub) -> None:
    app = make_app()

    async def run() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press("f3")
            screen = discover(app)
            await pilot.press(*"stories")
            await wait_for(pilot, lambda: screen.searches == 1, "the debounced search")
            assert fake_hub.queries == ["stories"]  # one search for the whole word, not one per key
            results = screen.query_one("#results")
            assert results.row_count == 1
            results.focus()
            await pilot.press("enter")
            files = screen.query_one("#files")
            await wait_for(pilot, lambda: files.row_count == 1 and files.get_cell_at((0, 3)) == "RAM",
                           "the weight files with their fit badge")
            await pilot.press("enter")  # download
            await wait_for(pilot, lambda: fake_hub.started.is_set() and "25%" in str(
                screen.query_one("#downloads").render()), "download progress")
            await pilot.press("c")
            await wait_for(pilot, lambda: app.downloads[f"{REPO}:{FILE}"].state == "cancelled", "the cancel")
            assert "stories:f32" not in [m.name for m in api.list_models()]
            # Enter again resumes; the download keeps running while we look at the Library.
            fake_hub.started.clear()
            await pilot.press("enter")
            await wait_for(pilot, fake_hub.started.is_set, "the resumed download")
            await pilot.press("f2")
            fake_hub.release.set()
            lib = app.mode_screens["library"]
            assert isinstance(lib, LibraryScreen)
            await wait_for(pilot, lambda: "stories:f32" in lib.row_names(), "the download in the Library")
            assert app.downloads[f"{REPO}:{FILE}"].state == "done"

    asyncio.run(run())
