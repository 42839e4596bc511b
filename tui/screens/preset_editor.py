"""The preset editor: a model with its own system prompt, parameters and template (a Modelfile
without the file), opened from the Library on a model (a new preset FROM it) or on a preset."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Collection, Mapping
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, TextArea

from localrun import api
from localrun.errors import LocalrunError, UsageError
from localrun.presets import PARAMETERS, Preset, parse_parameter, translate_template
from localrun.store import ModelInfo

PARAMETERS_PLACEHOLDER = 'temperature 0.7\nnum_predict 256\nstop "User:"'
TEMPLATE_PLACEHOLDER = "empty: the model's own chat template (Jinja, or an Ollama Go template)"


def _value_text(value: Any) -> str:
    """A parameter's value as the editor shows it: bare, or JSON-quoted where a bare value would
    lose something (edge spaces, a line break, a leading quote, nothing at all)."""
    text = str(value)
    if not isinstance(value, str) or (text and text == text.strip() and "\n" not in text and not text.startswith('"')):
        return text
    return json.dumps(value)


def parameters_text(parameters: Mapping[str, Any]) -> str:
    """The editor's parameter lines for a preset's parameters (`stop` once per value), in the
    order the Modelfile reference lists them (the store keeps no order)."""
    order = {name: i for i, name in enumerate(PARAMETERS)}
    lines = []
    for name, value in sorted(parameters.items(), key=lambda item: order.get(item[0], len(order))):
        for v in value if isinstance(value, list) else [value]:
            lines.append(f"{name} {_value_text(v)}")
    return "\n".join(lines)


def _unquote(raw: str) -> str:
    """A value as typed: `"..."` is a JSON string (escapes such as \\n work), anything else is as it is."""
    if len(raw) >= 2 and raw.startswith('"') and raw.endswith('"'):
        try:
            value = json.loads(raw)
        except ValueError:
            return raw[1:-1]
        return value if isinstance(value, str) else raw[1:-1]
    return raw


def _split(line: str) -> tuple[str, str]:
    """(lower-case first word, the rest stripped)."""
    words = line.split(None, 1)
    return words[0].lower(), words[1].strip() if len(words) > 1 else ""


def parse_parameters(text: str) -> tuple[dict[str, Any], list[str], list[str]]:
    """The parameters of the editor's lines (`name value`; blank lines and `#` comments skipped),
    with an error for each bad line, naming it, and the distinct hints those errors give."""
    params: dict[str, Any] = {}
    errors: list[str] = []
    hints: list[str] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        where = f"parameters line {number} ({stripped!r})"
        name, raw = _split(stripped)
        if name == "parameter" and raw:  # a line pasted from a Modelfile
            name, raw = _split(raw)
        if not raw:
            errors.append(f"{where}: '{name}' needs a value")
            continue
        value = _unquote(raw)
        try:
            key, parsed = parse_parameter(name, value)
        except UsageError as e:
            errors.append(f"{where}: {e.message}")
            if e.hint and e.hint not in hints:
                hints.append(e.hint)
            continue
        if key == "stop":
            if not value:
                errors.append(f"{where}: a stop sequence cannot be empty")
                continue
            params.setdefault("stop", []).append(value)  # as typed: edge spaces can matter in a stop
        elif key in params:
            errors.append(f"{where}: '{key}' is already set on line {first_line[key]} (only stop may repeat)")
        else:
            params[key] = parsed
            first_line[key] = number
    return params, errors, hints


def model_name(name: str) -> str:
    """A store name as the store writes it: lower case, `:latest` when no tag is given."""
    name = name.strip().lower()
    return name if ":" in name else f"{name}:latest"


def default_name(model: ModelInfo, taken: Collection[str]) -> str:
    """`<family>-preset:latest`, numbered when a model of that name is already installed."""
    family = model.name.split(":", 1)[0]
    n = 1
    while (name := f"{family}-preset{'' if n == 1 else f'-{n}'}:latest") in taken:
        n += 1
    return name


def starting_preset(model: ModelInfo) -> tuple[Preset, str | None]:
    """The settings the editor opens with and the preset it edits (None: a new one from the model).

    Raises:
        UsageError: an adapter whose base model is not known.
    """
    if model.is_preset:
        data = model.details.get("preset")
        return (Preset.from_dict(data) if isinstance(data, Mapping) else Preset(model.base or model.name)), model.name
    if model.is_adapter:  # runs on its base: the preset is FROM the base with the adapter applied
        if not model.base:
            raise UsageError(f"the base model of the adapter '{model.name}' is not known",
                             "convert the adapter again against an installed base model")
        return Preset(model.base, adapters=(model.name,)), None
    return Preset(model.name), None


class PresetEditorScreen(ModalScreen[str | None]):
    """Create or edit a preset; `Ctrl+S` saves (dismissed with its name), `Esc` cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, model: ModelInfo, taken: Collection[str] = ()) -> None:
        super().__init__(classes="dialog-screen")
        self.preset, self.editing = starting_preset(model)
        self.taken = set(taken)
        self.name_value = self.editing or default_name(model, self.taken)
        self.saving = False
        self.error = ""  # the error shown, as text

    def compose(self) -> ComposeResult:
        p = self.preset
        adapters = f" with {', '.join(p.adapters)}" if p.adapters else ""
        title = f"Preset {self.editing} (FROM {p.base}{adapters})" if self.editing else f"New preset FROM {p.base}{adapters}"
        template = p.template_source if p.template_source is not None else p.template
        with Vertical(classes="dialog preset-editor"):
            with Vertical(id="preset-body"):
                yield Static(title, id="preset-title", markup=False)
                with Horizontal(classes="preset-row"):
                    yield Label("Name", classes="preset-key")
                    yield Input(self.name_value, id="preset-name", compact=True)
                yield Label("System prompt (empty: the base's)")
                yield TextArea(p.system or "", id="preset-system", soft_wrap=True, show_line_numbers=False)
                yield Label("Parameters: one 'name value' per line; stop may repeat")
                yield TextArea(parameters_text(p.parameters), id="preset-parameters", soft_wrap=False,
                               show_line_numbers=True, placeholder=PARAMETERS_PLACEHOLDER)
                yield Label("Template (Jinja or Go)")
                yield TextArea(template or "", id="preset-template", soft_wrap=False, show_line_numbers=False,
                               placeholder=TEMPLATE_PLACEHOLDER)
            with Vertical(id="preset-foot"):  # docked: the error and the buttons stay in view
                error = Static("", id="preset-error", markup=False)
                error.display = False
                yield error
                with Horizontal(classes="dialog-buttons"):
                    yield Button("Save (^S)", variant="primary", id="preset-save")
                    yield Button("Cancel (Esc)", id="preset-cancel")

    def on_mount(self) -> None:
        self.query_one("#preset-system" if self.editing else "#preset-name").focus()

    def _show_error(self, text: str) -> None:
        self.error = text
        error = self.query_one("#preset-error", Static)
        error.update(text)
        error.display = bool(text)  # no empty line above the buttons

    def settings(self) -> tuple[str, Preset] | list[str]:
        """The name and preset the fields describe, or the errors that stop them being saved."""
        errors: list[str] = []
        name = self.query_one("#preset-name", Input).value.strip()
        if not name:
            errors.append("name: give the preset a name, e.g. 'assistant:latest'")
        elif model_name(name) in self.taken and model_name(name) != self.editing:
            errors.append(f"name: a model named '{model_name(name)}' is already in the library; choose another name")
        params, param_errors, hints = parse_parameters(self.query_one("#preset-parameters", TextArea).text)
        errors += param_errors
        errors += hints[:1]  # the list of known parameters, once
        text = self.query_one("#preset-template", TextArea).text
        template: str | None = None
        source: str | None = None
        if text.strip():
            try:
                template, source = translate_template(text, None)
            except LocalrunError as e:
                errors.append(f"template: {e}")
        if errors:
            return errors
        system = self.query_one("#preset-system", TextArea).text
        return name, dataclasses.replace(self.preset, parameters=params, system=system if system.strip() else None,
                                         template=template, template_source=source)

    @on(Button.Pressed, "#preset-save")
    def action_save(self) -> None:
        if self.saving:
            return
        settings = self.settings()
        if isinstance(settings, list):
            self._show_error("\n".join(settings))
            return
        self._show_error("")
        self.saving = True
        self.create(*settings)

    @work(thread=True, exclusive=True, group="preset-save")
    def create(self, name: str, preset: Preset) -> None:
        """Write the preset off the UI thread (the store checks its base's file)."""
        try:
            info = api.create_preset(name, preset=preset)
        except LocalrunError as e:
            self.app.call_from_thread(self._failed, str(e))
            return
        self.app.call_from_thread(self.dismiss, info.name)

    def _failed(self, error: str) -> None:
        self.saving = False
        self._show_error(error)

    @on(Button.Pressed, "#preset-cancel")
    def action_cancel(self) -> None:
        if not self.saving:  # a save under way ends by closing the dialog itself
            self.dismiss(None)
