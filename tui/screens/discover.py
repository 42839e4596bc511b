"""Discover: search the Hugging Face Hub, see a repository's files, download with progress."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import DataTable, Footer, Input, Static

from localrun import api
from localrun.errors import CancelledError, LocalrunError
from localrun.units import duration, size
from tui.messages import ModelsChanged
from tui.widgets.navbar import NavBar

HUB_CALLS = ("search_models", "list_repo_files", "estimate_fit", "pull")
DEBOUNCE_S = 0.4
FIT_BADGES = {"gpu": "GPU", "ram": "RAM", "none": "too big"}
MAX_FIT_CHECKS = 16  # each one reads a remote GGUF header


def hub_available() -> bool:
    """Whether localrun.api has the Hub functions this screen needs."""
    return all(hasattr(api, name) for name in HUB_CALLS)


@dataclass
class Download:
    """One download, shared by the worker thread and the panel."""

    spec: str
    cancel: threading.Event = field(default_factory=threading.Event)
    state: str = "starting"  # starting, downloading, verifying, done, cancelled, failed
    done: int = 0
    total: int = 0
    speed: float = 0.0
    eta: float | None = None
    error: str = ""

    def line(self) -> str:
        pct = f"{100 * self.done / self.total:3.0f}%" if self.total else "  -%"
        if self.state in ("downloading", "verifying"):
            return (f"{self.spec}  {pct}  {size(self.done)}/{size(self.total)}  {size(self.speed)}/s"
                    f"  ETA {duration(self.eta)}  [{self.state}]")
        if self.state == "failed":
            return f"{self.spec}  failed: {self.error}"
        return f"{self.spec}  {pct}  [{self.state}]"


class DiscoverScreen(Screen[None]):
    """Hub search as you type, a repository's files with fit badges, downloads that keep running."""

    BINDINGS = [
        Binding("c", "cancel_download", "Cancel download"),
        Binding("ctrl+f", "focus_search", "Search"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self._debounce: Timer | None = None
        self.repo: str | None = None
        self.results: list[Any] = []
        self.files: list[Any] = []
        self.searches = 0  # completed searches (tests)

    def compose(self) -> ComposeResult:
        yield NavBar("discover")
        if not hub_available():
            yield Static(
                "Hub search is not available in this build: localrun.api lacks "
                + ", ".join(n for n in HUB_CALLS if not hasattr(api, n))
                + ".\nInstalled models are in the Library (F2).",
                id="discover-unavailable", markup=False)
            yield Footer()
            return
        yield Input(placeholder="Search the Hugging Face Hub (e.g. qwen3 gguf)", id="search")
        results: DataTable[str] = DataTable(id="results", cursor_type="row")
        results.add_columns("Repository", "Downloads", "Likes", "Formats")
        yield results
        files: DataTable[str] = DataTable(id="files", cursor_type="row")
        files.add_columns("File", "Quant", "Size", "Fit")
        yield files
        yield Static("No downloads. Enter on a file downloads it; c cancels; Enter again resumes.",
                     id="downloads", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        if hub_available():
            self.query_one("#search", Input).focus()

    def action_focus_search(self) -> None:
        if hub_available():
            self.query_one("#search", Input).focus()

    # -- search ----------------------------------------------------------------------------
    @on(Input.Changed, "#search")
    def _changed(self, event: Input.Changed) -> None:
        if self._debounce is not None:
            self._debounce.stop()
        query = event.value.strip()
        if query:
            self._debounce = self.set_timer(DEBOUNCE_S, lambda: self.search(query))

    @on(Input.Submitted, "#search")
    def _submitted(self, event: Input.Submitted) -> None:
        if self._debounce is not None:
            self._debounce.stop()
        if event.value.strip():
            self.search(event.value.strip())
            self.query_one("#results", DataTable).focus()

    @work(thread=True, exclusive=True, group="hub-search")
    def search(self, query: str) -> None:
        """Search off the UI thread; a newer search replaces this one."""
        try:
            found = api.search_models(query, limit=30)  # type: ignore[attr-defined]
        except LocalrunError as e:
            self.app.call_from_thread(self._search_failed, str(e))
            return
        self.app.call_from_thread(self._show_results, found)

    def _search_failed(self, error: str) -> None:
        self.searches += 1
        self.notify(error, severity="error", timeout=8)

    def _show_results(self, found: list[Any]) -> None:
        self.searches += 1
        self.results = found
        table = self.query_one("#results", DataTable)
        table.clear()
        for r in found:
            table.add_row(r.id, f"{r.downloads or 0:,}", str(r.likes or 0), ", ".join(r.formats) or "-", key=r.id)

    @on(DataTable.RowSelected, "#results")
    def _repo_selected(self, event: DataTable.RowSelected) -> None:
        if 0 <= event.cursor_row < len(self.results):
            self.repo = self.results[event.cursor_row].id
            self.query_one("#files", DataTable).clear()
            self.list_files(self.repo)

    # -- files -----------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="hub-files")
    def list_files(self, repo: str) -> None:
        try:
            listing = api.list_repo_files(repo)  # type: ignore[attr-defined]
        except LocalrunError as e:
            self.app.call_from_thread(self.notify, str(e), severity="error", timeout=8)
            return
        weights = [f for f in listing.files if f.is_weights and (f.split is None or f.split[0] == 1)]
        self.app.call_from_thread(self._show_files, repo, weights)
        for f in weights[:MAX_FIT_CHECKS]:
            if f.path.lower().endswith(".gguf"):
                try:
                    fit = api.estimate_fit(f"{repo}:{f.path}")  # type: ignore[attr-defined]
                    badge = FIT_BADGES.get(fit.verdict, fit.verdict)
                except LocalrunError:
                    badge = "?"
                self.app.call_from_thread(self._set_fit, repo, f.path, badge)

    def _show_files(self, repo: str, files: list[Any]) -> None:
        if repo != self.repo:
            return
        self.files = files
        table = self.query_one("#files", DataTable)
        table.clear()
        for f in files:
            shown = f.path + (f" (+{f.split[1] - 1} parts)" if f.split else "")
            table.add_row(shown, f.quant or "-", size(f.size), "…" if f.path.lower().endswith(".gguf") else "-",
                          key=f.path)
        if files:
            table.focus()

    def _set_fit(self, repo: str, path: str, badge: str) -> None:
        if repo != self.repo:
            return
        table = self.query_one("#files", DataTable)
        try:
            table.update_cell(path, table.ordered_columns[3].key, badge)
        except LookupError:
            pass

    @on(DataTable.RowSelected, "#files")
    def _file_selected(self, event: DataTable.RowSelected) -> None:
        if self.repo and 0 <= event.cursor_row < len(self.files):
            self.start_download(f"{self.repo}:{self.files[event.cursor_row].path}")

    # -- downloads -------------------------------------------------------------------------
    def start_download(self, spec: str) -> None:
        """Start (or resume) a download; it runs on the app, so it survives screen switches."""
        app: Any = self.app
        current = app.downloads.get(spec)
        if current is not None and current.state in ("starting", "downloading", "verifying"):
            self.notify(f"{spec} is already downloading", severity="warning")
            return
        dl = Download(spec)
        app.downloads[spec] = dl
        self.render_downloads()
        app.run_worker(lambda: self._pull(dl), thread=True, group="downloads", name=spec)

    def _pull(self, dl: Download) -> None:
        def progress(p: Any) -> None:
            dl.state = "verifying" if p.phase == "verify" else "downloading"
            dl.done, dl.total, dl.speed, dl.eta = p.done, p.total, p.speed, p.eta
            self.app.call_from_thread(self.render_downloads)

        try:
            result = api.pull(dl.spec, progress=progress, cancel=dl.cancel)  # type: ignore[attr-defined]
        except CancelledError:
            dl.state = "cancelled"
            self.app.call_from_thread(self.render_downloads)
            self.app.call_from_thread(self.notify, f"Cancelled {dl.spec}; Enter on the file resumes it")
            return
        except LocalrunError as e:
            dl.state, dl.error = "failed", str(e)
            self.app.call_from_thread(self.render_downloads)
            self.app.call_from_thread(self.notify, str(e), severity="error", timeout=10)
            return
        except Exception as e:  # noqa: BLE001 - a download never takes the app down
            dl.state, dl.error = "failed", f"{type(e).__name__}: {e}"
            self.app.call_from_thread(self.render_downloads)
            self.app.call_from_thread(self.notify, dl.error, severity="error", timeout=10)
            return
        dl.state = "done"
        dl.done = dl.total = max(dl.total, dl.done)
        name = result.model.name
        self.app.call_from_thread(self.render_downloads)
        self.app.call_from_thread(self.notify, f"Downloaded {name}: it is in the Library")
        self.app.post_message(ModelsChanged(name))

    def render_downloads(self) -> None:
        downloads: dict[str, Download] = self.app.downloads  # type: ignore[attr-defined]
        if not downloads or not hub_available():
            return
        self.query_one("#downloads", Static).update("\n".join(d.line() for d in downloads.values()))

    def action_cancel_download(self) -> None:
        downloads: dict[str, Download] = self.app.downloads  # type: ignore[attr-defined]
        active = [d for d in downloads.values() if d.state in ("starting", "downloading", "verifying")]
        if not active:
            self.notify("No download is running", severity="warning")
            return
        target = active[-1]
        if self.repo and self.files:
            row = self.query_one("#files", DataTable).cursor_row
            if 0 <= row < len(self.files):
                wanted = f"{self.repo}:{self.files[row].path}"
                target = next((d for d in active if d.spec == wanted), target)
        target.cancel.set()
        target.state = "cancelling"
        self.render_downloads()
