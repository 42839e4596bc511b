"""The Chat's replies with MCP tools: the reply goes through localrun's tool loop on the worker
thread; each call is asked about in a modal on the UI thread (the worker waits for the answer),
run, and shown in the conversation as a block, and its result is fed back until the model answers."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from tui.chat_tools import ChatTools
from tui.messages import ToolRunning, ToolStepEnded, ToolUsed
from tui.screens.tools import ToolApprovalScreen
from tui.tool_calls import ToolCallRecord, ToolSettings, ToolStep
from tui.widgets.chat import AssistantMessage, StatusBar, ToolCallBlock

if TYPE_CHECKING:
    from localrun.tool_loop import Answer, Ask, Reply, ToolLoop, ToolUse
    from localrun.tool_servers import ServerTool
    from localrun.tools import ToolCall

# One step of the loop, as the chat streams it: (the messages, the step's tool choice) -> the reply
# (its content, calls and final chunk) and the step's thought (what `.parts` and `.seconds()` it has).
StepRunner = Callable[[list[dict[str, Any]], str], "tuple[Reply, Any]"]


@dataclass(frozen=True)
class ReplyTools:
    """What a reply with tools needs: the app's servers and the conversation's tool settings."""

    chat: ChatTools
    conversation: int
    settings: ToolSettings


@dataclass
class ToolOutcome:
    """The end of a reply with tools: its answer, the final chunk, the answer's thought, the steps before it."""

    text: str
    final: Any
    thought: Any
    steps: tuple[ToolStep, ...]


class ToolReplies(Screen[None]):
    """The part of the Chat that runs a reply's tool calls; ChatReplies builds on it."""

    generation: int
    generating: bool
    cancel: threading.Event
    _stream: MarkdownStream | None
    _reply_widget: AssistantMessage | None
    _live: list[Widget]  # the reply in progress's widgets: its steps' text and thoughts, the calls' blocks
    _approval: ToolApprovalScreen | None  # the approval prompt open now

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    async def _finish_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    # -- on the worker thread ----------------------------------------------------------------
    def _tool_loop(self, generation: int, tools: ReplyTools, cancel: threading.Event) -> ToolLoop | None:
        """The reply's tool loop, the servers started on the first message that needs them (each
        that fails is one notification); None when no tool of the conversation is available."""
        if not tools.chat.started:
            self.app.call_from_thread(self._state, generation, "starting MCP servers…")

        def running(tool: ServerTool, arguments: dict[str, Any]) -> None:
            self.post_message(ToolRunning(generation, f"{tool.server}/{tool.name}"))

        # on_use: _run_tools sets it, with the steps it records
        loop = tools.chat.loop(tools.settings, self._asker(generation, tools, cancel), running)
        self._report_failures(tools.chat)
        return loop

    def _report_failures(self, tools: ChatTools) -> None:
        for line in tools.new_failures():
            self.app.call_from_thread(self.notify, line, title="MCP", severity="warning", timeout=15)

    def _run_tools(self, generation: int, loop: ToolLoop, tools: ReplyTools, messages: list[dict[str, Any]],
                   step: StepRunner) -> ToolOutcome:
        """Run the loop: each step streamed by `step`; a step with calls is recorded and shown
        (ToolStepEnded, then ToolUsed for each call as it ends)."""
        steps: list[ToolStep] = []
        calls: dict[str, ToolCall] = {}  # the calls of the step that runs now, by id
        thoughts: list[Any] = []

        def generate(msgs: list[dict[str, Any]], choice: str) -> Reply:
            reply, thought = step(msgs, choice)
            thoughts.append(thought)
            if reply.calls:
                calls.clear()
                calls.update((c.id, c) for c in reply.calls)
                steps.append(ToolStep(reply.text, reply.thinking))
                self.post_message(ToolStepEnded(generation, reply.text, thought.seconds(), len(thought.parts)))
            return reply

        def used(use: ToolUse) -> None:
            call = calls.get(use.id)
            record = ToolCallRecord(use.id, call.name if call is not None else use.tool, use.server, use.tool,
                                    use.arguments, use.result, use.is_error, use.allowed, use.seconds, use.refused)
            steps[-1] = dataclasses.replace(steps[-1], calls=(*steps[-1].calls, record))
            self.post_message(ToolUsed(generation, record))

        loop.on_use = used
        outcome = loop.run(generate, messages, tools.chat.first_choice(tools.settings, tuple(loop.tools)))
        self._report_failures(tools.chat)  # a server that crashed in a call
        return ToolOutcome(outcome.reply.text, outcome.reply.final, thoughts[-1] if thoughts else None, tuple(steps))

    def _asker(self, generation: int, tools: ReplyTools, cancel: threading.Event) -> Ask:
        """The approval prompt: a modal on the UI thread, the worker waiting for its answer; a
        stopped reply answers "no"; "always" and "never" hold for the conversation (this app session)."""
        remembered = tools.chat.remembered(tools.conversation)

        def ask(tool: ServerTool, arguments: dict[str, Any]) -> Answer:
            key = f"{tool.server}/{tool.name}"
            if key in remembered:
                return remembered[key]
            if cancel.is_set():
                return "no"
            answered = threading.Event()
            answers: list[Answer] = []

            def done(answer: Answer | None) -> None:
                answers.append(answer or "no")
                answered.set()

            try:
                self.app.call_from_thread(self._ask_user, generation, tool, arguments, done)
            except RuntimeError:  # the app is leaving
                return "no"
            while not answered.wait(0.1):
                if cancel.is_set():  # stopped: action_stop closes the prompt; a leaving app takes it along
                    return "no"
            if answers[0] in ("always", "never"):
                remembered[key] = answers[0]
            return answers[0]

        return ask

    # -- on the UI thread --------------------------------------------------------------------
    def _ask_user(self, generation: int, tool: ServerTool, arguments: dict[str, Any],
                  done: Callable[[Answer | None], None]) -> None:
        screen = ToolApprovalScreen(tool.server, tool.name, tool.description, arguments)

        def answered(answer: Answer | None) -> None:
            if self._approval is screen:
                self._approval = None
            done(answer)

        self._approval = screen
        self._state(generation, "waiting for your approval…")
        self.app.push_screen(screen, answered)

    def _close_approval(self) -> None:
        """Take the approval prompt down (the reply was stopped): its answer is "no"."""
        screen = self._approval
        if screen is not None and self.app.screen is screen:
            screen.dismiss("no")

    def _state(self, generation: int, state: str) -> None:
        if generation == self.generation and self.generating:
            self.status.show(state=state)

    def on_tool_running(self, message: ToolRunning) -> None:
        self._state(message.generation, f"running {message.where}…")

    async def on_tool_step_ended(self, message: ToolStepEnded) -> None:
        """A step of the reply ended with calls: its text stays (an empty one goes), its thought
        folds, and the calls' blocks and the next step's text come below."""
        if message.generation != self.generation or self._reply_widget is None or self.cancel.is_set():
            return  # a stopped reply is taken out whole (and a leaving app mounts nothing)
        await self._finish_stream()
        step = self._reply_widget
        if step.thought is not None:
            step.thought.finish(message.thinking_seconds, message.thinking_pieces)
            step.thought.collapsed = True
        if message.content.strip():
            step.text = message.content
        else:
            self._live.remove(step)
            await step.remove()
        self._reply_widget = AssistantMessage()
        self._live.append(self._reply_widget)
        await self.query_one("#messages", VerticalScroll).mount(self._reply_widget)
        self._stream = Markdown.get_stream(self._reply_widget)

    async def on_tool_used(self, message: ToolUsed) -> None:
        if message.generation != self.generation or self.cancel.is_set():
            return
        block = ToolCallBlock(message.call)
        self._live.append(block)
        box = self.query_one("#messages", VerticalScroll)
        await box.mount(block, before=self._reply_widget)
        box.scroll_end(animate=False)
        self._state(message.generation, "generating…")


def step_widgets(steps: tuple[ToolStep, ...]) -> list[Widget]:
    """A stored reply's steps with calls: each step's thought and text (when it has them), then its calls' blocks."""
    from tui.widgets.chat import ThinkingBlock

    widgets: list[Widget] = []
    for step in steps:
        if step.thinking:
            widgets.append(ThinkingBlock(step.thinking, "Thought", collapsed=True))
        if step.content.strip():
            widgets.append(AssistantMessage(step.content))
        widgets.extend(ToolCallBlock(call) for call in step.calls)
    return widgets
