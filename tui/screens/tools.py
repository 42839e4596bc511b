"""MCP tools in the Chat: the approval prompt a call waits on, and the tools panel that turns a
conversation's servers and tools on and off."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select, Static, Switch

from tui.chat_tools import CHOICES, ChatTools
from tui.tool_calls import ToolSettings

if TYPE_CHECKING:
    from localrun.tool_loop import Answer


class ToolApprovalScreen(ModalScreen["Answer"]):
    """Whether one call may run: Allow once (o), Always for this tool (a), No (n, Esc), Never for
    this tool (v); "always" and "never" hold for the rest of the conversation."""

    BINDINGS = [
        Binding("o,y", "answer('once')", "Once"),
        Binding("a", "answer('always')", "Always"),
        Binding("n,escape", "answer('no')", "No"),
        Binding("v", "answer('never')", "Never"),
    ]

    def __init__(self, server: str, tool: str, description: str, arguments: Any) -> None:
        super().__init__(classes="dialog-screen")
        self.server = server
        self.tool = tool
        self.description = description
        self.arguments = arguments

    def compose(self) -> ComposeResult:
        args = self.arguments if isinstance(self.arguments, str) else json.dumps(self.arguments, ensure_ascii=False,
                                                                                  indent=2)
        about = (self.description or "").strip().splitlines()
        with Vertical(classes="dialog approval"):
            yield Static("The model wants to run a tool", classes="tools-title")
            yield Static(f"Server  {self.server}\nTool    {self.tool}" + (f"\n        {about[0]}" if about else ""),
                         markup=False, id="approval-tool")
            yield Label("Arguments")
            with VerticalScroll(id="approval-scroll"):
                yield Static(args, markup=False, id="approval-arguments")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Allow once (o)", variant="primary", id="once")
                yield Button("Always for this tool (a)", id="always")
            with Horizontal(classes="dialog-buttons"):
                yield Button("No (n)", id="no")
                yield Button("Never for this tool (v)", variant="error", id="never")

    AUTO_FOCUS = "#no"  # Enter on a prompt that just opened runs nothing

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id)  # type: ignore[arg-type]

    def action_answer(self, answer: Answer) -> None:
        self.dismiss(answer)


class ToolsScreen(ModalScreen[ToolSettings | None]):
    """A conversation's MCP tools: each server (or why it is not available) and its tools with a
    switch, the tool choice of a reply's first step and the step limit; Ctrl+S saves, Esc cancels.
    The servers start when the panel opens, if no message has started them yet."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, tools: ChatTools, settings: ToolSettings) -> None:
        super().__init__(classes="dialog-screen")
        self.tools = tools
        self.settings = settings
        self.switches: dict[str, tuple[str, str | None]] = {}  # switch id -> (server, tool or None)
        self.loaded = False  # the servers' tools are listed
        self.wanted = settings.choice or tools.choice  # the choice until the tools are listed

    def compose(self) -> ComposeResult:
        steps = self.settings.max_steps
        with Vertical(classes="dialog tools-panel"):
            yield Static("MCP tools of this conversation", classes="tools-title")
            with VerticalScroll(id="tools-list"):
                yield Static("Starting the MCP servers…", id="tools-starting", markup=False)
            with Grid(id="tools-grid"):
                yield Label("Tool choice")
                yield Select(self._choices([]), value=self._choice([]), allow_blank=False, compact=True,
                             id="tools-choice", disabled=True)
                yield Label("Max steps")
                yield Input("" if steps is None else str(steps), placeholder=f"default ({self.tools.max_steps})",
                            compact=True, id="tools-steps")
            yield Static("", id="tools-error", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save (^S)", variant="primary", id="save")
                yield Button("Cancel (Esc)", id="cancel")

    def on_mount(self) -> None:
        if self.tools.started:
            self.call_after_refresh(self._fill)
        else:
            self._start()

    @work(thread=True, group="tools-start")
    def _start(self) -> None:
        self.tools.start()
        for line in self.tools.new_failures():
            self.app.call_from_thread(self.app.notify, line, title="MCP", severity="warning", timeout=15)
        self.app.call_from_thread(self._filled)

    def _filled(self) -> None:
        self.run_worker(self._fill(), group="tools-fill")

    def _choices(self, names: list[str]) -> list[tuple[str, str]]:
        return ([("auto: the model decides", "auto"), ("required: it must call a tool", "required"),
                 ("none: it answers without tools", "none")]
                + [(f"{name}: it must call this one", name) for name in names])

    def _choice(self, names: list[str]) -> str:
        return self.wanted if self.wanted in CHOICES or self.wanted in names else "auto"

    async def _fill(self) -> None:
        """The servers and their tools, each with its switch; failures said in words."""
        box = self.query_one("#tools-list", VerticalScroll)
        await box.remove_children()
        failures = self.tools.failures()
        rows: list[Any] = []
        for i, name in enumerate(self.tools.names()):
            mine = [t for t in self.tools.tools if t.server == name]
            if name in failures:
                rows.append(Static(f"{name}: not available ({failures[name]})", markup=False, classes="tools-failed"))
                continue
            self.switches[f"server-{i}"] = (name, None)
            rows.append(Horizontal(Switch(self.settings.enabled(name), id=f"server-{i}", animate=False),
                                   Label(f"{name} ({len(mine)} tool{'' if len(mine) == 1 else 's'})",
                                         markup=False, classes="tools-server"),
                                   classes="tools-row"))
            for j, tool in enumerate(mine):
                about = (tool.description or "").strip().splitlines()
                self.switches[f"tool-{i}-{j}"] = (name, tool.name)
                switch = Switch(self.settings.enabled(name, tool.name), id=f"tool-{i}-{j}", animate=False,
                                disabled=not self.settings.enabled(name))
                rows.append(Horizontal(switch, Label(tool.name + (f": {about[0]}" if about else ""), markup=False),
                                       classes="tools-row tools-tool"))
        if not rows:
            rows.append(Static("No MCP server is running.", markup=False))
        await box.mount_all(rows)
        self._update_choices()
        self.loaded = True
        self.query_one("#tools-choice", Select).disabled = False

    def _on_tools(self) -> list[str]:
        """The tools on now, by the names the model sees."""
        off = self._off()
        settings = ToolSettings(off)
        return [t.model_name or t.name for t in self.tools.tools if settings.enabled(t.server, t.name)]

    def _off(self) -> frozenset[str]:
        """The servers and tools switched off (those not listed keep their setting)."""
        off = set(self.settings.off) - {s if t is None else f"{s}/{t}" for s, t in self.switches.values()}
        for sid, (server, tool) in self.switches.items():
            if not self.query_one(f"#{sid}", Switch).value:
                off.add(server if tool is None else f"{server}/{tool}")
        return frozenset(off)

    def _update_choices(self) -> None:
        select: Select[str] = self.query_one("#tools-choice", Select)
        if self.loaded:
            self.wanted = str(select.value)
        names = self._on_tools()
        select.set_options(self._choices(names))
        select.value = self._choice(names)

    @on(Switch.Changed)
    def _switched(self, event: Switch.Changed) -> None:
        server, tool = self.switches.get(event.switch.id or "", ("", ""))
        if tool is None:  # a server: its tools' switches follow it
            for sid, (s, t) in self.switches.items():
                if s == server and t is not None:
                    self.query_one(f"#{sid}", Switch).disabled = not event.value
        self._update_choices()

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        raw = self.query_one("#tools-steps", Input).value.strip()
        steps: int | None = None
        if raw:
            if not raw.isdigit() or int(raw) < 1:
                self.query_one("#tools-error", Static).update(f"Max steps must be a whole number >= 1, got '{raw}'")
                return
            steps = int(raw)
        choice = str(self.query_one("#tools-choice", Select).value) if self.loaded else self.settings.choice
        self.dismiss(ToolSettings(self._off(), choice, steps))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
