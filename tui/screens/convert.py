"""Convert: a Hugging Face checkpoint folder to GGUF, or a quantization ladder of a checkpoint or a
16/32-bit GGUF (every rung measured, shown as a table and a plot); the results join the Library."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import (
    Button,
    DataTable,
    DirectoryTree,
    Footer,
    Input,
    Label,
    ProgressBar,
    Select,
    Static,
    TabbedContent,
    TabPane,
)

from localrun import api
from localrun.errors import LocalrunError
from localrun.units import duration, size
from tui.messages import ModelsChanged
from tui.widgets.ladder import LadderPlot, fill_table
from tui.widgets.navbar import NavBar

OUTTYPES = ("auto", "f16", "bf16", "f32", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "iq4_xs")
RESULT_TABS = ("convert-rungs", "convert-plot")


def run_conversion(src: str, outtype: str, name: str | None, progress: Any) -> Any:
    """Convert and register the result (runs in a worker thread)."""
    return api.convert_model(src, outtype=outtype, name=name, progress=progress)


def run_ladder(src: str, types: list[str], name: str | None, options: dict[str, Any], progress: Any) -> Any:
    """Build, measure and register every rung (runs in a worker thread); returns the Ladder."""
    return api.quantize_ladder(src, types, name=name, progress=progress, **options)


def ladder_types(text: str) -> list[str]:
    """The types of a comma-separated ladder, e.g. "q8_0, Q4_K_M" -> ["q8_0", "q4_k_m"]."""
    return [t.strip().lower() for t in text.split(",") if t.strip()]


class SourceTree(DirectoryTree):
    """Folders and GGUF files, without hidden entries: what can be a source."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [p for p in paths if not p.name.startswith(".") and (p.is_dir() or p.suffix.lower() == ".gguf")]


class ConvertScreen(Screen[None]):
    """Pick a checkpoint folder (or a GGUF file for a ladder) and an output type, watch the progress."""

    BINDINGS = [Binding("ctrl+g", "start", "Convert")]

    def __init__(self) -> None:
        super().__init__()
        self.running = False
        self.ladder: Any = None  # the last ladder's result (localrun.workbench.ladder.Ladder)
        # Extra keyword arguments of api.quantize_ladder (out_dir, imatrix, text, n_ctx, bench, ...).
        self.ladder_options: dict[str, Any] = {}

    def compose(self) -> ComposeResult:
        yield NavBar("convert")
        with Vertical(id="convert-form"):
            src = Input(placeholder="/path/to/hf-checkpoint or /path/to/model-F16.gguf", id="convert-src")
            src.border_title = "Source: a checkpoint folder or a 16/32-bit GGUF file"
            yield src
            with TabbedContent(id="convert-tabs"):
                with TabPane("Files", id="convert-files"):
                    yield SourceTree(".", id="convert-tree")
                with TabPane("Rungs", id="convert-rungs", disabled=True):
                    yield DataTable(id="ladder-table", cursor_type="row", zebra_stripes=True)
                with TabPane("Size vs KLD", id="convert-plot", disabled=True):
                    yield LadderPlot(id="ladder-plot")
            with Vertical(id="convert-settings"):
                with Horizontal(classes="convert-row"):
                    yield Label("Output type", classes="convert-key")
                    yield Select([(t, t) for t in OUTTYPES], value="auto", allow_blank=False, id="convert-type",
                                 compact=True)
                    yield Label("Name")
                    yield Input(placeholder="default: from file name", id="convert-name", compact=True)
                    yield Button("Convert (^G)", id="convert-start", variant="primary", compact=True)
                with Horizontal(classes="convert-row"):
                    yield Label("Ladder", classes="convert-key")
                    yield Input(placeholder="e.g. q8_0,q6_k,q4_k_m to build and compare (empty: one file)",
                                id="convert-ladder", compact=True)
            bar = ProgressBar(id="convert-progress", show_eta=False)
            bar.display = False  # shown once a conversion starts
            yield bar
            yield Static("Choose a folder, then press Ctrl+G.", id="convert-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#convert-src", Input).focus()

    @on(DirectoryTree.DirectorySelected)
    @on(DirectoryTree.FileSelected)
    def _path_selected(self, event: DirectoryTree.DirectorySelected | DirectoryTree.FileSelected) -> None:
        path = Path(event.path).resolve()
        self.query_one("#convert-src", Input).value = str(path)
        if path.is_file() and not self.query_one("#convert-ladder", Input).value.strip():
            self._status("A GGUF file: give the ladder types (e.g. q8_0,q6_k,q4_k_m), then press Ctrl+G.")

    @on(Input.Changed, "#convert-ladder")
    def _ladder_changed(self, event: Input.Changed) -> None:
        ladder = bool(ladder_types(event.value))
        self.query_one("#convert-type", Select).disabled = ladder  # each rung has its own type
        self.query_one("#convert-start", Button).label = "Ladder (^G)" if ladder else "Convert (^G)"

    @on(Input.Submitted, "#convert-src")
    @on(Input.Submitted, "#convert-ladder")
    @on(Button.Pressed, "#convert-start")
    def action_start(self) -> None:
        if self.running:
            self.notify("A conversion is already running", severity="warning")
            return
        src = self.query_one("#convert-src", Input).value.strip()
        if not src:
            self.notify("Choose a checkpoint folder or a GGUF file first", severity="warning")
            return
        name = self.query_one("#convert-name", Input).value.strip() or None
        types = ladder_types(self.query_one("#convert-ladder", Input).value)
        if not types and Path(src).expanduser().is_file():
            self.notify(f"{Path(src).name} is a file: give the ladder types to quantize it, e.g. q8_0,q4_k_m",
                        severity="warning")
            return
        self.running = True
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.display = True
        if types:
            bar.update(total=len(types), progress=0)
            self._status(f"Ladder of {src}: {', '.join(types)}…")
            self.build_ladder(src, types, name)
            return
        outtype = str(self.query_one("#convert-type", Select).value)
        bar.update(total=None, progress=0)
        self._status(f"Converting {src} to {outtype}…")
        self.convert(src, outtype, name)

    def _status(self, text: str) -> None:
        self.query_one("#convert-status", Static).update(text)

    @work(thread=True, group="convert")
    def convert(self, src: str, outtype: str, name: str | None) -> None:
        last = 0.0

        def progress(p: Any) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= 0.1 or p.index >= p.total_tensors:
                last = now
                self.app.call_from_thread(self._progress, p)

        info = self._attempt(lambda: run_conversion(src, outtype, name, progress))
        if info is None:
            return
        self.app.call_from_thread(self._done, info.name, info.path)
        self.app.post_message(ModelsChanged(info.name))

    @work(thread=True, group="convert")
    def build_ladder(self, src: str, types: list[str], name: str | None) -> None:
        def progress(step: Any) -> None:
            self.app.call_from_thread(self._ladder_progress, step)

        result = self._attempt(lambda: run_ladder(src, types, name, dict(self.ladder_options), progress))
        if result is None:
            return
        self.app.call_from_thread(self._ladder_done, result)
        rec = result.recommended()
        self.app.post_message(ModelsChanged(rec.name if rec else None))

    def _attempt(self, job: Callable[[], Any]) -> Any:
        """job() in the worker thread; a failure (None returned) goes to the status line, the app goes on."""
        try:
            return job()
        except LocalrunError as e:
            self.app.call_from_thread(self._failed, str(e))
        except Exception as e:  # noqa: BLE001 - the app keeps running whatever the converter does
            self.app.call_from_thread(self._failed, f"{type(e).__name__}: {e}")
        return None

    def _progress(self, p: Any) -> None:
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.update(total=max(p.total_bytes, 1), progress=p.bytes_done)
        self._status(f"{p.stage}: {p.index}/{p.total_tensors} tensors, {size(p.bytes_done)}/{size(p.total_bytes)}, "
                     f"{size(p.rate)}/s, ETA {duration(p.eta_s)}")

    def _ladder_progress(self, step: Any) -> None:
        """A ladder.Step: the bar counts finished rungs, the status line says what runs now."""
        self.query_one("#convert-progress", ProgressBar).update(progress=step.done)
        self._status(f"Ladder: {step}")

    def _done(self, name: str, path: str) -> None:
        self.running = False
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.update(total=1, progress=1)
        self._status(f"Done: {name} ({path}) is in the Library.")
        self.notify(f"Converted: {name} is in the Library")

    def _ladder_done(self, ladder: Any) -> None:
        self.running = False
        self.ladder = ladder
        self.query_one("#convert-progress", ProgressBar).update(total=1, progress=1)
        fill_table(self.query_one("#ladder-table", DataTable), ladder)
        self.query_one("#ladder-plot", LadderPlot).show(ladder)
        tabs = self.query_one("#convert-tabs", TabbedContent)
        for tab in RESULT_TABS:
            tabs.enable_tab(tab)
        tabs.active = "convert-rungs"
        rec = ladder.recommended()
        verdict = (f"{rec.type} is recommended, the smallest rung with mean KLD ≤ {ladder.budget:g}" if rec
                   else f"no rung has a mean KLD within {ladder.budget:g}")
        folder = Path(ladder.rungs[0].path).parent if ladder.rungs else Path(ladder.reference).parent
        self._status(f"Ladder done: {verdict}.\n{len(ladder.rungs)} rungs in the Library; report: {folder}/report.md")
        self.notify(f"Ladder done: {verdict}")

    def _failed(self, error: str) -> None:
        self.running = False
        self._status(f"Failed: {error}")
        self.notify(error, severity="error", timeout=10)
