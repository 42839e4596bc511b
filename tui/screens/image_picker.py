"""The image picker: folders and image files in a tree; Enter on a file attaches it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Static

from localrun.images import SUFFIXES


class ImageTree(DirectoryTree):
    """Folders and the image files localrun reads; hidden ones left out."""

    def filter_paths(self, paths: Iterable[Path]) -> Iterable[Path]:
        return [p for p in paths
                if not p.name.startswith(".") and (p.suffix.lower() in SUFFIXES or p.is_dir())]


class ImagePickerScreen(ModalScreen[Path | None]):
    """Pick an image file: `Enter` attaches it (or opens a folder), `Backspace` goes up a folder,
    `Esc` cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("backspace", "up", "Up a folder")]

    def __init__(self, folder: Path) -> None:
        super().__init__(classes="dialog-screen")
        self.folder = folder if folder.is_dir() else Path.home()

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog image-picker"):
            yield Static("Pick an image: Enter attaches, Backspace goes up, Esc cancels",
                         classes="dialog-text")
            yield Static(str(self.folder), id="picker-folder", markup=False)
            yield ImageTree(self.folder, id="picker-tree")

    def on_mount(self) -> None:
        self.query_one(ImageTree).focus()

    @on(DirectoryTree.FileSelected)
    def _picked(self, event: DirectoryTree.FileSelected) -> None:
        self.dismiss(event.path)

    def action_up(self) -> None:
        parent = self.folder.parent
        if parent != self.folder:
            self.folder = parent
            self.query_one(ImageTree).path = parent
            self.query_one("#picker-folder", Static).update(str(parent))

    def action_cancel(self) -> None:
        self.dismiss(None)
