"""The one-line bar at the top of each screen: where you are and how to go elsewhere."""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label

TABS = (("library", "F2", "Library"), ("discover", "F3", "Discover"), ("chat", "F4", "Chat"),
        ("convert", "F5", "Convert"))


class NavTab(Label):
    """One tab; a click switches to its screen."""

    def __init__(self, mode: str, key: str, title: str, current: bool) -> None:
        super().__init__(f"{key} {title}", classes="-current" if current else "")
        self.mode = mode

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.app.switch_mode(self.mode)


class NavBar(Horizontal):
    """The app name, the screens with their keys, and the help key."""

    def __init__(self, current: str) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        yield Label("localrun", id="nav-brand")
        for mode, key, title in TABS:
            yield NavTab(mode, key, title, mode == self.current)
        yield Label("F1 Help  ^P Commands", id="nav-help")
