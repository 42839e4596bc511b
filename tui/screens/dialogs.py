"""Modal dialogs: confirm, ask for text, help, chat settings, saved conversations."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widget import Widget
from textual.widgets import Button, Input, Label, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from localrun import api
from localrun.errors import LocalrunError
from tui.conversations import Conversation


class ConfirmScreen(ModalScreen[bool]):
    """Yes or no; `y`/`Enter` confirm, `n`/`Esc` cancel."""

    BINDINGS = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str, yes: str = "Delete") -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.yes = yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, markup=False, classes="dialog-text")
            with Horizontal(classes="dialog-buttons"):
                yield Button(f"{self.yes} (y)", variant="error", id="yes")
                yield Button("Cancel (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, value: bool) -> None:
        self.dismiss(value)


class TextPromptScreen(ModalScreen[str | None]):
    """One line of text (a path, a name); `Esc` cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, question: str, placeholder: str = "", value: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.placeholder = placeholder
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static(self.question, markup=False, classes="dialog-text")
            yield Input(self.value, placeholder=self.placeholder, id="prompt-input")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
Anywhere  F1 help  F2 Library  F3 Discover  F4 Chat  F5 Convert
          Ctrl+P commands   Ctrl+T dark/light theme   Ctrl+C quit

Library   Enter   chat with the highlighted model
          d       delete the model (asks first)   p  make or edit a preset
          a       add a GGUF file in place    r  reload the list

Chat      Enter   send                  Esc     stop (nothing is kept)
          Ctrl+R  regenerate last reply Ctrl+Y  copy the last reply
          Ctrl+S  system prompt, sampling, structured output of this chat
          Ctrl+O  saved conversations   Ctrl+N  new conversation
          Ctrl+E  export the conversation to Markdown
          Ctrl+F  attach an image (or type /image PATH, or paste its path)
          Backspace in the empty prompt, or a click, takes an image off

Discover  type to search; Enter opens a repository or downloads a file
          c       cancel the highlighted download

Convert   pick a checkpoint folder and an output type; Ctrl+G converts
          Ladder q8_0,q4_k_m: Ctrl+G builds, measures, compares them
"""


# Where MCP servers are configured, the chat's tools key is listed too.
_HELP_TOOLS_AFTER = "          Ctrl+E  export the conversation to Markdown\n"
HELP_TOOLS = "          Ctrl+L  MCP tools: servers and tools on/off, tool choice, steps\n"


class HelpScreen(ModalScreen[None]):
    """Every key of every screen."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "close", "Close")]

    def __init__(self, tools: bool = False) -> None:
        super().__init__()
        self.text = HELP.replace(_HELP_TOOLS_AFTER, _HELP_TOOLS_AFTER + HELP_TOOLS) if tools else HELP

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Static("localrun keys (Esc closes)", classes="dialog-title")
            yield Static(self.text, markup=False)

    def action_close(self) -> None:
        self.dismiss(None)


# The settings the dialog edits (settings.py's names), with their titles: a field left empty is not
# set, and the model's preset, the model and localrun decide it.
_FIELDS = (
    ("temperature", "Temperature"),
    ("top_p", "Top-p"),
    ("top_k", "Top-k"),
    ("min_p", "Min-p"),
    ("repeat_penalty", "Repeat penalty"),
    ("max_tokens", "Max tokens"),
    ("seed", "Seed"),
    ("draft_max", "Draft max"),
)
# Speculative decoding: the dialog's choices (the speculative setting; "default": not set) and their labels
DRAFTERS = {"default": "default", "off": "off", "lookup": "prompt lookup",
            "model": "draft model (tui --draft MODEL)"}


# Structured output: the dialog's kinds, their labels, and what the text box holds for each.
OUTPUT_KINDS = {"none": "none", "json": "JSON object", "schema": "JSON schema", "grammar": "GBNF grammar",
                "choice": "choice"}
_OUTPUT_PLACEHOLDERS = {
    "schema": 'A JSON schema, e.g. {"type": "object", "properties": {"answer": {"type": "string"}}}',
    "grammar": 'A GBNF grammar, e.g. root ::= "yes" | "no"',
    "choice": "The choices, separated by commas, e.g. yes,no",
}


def output_kind(spec: Mapping[str, Any] | None) -> tuple[str, str]:
    """The dialog's kind and text for a structured-output spec (see `Constraint.from_spec`)."""
    if not spec:
        return "none", ""
    if spec.get("format") == "json":
        return "json", ""
    schema = spec.get("schema")
    if schema is not None:
        return "schema", schema if isinstance(schema, str) else json.dumps(schema, indent=2)
    for key in ("grammar", "choice"):
        value = spec.get(key)
        if isinstance(value, str):
            return key, value
        if isinstance(value, list):  # choices as to_spec gives them
            return key, ",".join(map(str, value))
    return "none", ""


def output_label(spec: Mapping[str, Any] | None) -> str | None:
    """The structured output a spec asks for, in words (None when there is none)."""
    kind, _ = output_kind(spec)
    return None if kind == "none" else OUTPUT_KINDS[kind]


def output_spec(kind: str, text: str) -> dict[str, Any] | None:
    """The structured-output spec for the dialog's kind and text, as the user typed it."""
    if kind == "none":
        return None
    if kind == "json":
        return {"format": "json"}
    return {kind: text}


@dataclass(frozen=True)
class ChatSettings:
    """What the settings dialog saves: the system prompt, sampling and structured output."""

    system: str
    settings: dict[str, Any]  # the settings the user set, by settings.py's names
    output: dict[str, Any] | None = None  # the structured-output spec


class SettingsScreen(ModalScreen[ChatSettings | None]):
    """A chat's system prompt, sampling and structured output; `Ctrl+S` saves, `Esc` cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system: str, given: Mapping[str, Any], output: Mapping[str, Any] | None = None) -> None:
        super().__init__(classes="dialog-screen")
        self.system = system
        self.given = dict(given)
        self.kind, text = output_kind(output)
        self.texts = {self.kind: text}  # what was typed per kind, kept while switching

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog settings"):
            with Vertical(id="settings-body"):
                yield Label("System prompt")
                yield TextArea(self.system, id="system-prompt", soft_wrap=True, show_line_numbers=False)
                with Grid(id="settings-grid"):
                    for key, title in _FIELDS:
                        value = self.given.get(key)
                        yield Label(title)
                        yield Input("" if value is None else str(value), id=f"set-{key}", compact=True,
                                    placeholder="default")
                    yield Label("Speculation")
                    yield Select([(label, kind) for kind, label in DRAFTERS.items()],
                                 value=self.given.get("speculative") or "default", allow_blank=False, compact=True,
                                 id="set-draft")
                    yield Label("Structured output")
                    yield Select([(label, kind) for kind, label in OUTPUT_KINDS.items()], value=self.kind,
                                 allow_blank=False, compact=True, id="set-output")
                text = TextArea(self.texts[self.kind], id="output-text", soft_wrap=True, show_line_numbers=False,
                                placeholder=_OUTPUT_PLACEHOLDERS.get(self.kind, ""))
                text.display = self.kind in _OUTPUT_PLACEHOLDERS
                yield text
            with Vertical(id="settings-foot"):  # docked: the error and the buttons stay in view
                yield Static("", id="settings-error", markup=False)
                with Horizontal(classes="dialog-buttons"):
                    yield Button("Save (^S)", variant="primary", id="save")
                    yield Button("Cancel (Esc)", id="cancel")

    @on(Select.Changed, "#set-output")
    def _output_changed(self, event: Select.Changed) -> None:
        kind = str(event.value)
        if kind == self.kind:
            return
        text = self.query_one("#output-text", TextArea)
        self.texts[self.kind] = text.text
        self.kind = kind
        text.load_text(self.texts.get(kind, ""))
        text.placeholder = _OUTPUT_PLACEHOLDERS.get(kind, "")
        text.display = kind in _OUTPUT_PLACEHOLDERS
        self.query_one("#settings-error", Static).update("")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        given = {k: v for k, v in self.given.items() if k not in {key for key, _ in _FIELDS} | {"speculative"}}
        field: Widget | None = None  # the field being read, brought into view when it is refused
        try:
            for key, title in _FIELDS:
                field = self.query_one(f"#set-{key}", Input)
                raw = field.value.strip()
                if raw:
                    given[key] = api.setting_value(key, raw, title)
            field = self.query_one("#output-text", TextArea)
            spec = output_spec(self.kind, field.text)
            if spec is not None:
                api.constraint(spec, "structured output")
            drafter = str(self.query_one("#set-draft", Select).value)
            if drafter != "default":
                given["speculative"] = drafter
            field = None
            api.resolve_settings(given)  # the values together (draft min and max)
        except LocalrunError as e:
            self.query_one("#settings-error", Static).update(str(e))
            if field is not None:  # once the error has taken its room
                self.call_after_refresh(field.scroll_visible, animate=False)
            return
        self.dismiss(ChatSettings(self.query_one("#system-prompt", TextArea).text, given, spec))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConversationsScreen(ModalScreen[int | None]):
    """Saved conversations, most recent first: `Enter` resumes, `d` deletes."""

    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("d,delete", "delete", "Delete")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__(classes="dialog-screen")
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog conversations"):
            yield Label("Conversations (Enter resumes, d deletes, Esc closes)")
            options = [Option(Content(f"{c.title}  ·  {c.model}  ·  {c.message_count} messages"), id=str(c.id))
                       for c in self.conversations]
            yield OptionList(*options, id="conversation-list")
            if not options:
                yield Static("No saved conversations yet.", classes="empty")

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_delete(self) -> None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return
        option = ol.get_option_at_index(ol.highlighted)
        cid = int(option.id or 0)
        self.app.conversations.delete(cid)  # type: ignore[attr-defined]
        ol.remove_option_at_index(ol.highlighted)
        self.notify("Conversation deleted")

    def action_cancel(self) -> None:
        self.dismiss(None)
