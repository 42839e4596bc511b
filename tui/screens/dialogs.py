"""Modal dialogs: confirm, ask for text, help, chat settings, saved conversations."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from localrun.errors import LocalrunError
from localrun.generation import GenerationParams
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
          d       delete the model (asks first)
          a       add a GGUF file in place    r  reload the list

Chat      Enter   send                  Esc     stop (nothing is kept)
          Ctrl+R  regenerate last reply Ctrl+Y  copy the last reply
          Ctrl+S  system prompt and sampling settings of this chat
          Ctrl+O  saved conversations   Ctrl+N  new conversation
          Ctrl+E  export the conversation to Markdown

Discover  type to search; Enter opens a repository or downloads a file
          c       cancel the highlighted download

Convert   pick a checkpoint folder and an output type; Ctrl+G converts
"""


class HelpScreen(ModalScreen[None]):
    """Every key of every screen."""

    BINDINGS = [Binding("escape,q,f1,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Static("localrun keys (Esc closes)", classes="dialog-title")
            yield Static(HELP, markup=False)

    def action_close(self) -> None:
        self.dismiss(None)


_FIELDS = (
    ("temperature", "Temperature", float),
    ("top_p", "Top-p", float),
    ("top_k", "Top-k", int),
    ("min_p", "Min-p", float),
    ("repeat_penalty", "Repeat penalty", float),
    ("max_tokens", "Max tokens", int),
    ("seed", "Seed", int),
)


class SettingsScreen(ModalScreen[tuple[str, GenerationParams] | None]):
    """The conversation's system prompt and sampling settings; `Ctrl+S` saves, `Esc` cancels."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, system: str, params: GenerationParams) -> None:
        super().__init__(classes="dialog-screen")
        self.system = system
        self.params = params

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog settings"):
            yield Label("System prompt")
            yield TextArea(self.system, id="system-prompt", soft_wrap=True, show_line_numbers=False)
            with Grid(id="settings-grid"):
                for key, title, _ in _FIELDS:
                    value = getattr(self.params, key)
                    yield Label(title)
                    yield Input("" if value is None else str(value), id=f"set-{key}", compact=True,
                                placeholder="default" if key in ("max_tokens", "seed") else "")
            yield Static("", id="settings-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (^S)", variant="primary", id="save")
                yield Button("Cancel (Esc)", id="cancel")

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        values: dict[str, object] = {}
        try:
            for key, title, kind in _FIELDS:
                raw = self.query_one(f"#set-{key}", Input).value.strip()
                if not raw:
                    if key in ("max_tokens", "seed"):
                        values[key] = None
                    continue
                try:
                    values[key] = kind(raw)
                except ValueError:
                    raise LocalrunError(f"{title}: {raw!r} is not a number") from None
            params = GenerationParams(**{**self.params.to_dict(), **values})  # type: ignore[arg-type]
        except LocalrunError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        self.dismiss((self.query_one("#system-prompt", TextArea).text, params))

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
