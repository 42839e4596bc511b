"""The Library: installed models, their details, chat, presets and delete."""

from __future__ import annotations

from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Static

from localrun import api
from localrun.errors import LocalrunError
from localrun.store import ModelInfo
from localrun.units import count, size
from tui.messages import ModelsChanged
from tui.screens.dialogs import ConfirmScreen, TextPromptScreen
from tui.screens.preset_editor import PresetEditorScreen, parameters_text
from tui.widgets.navbar import NavBar

COLUMNS = ("Name", "Format", "Arch", "Params", "Quant", "Size", "Context", "Engine")
KIND = "Kind"  # a column shown when a preset or an adapter is listed


def kind_text(model: ModelInfo) -> str:
    """`preset of BASE`, `adapter of BASE`, or nothing for a model."""
    if model.is_preset or model.is_adapter:
        return f"{model.kind} of {model.base or '?'}"
    return ""


def _engine(model: ModelInfo) -> str:
    try:
        return api.choose_engine(model)
    except LocalrunError:
        return "none"


def preset_lines(model: ModelInfo) -> list[str]:
    """A preset's own settings (the base's apply under them), for the details pane."""
    preset = model.details.get("preset")
    if not isinstance(preset, dict):
        return []
    lines = [f"preset of {preset.get('base', model.base)}   ('p' edits it)"]
    params = parameters_text(preset.get("parameters") or {})
    lines.append("parameters: " + ("; ".join(params.splitlines()) if params else "the base's"))
    system = preset.get("system")
    lines.append(f"system: {system}" if system is not None else "system: the base's")
    template = preset.get("template_source") or preset.get("template")
    if template is None:
        lines.append("template: the base's")
    else:
        lines.append("template (Go, translated to Jinja):" if preset.get("template_source") else "template:")
        lines.append(str(template))
    if preset.get("adapters"):
        lines.append(f"adapters: {', '.join(map(str, preset['adapters']))}")
    if preset.get("messages"):
        lines.append(f"starting conversation: {len(preset['messages'])} messages")
    lines.append("base model:")
    return lines


def details_text(model: ModelInfo, engine: str) -> str:
    """The details pane: what the file says about itself and where it is (a preset's settings first)."""
    d = model.details
    lines = [
        f"{model.name}   ({model.source})",
        *preset_lines(model),
        f"path: {model.path}",
        f"format: {model.format}   engine: {engine}   size: {size(model.size)}",
        f"architecture: {model.architecture or '-'}   parameters: {count(model.parameters)}"
        f"   quantization: {model.quantization or '-'}   context: {model.context_length or '-'}",
    ]
    if d.get("error"):
        lines.append(f"error: {d['error']}")
    meta = d.get("metadata")
    if isinstance(meta, dict):
        for key, value in list(meta.items())[:12]:
            lines.append(f"{key}: {value}")
    for key in ("tokenizer", "vocab_size", "license"):
        if d.get(key) is not None:
            lines.append(f"{key}: {d[key]}")
    template = d.get("chat_template")
    lines.append("chat template:" if template else "chat template: none (plain prompt)")
    if template:
        lines.append(str(template))
    return "\n".join(lines)


class LibraryScreen(Screen[None]):
    """Installed models in a table with a details pane."""

    BINDINGS = [
        Binding("enter", "chat", "Chat", priority=True),
        Binding("question_mark", "app.help", "Help", show=False),
        Binding("d,delete", "delete", "Delete"),
        Binding("p", "preset", "Preset"),
        Binding("a", "add", "Add file"),
        Binding("r", "reload", "Reload"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.models: list[ModelInfo] = []
        self.engines: dict[str, str] = {}
        self.loaded = False

    def compose(self) -> ComposeResult:
        yield NavBar("library")
        table: DataTable[str] = DataTable(id="models", cursor_type="row", zebra_stripes=True)
        table.add_columns(*COLUMNS)
        yield table
        with VerticalScroll(id="model-details"):
            yield Static("Reading the model store…", id="details-text", markup=False)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(DataTable).focus()
        self.load_models()

    @work(thread=True, exclusive=True, group="library")
    def load_models(self, select: str | None = None) -> None:
        """Read the store off the UI thread (GGUF headers can take a moment)."""
        try:
            models = api.list_models()
            engines = {m.name: _engine(m) for m in models}
        except LocalrunError as e:
            self.app.call_from_thread(self.notify, str(e), severity="error", timeout=8)
            models, engines = [], {}
        self.app.call_from_thread(self._show, models, engines, select)

    def _show(self, models: list[ModelInfo], engines: dict[str, str], select: str | None) -> None:
        self.models, self.engines = models, engines
        table = self.query_one(DataTable)
        current = select or self.selected_name()
        rows: list[tuple[str, ...]] = [
            (m.name, m.format, m.architecture or "-", count(m.parameters), m.quantization or "-", size(m.size),
             str(m.context_length or "-"), engines.get(m.name, "-")) for m in models]
        columns: tuple[str, ...] = COLUMNS
        if any(kind_text(m) for m in models):  # beside the name, where a narrow terminal still shows it
            columns = (COLUMNS[0], KIND, *COLUMNS[1:])
            rows = [(row[0], kind_text(m), *row[1:]) for m, row in zip(models, rows, strict=True)]
        # Widths computed here, not by the table when it is next idle: the first frame after
        # loading is already the final one (a snapshot or a busy machine never sees it half-sized).
        widths = [max([len(label)] + [len(r[i]) for r in rows]) for i, label in enumerate(columns)]
        table.clear(columns=True)
        for label, width in zip(columns, widths, strict=True):
            table.add_column(label, width=width)
        for m, row in zip(models, rows, strict=True):
            table.add_row(*row, key=m.name)
        names = [m.name for m in models]
        if current in names:
            table.move_cursor(row=names.index(current))
        self.loaded = True
        self._update_details()
        if not models:
            self.query_one("#details-text", Static).update(
                "No models installed. Find one in Discover (F3), or add a GGUF file with 'a'.")

    def selected(self) -> ModelInfo | None:
        table = self.query_one(DataTable)
        if not self.models or table.cursor_row is None or not 0 <= table.cursor_row < len(self.models):
            return None
        return self.models[table.cursor_row]

    def selected_name(self) -> str | None:
        m = self.selected()
        return m.name if m else None

    def _update_details(self) -> None:
        m = self.selected()
        if m is not None:
            self.query_one("#details-text", Static).update(details_text(m, self.engines.get(m.name, "-")))

    @on(DataTable.RowHighlighted)
    def _highlighted(self) -> None:
        self._update_details()

    @on(DataTable.RowSelected)
    async def _row_selected(self) -> None:
        await self.action_chat()

    async def action_chat(self) -> None:
        m = self.selected()
        if m is None:
            self.notify("No model selected", severity="warning")
            return
        await self.app.open_chat(m.name)  # type: ignore[attr-defined]

    def action_delete(self) -> None:
        m = self.selected()
        if m is None:
            return
        kept = m.source == "added"
        question = (f"Delete '{m.name}' from the library?\n{m.path}\n"
                    + ("The file stays on disk (it was added in place)." if kept else "The file is deleted."))

        def done(yes: bool | None) -> None:
            if yes:
                self.delete_model(m.name)

        self.app.push_screen(ConfirmScreen(question), done)

    @work(thread=True, group="library-delete")
    def delete_model(self, name: str) -> None:
        try:
            self.app.models.unload(name)  # type: ignore[attr-defined]
            api.remove_model(name)
        except LocalrunError as e:
            self.app.call_from_thread(self.notify, str(e), severity="error", timeout=8)
            return
        self.app.call_from_thread(self.notify, f"Deleted {name}")
        self.app.post_message(ModelsChanged())

    def action_preset(self) -> None:
        """A new preset FROM the highlighted model, or the highlighted preset to edit."""
        m = self.selected()
        if m is None:
            self.notify("No model selected", severity="warning")
            return
        try:
            editor = PresetEditorScreen(m, taken=self.row_names())
        except LocalrunError as e:
            self.notify(str(e), severity="error", timeout=8)
            return

        def done(name: str | None) -> None:
            if name:
                self.notify(f"Saved preset {name}")
                self.app.post_message(ModelsChanged(name))

        self.app.push_screen(editor, done)

    def action_add(self) -> None:
        def done(path: str | None) -> None:
            if path:
                self.add_model(path)

        self.app.push_screen(TextPromptScreen("Add a GGUF file (registered in place, not copied):",
                                              "/path/to/model.gguf"), done)

    @work(thread=True, group="library-add")
    def add_model(self, path: str) -> None:
        try:
            info = api.add_model(path)
        except LocalrunError as e:
            self.app.call_from_thread(self.notify, str(e), severity="error", timeout=8)
            return
        self.app.call_from_thread(self.notify, f"Added {info.name}")
        self.app.post_message(ModelsChanged(info.name))

    def action_reload(self) -> None:
        self.load_models()

    def refresh_models(self, select: str | None = None) -> None:
        """Reload after a change elsewhere (download, conversion, deletion)."""
        self.load_models(select)

    def row_names(self) -> list[Any]:
        """Names in table order (for tests and the palette)."""
        return [m.name for m in self.models]
