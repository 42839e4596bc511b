"""Convert: a Hugging Face checkpoint folder to GGUF, with progress; the result joins the Library."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Button, DirectoryTree, Footer, Input, Label, ProgressBar, Select, Static

from localrun import api
from localrun.errors import LocalrunError
from localrun.format import duration, size
from tui.messages import ModelsChanged
from tui.widgets.navbar import NavBar

OUTTYPES = ("auto", "f16", "bf16", "f32", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "iq4_xs")


def run_conversion(src: str, outtype: str, name: str | None, progress: Any) -> Any:
    """Convert and register the result (runs in a worker thread)."""
    return api.convert_model(src, outtype=outtype, name=name, progress=progress)


class ConvertScreen(Screen[None]):
    """Pick a checkpoint folder and an output type, watch the progress."""

    BINDINGS = [Binding("ctrl+g", "start", "Convert")]

    def __init__(self) -> None:
        super().__init__()
        self.running = False

    def compose(self) -> ComposeResult:
        yield NavBar("convert")
        with Vertical(id="convert-form"):
            yield Label("Checkpoint folder (config.json + safetensors/bin + tokenizer):")
            yield Input(placeholder="/path/to/hf-checkpoint", id="convert-src")
            yield DirectoryTree(".", id="convert-tree")
            with Horizontal(id="convert-options"):
                yield Label("Output type")
                yield Select([(t, t) for t in OUTTYPES], value="auto", allow_blank=False, id="convert-type",
                             compact=True)
                yield Label("Name")
                yield Input(placeholder="default: from file name", id="convert-name", compact=True)
                yield Button("Convert (^G)", id="convert-start", variant="primary", compact=True)
            bar = ProgressBar(id="convert-progress", show_eta=False)
            bar.display = False  # shown once a conversion starts
            yield bar
            yield Static("Choose a folder, then press Ctrl+G.", id="convert-status", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#convert-src", Input).focus()

    @on(DirectoryTree.DirectorySelected)
    def _dir_selected(self, event: DirectoryTree.DirectorySelected) -> None:
        self.query_one("#convert-src", Input).value = str(Path(event.path).resolve())

    @on(Input.Submitted, "#convert-src")
    @on(Button.Pressed, "#convert-start")
    def action_start(self) -> None:
        if self.running:
            self.notify("A conversion is already running", severity="warning")
            return
        src = self.query_one("#convert-src", Input).value.strip()
        if not src:
            self.notify("Choose a checkpoint folder first", severity="warning")
            return
        outtype = str(self.query_one("#convert-type", Select).value)
        name = self.query_one("#convert-name", Input).value.strip() or None
        self.running = True
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.display = True
        bar.update(total=None, progress=0)
        self.query_one("#convert-status", Static).update(f"Converting {src} to {outtype}…")
        self.convert(src, outtype, name)

    @work(thread=True, group="convert")
    def convert(self, src: str, outtype: str, name: str | None) -> None:
        last = 0.0

        def progress(p: Any) -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= 0.1 or p.index >= p.total_tensors:
                last = now
                self.app.call_from_thread(self._progress, p)

        try:
            info = run_conversion(src, outtype, name, progress)
        except LocalrunError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        except Exception as e:  # noqa: BLE001 - the app keeps running whatever the converter does
            self.app.call_from_thread(self._failed, f"{type(e).__name__}: {e}")
            return
        self.app.call_from_thread(self._done, info.name, info.path)
        self.app.post_message(ModelsChanged(info.name))

    def _progress(self, p: Any) -> None:
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.update(total=max(p.total_bytes, 1), progress=p.bytes_done)
        self.query_one("#convert-status", Static).update(
            f"{p.stage}: {p.index}/{p.total_tensors} tensors, {size(p.bytes_done)}/{size(p.total_bytes)}, "
            f"{size(p.rate)}/s, ETA {duration(p.eta_s)}")

    def _done(self, name: str, path: str) -> None:
        self.running = False
        bar = self.query_one("#convert-progress", ProgressBar)
        bar.update(total=1, progress=1)
        self.query_one("#convert-status", Static).update(f"Done: {name} ({path}) is in the Library.")
        self.notify(f"Converted: {name} is in the Library")

    def _failed(self, error: str) -> None:
        self.running = False
        self.query_one("#convert-status", Static).update(f"Failed: {error}")
        self.notify(error, severity="error", timeout=10)
