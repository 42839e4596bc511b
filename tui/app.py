"""The localrun Textual app: four screens (modes), a pool of loaded models, saved conversations,
the MCP servers whose tools the chat may use."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.notifications import SeverityLevel
from textual.screen import Screen

from localrun import api
from localrun.settings import LoadOptions
from tui.chat_tools import MAX_STEPS, ChatTools
from tui.conversations import ConversationStore
from tui.messages import ModelsChanged
from tui.screens.chat import ChatScreen
from tui.screens.convert import ConvertScreen
from tui.screens.dialogs import HelpScreen
from tui.screens.discover import DiscoverScreen
from tui.screens.library import LibraryScreen

SCREENS: dict[str, type[Screen[Any]]] = {
    "library": LibraryScreen,
    "discover": DiscoverScreen,
    "chat": ChatScreen,
    "convert": ConvertScreen,
}
DARK, LIGHT = "textual-dark", "textual-light"


class LocalrunApp(App[None]):
    """Library, Discover, Chat and Convert, switched with F2-F5."""

    CSS_PATH = "app.tcss"
    TITLE = "localrun"
    DEFAULT_MODE = "library"
    ENABLE_COMMAND_PALETTE = True
    BINDINGS = [
        Binding("f1", "help", "Help", show=False),
        Binding("f2", "switch_mode('library')", "Library", show=False),
        Binding("f3", "switch_mode('discover')", "Discover", show=False),
        Binding("f4", "switch_mode('chat')", "Chat", show=False),
        Binding("f5", "switch_mode('convert')", "Convert", show=False),
        Binding("ctrl+t", "toggle_theme", "Theme", show=False),
        Binding("ctrl+c", "quit", "Quit", show=False, priority=True),
    ]

    def __init__(
        self,
        settings: Mapping[str, Any] | None = None,
        load_options: LoadOptions | None = None,
        engine: str | None = None,
        system: str | None = None,
        model: str | None = None,
        conversations: ConversationStore | None = None,
        theme: str | None = None,
        mcp: str | os.PathLike[str] | None = None,
        use_mcp: bool = True,
        allowed_tools: Sequence[str] = (),
        max_tool_steps: int = MAX_STEPS,
        tool_choice: str | None = None,
    ) -> None:
        super().__init__()
        self.model_warnings: set[tuple[str, str]] = set()  # (model, warning) already shown
        self.default_settings = dict(settings or {})  # a new chat's own settings: `tui`'s generation flags
        self.default_system = system
        self.initial_model = model
        # MCP servers: localrun's own mcp.json or `tui --mcp FILE`; started on the first message with
        # tools on, stopped when the app exits. A bad --mcp file is refused here, before the UI starts.
        self.mcp = ChatTools(mcp, use_mcp, allowed_tools, max_tool_steps, tool_choice)
        # The TUI keeps the model it chats with loaded until another one is needed.
        self.models = api.model_pool(load_options, engine, max_loaded=1, keep_alive=-1)
        self.conversations = conversations or ConversationStore()
        self.mode_screens: dict[str, Screen[Any]] = {}
        self.notices: list[tuple[str, str]] = []
        self.downloads: dict[str, Any] = {}  # spec -> tui.screens.discover.Download, across screens
        for name, cls in SCREENS.items():
            self.add_mode(name, self._factory(name, cls))
        if theme:
            self.theme = theme

    def _factory(self, name: str, cls: type[Screen[Any]]) -> Callable[[], Screen[Any]]:
        def make() -> Screen[Any]:
            screen = cls()
            self.mode_screens[name] = screen
            return screen

        return make

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = False) -> None:
        """Show a notification (plain text: error messages may hold brackets) and keep a log of it."""
        self.notices.append((severity, message))
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    def on_mount(self) -> None:
        if self.mcp.notice:
            self.notify(self.mcp.notice, title="MCP", severity="warning", timeout=15)
        if self.initial_model:
            self.call_after_refresh(self.open_chat, self.initial_model)

    async def open_chat(self, model: str) -> None:
        """Switch to the Chat screen with a new conversation with `model`."""
        from localrun import api
        from localrun.errors import LocalrunError

        try:
            name = api.resolve_target(model).name  # an adapter opens as base+adapter
        except LocalrunError as e:
            self.notify(str(e), severity="error", timeout=10)
            return
        await self.switch_mode("chat")
        chat = self.mode_screens["chat"]
        assert isinstance(chat, ChatScreen)
        await chat.open_model(name)

    def on_models_changed(self, message: ModelsChanged) -> None:
        library = self.mode_screens.get("library")
        if isinstance(library, LibraryScreen):
            library.refresh_models(message.select)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(tools=self.mcp.configured))

    def action_toggle_theme(self) -> None:
        self.theme = LIGHT if self.theme == DARK else DARK

    def _stop_background(self) -> None:
        chat = self.mode_screens.get("chat")
        if isinstance(chat, ChatScreen):
            chat.cancel.set()
        for download in self.downloads.values():
            download.cancel.set()  # partial files stay for a resume next time

    async def action_quit(self) -> None:
        self._stop_background()
        self.exit()

    def on_unmount(self) -> None:
        self._stop_background()
        self.mcp.close()
        self.models.close()

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for name, title, help_text in (
            ("library", "Library", "Installed models (F2)"),
            ("discover", "Discover", "Search the Hugging Face Hub and download (F3)"),
            ("chat", "Chat", "The current conversation (F4)"),
            ("convert", "Convert", "Convert a checkpoint to GGUF, or compare quantizations (F5)"),
        ):
            yield SystemCommand(title, help_text, lambda n=name: self.switch_mode(n))  # type: ignore[misc]
        yield SystemCommand("Conversations", "Resume a saved conversation (Ctrl+O)", self._conversations)
        yield SystemCommand("Toggle dark / light", "Switch between the dark and light themes (Ctrl+T)",
                            self.action_toggle_theme)
        yield SystemCommand("Keys", "Every key of every screen (F1)", self.action_help)

    async def _conversations(self) -> None:
        await self.switch_mode("chat")
        chat = self.mode_screens["chat"]
        assert isinstance(chat, ChatScreen)
        chat.action_conversations()
