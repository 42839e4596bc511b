"""The Chat: streamed Markdown replies (a thinking model's thought in a block above), images
attached to messages, MCP tools (each call a block, asked about first; a panel turns them on and
off), stop, regenerate, settings, saved conversations."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Footer, Input, Static
from textual.widgets.markdown import MarkdownStream

from localrun.errors import LocalrunError
from localrun.images import pasted_image, unquoted
from tui import attachments
from tui.attachments import Attachment
from tui.conversations import Conversation
from tui.screens.chat_replies import ChatReplies, reply_widgets
from tui.screens.dialogs import ChatSettings, ConversationsScreen, SettingsScreen, output_label
from tui.screens.image_picker import ImagePickerScreen
from tui.screens.tools import ToolApprovalScreen, ToolsScreen
from tui.tool_calls import ToolSettings
from tui.widgets.attachments import AttachmentTray, PendingImageChip
from tui.widgets.chat import AssistantMessage, PromptInput, StatusBar, ThinkingBlock, UserMessage
from tui.widgets.navbar import NavBar


class ChatScreen(ChatReplies):
    """One conversation with one model."""

    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+y", "copy", "Copy"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "conversations", "Chats"),
        Binding("ctrl+n", "new", "New"),
        Binding("ctrl+l", "tools", "Tools"),  # shown only where MCP servers are configured
        Binding("ctrl+g", "thought", "Thought", show=False),
        Binding("ctrl+f", "attach", "Image", show=False),
        # priority: the prompt (an Input) would take ctrl+e as "end of line" otherwise
        Binding("ctrl+e", "export", "Export", show=False, priority=True),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.conversation: Conversation | None = None
        self.generating = False
        self.generation = 0
        self.cancel = threading.Event()
        self._stream: MarkdownStream | None = None
        self._reply_widget: AssistantMessage | None = None
        self._user_widget: UserMessage | None = None
        self._pending_prompt = ""
        self._pending_images: tuple[Attachment, ...] = ()
        self._live: list[Any] = []
        self._approval: ToolApprovalScreen | None = None
        self.picker_folder = Path.cwd()  # where the image picker opens: the last attached image's folder
        self._regenerating = False
        self.stream_updates = 0  # text pieces shown while streaming (tests, benchmark)

    def compose(self) -> ComposeResult:
        yield NavBar("chat")
        with VerticalScroll(id="messages"):
            yield Static("Pick a model in the Library (F2) and press Enter to chat, or resume a saved "
                         "conversation with Ctrl+O.", id="chat-empty", markup=False)
        with Vertical(id="chat-bottom"):
            yield AttachmentTray()
            yield PromptInput(placeholder="Message (Enter sends, Esc stops)", id="prompt", disabled=True)
            yield StatusBar()
        yield Footer()

    # -- opening conversations ---------------------------------------------------------------
    async def open_model(self, model: str) -> None:
        """Start a new conversation with a model, using the app's default settings."""
        app: Any = self.app
        conv = app.conversations.create(model, app.default_system or "", app.default_settings)
        await self._show_conversation(conv)

    async def open_conversation(self, cid: int) -> None:
        """Resume a saved conversation."""
        try:
            conv = self.app.conversations.get(cid)  # type: ignore[attr-defined]
        except KeyError:
            self.notify("That conversation no longer exists", severity="warning")
            return
        await self._show_conversation(conv)

    async def _show_conversation(self, conv: Conversation) -> None:
        if self.generating:
            self.action_stop()
        self.generation += 1  # replies still in flight belong to the old conversation
        self.generating = False
        self.conversation = conv
        box = self.query_one("#messages", VerticalScroll)
        await box.remove_children()
        await self.tray.take()  # attached for the conversation left
        widgets: list[Any] = []
        for turn in conv.turns:
            widgets.extend(UserMessage(turn.content, turn.images).widgets() if turn.role == "user"
                           else reply_widgets(turn))
        if widgets:
            await box.mount_all(widgets)
        box.scroll_end(animate=False)
        prompt = self.query_one("#prompt", Input)
        prompt.disabled = False
        prompt.focus()
        last = next((t.stats for t in reversed(conv.turns) if t.role == "assistant"), {})
        used = int(last.get("prompt_tokens", 0)) + int(last.get("completion_tokens", 0))
        self.status.show(model=conv.model, state="ready", tokens_per_second=None, context_used=used,
                        context_length=self._context_length(conv.model), output=output_label(conv.output))
        self.sub_title = conv.title

    # -- sending -----------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    async def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if self.conversation is None:
            return
        command, _, rest = text.partition(" ")
        path = unquoted(rest) if command == "/image" else pasted_image(text)
        if command == "/image" and not path:
            event.input.value = ""
            self.action_attach()
            return
        if path:  # /image PATH, or the prompt is one path to an image file
            if await self.attach(path):
                event.input.value = ""
            return
        if not text and not self.tray.items:
            return
        if self.generating:
            self.notify("A reply is still being written; Esc stops it", severity="warning")
            return
        event.input.value = ""
        await self.send(text, await self.tray.take())

    async def attach(self, path: str | Path) -> bool:
        """Attach the image file at path to the next message; an unreadable one is an error notice."""
        try:
            attachment = attachments.read(path)
        except LocalrunError as e:
            self.notify(str(e), severity="error", timeout=10)
            return False
        await self.tray.add(attachment)
        self.picker_folder = Path(path).expanduser().absolute().parent
        return True

    @on(PromptInput.ImagePasted)
    async def _image_pasted(self, event: PromptInput.ImagePasted) -> None:
        await self.attach(event.path)

    @on(PromptInput.BackspaceEmpty)
    async def _backspace_empty(self) -> None:
        await self.tray.pop()

    @on(PendingImageChip.Removed)
    async def _chip_removed(self, event: PendingImageChip.Removed) -> None:
        await self.tray.discard(event.chip)
        self.query_one("#prompt", Input).focus()

    async def send(self, text: str, images: tuple[Attachment, ...] = ()) -> None:
        """Show the prompt (its images above it) and stream a reply to it."""
        assert self.conversation is not None
        box = self.query_one("#messages", VerticalScroll)
        self._user_widget = UserMessage(text, images)
        await box.mount_all(self._user_widget.widgets())
        await self._start(text, images, self.conversation.history(), regenerate=False)

    # -- actions -----------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.cancel.set()
            self._close_approval()
            self.status.show(state="stopping…")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "tools":  # the key and its footer entry exist where MCP servers are configured
            return bool(self.app.mcp.configured)  # type: ignore[attr-defined]
        return True

    async def action_regenerate(self) -> None:
        conv = self.conversation
        if conv is None or self.generating:
            return
        if len(conv.turns) < 2 or conv.turns[-1].role != "assistant":
            self.notify("Nothing to regenerate yet", severity="warning")
            return
        replies = self.query(AssistantMessage)
        if replies:
            last = replies.last()
            for part in [*last.parts, *([last.thought] if last.thought is not None else [])]:
                if part.is_attached:
                    await part.remove()
            await last.remove()
        await self._start(conv.turns[-2].content, conv.turns[-2].images, conv.history(conv.turns[:-2]),
                          regenerate=True)

    def last_reply(self) -> str | None:
        conv = self.conversation
        if conv is None:
            return None
        return next((t.content for t in reversed(conv.turns) if t.role == "assistant"), None)

    def action_copy(self) -> None:
        text = self.last_reply()
        if text is None:
            self.notify("No reply to copy yet", severity="warning")
            return
        self.app.copy_to_clipboard(text)
        self.notify("Copied the last reply")

    def action_thought(self) -> None:
        """Open or fold the last reply's thought."""
        blocks = self.query(ThinkingBlock)
        if not blocks:
            self.notify("No thought to show: the model did not think", severity="warning")
            return
        block = blocks.last()
        block.collapsed = not block.collapsed
        if not block.collapsed:
            block.scroll_visible(animate=False)

    def action_attach(self) -> None:
        """Pick an image file to attach to the next message."""
        if self.conversation is None:
            self.notify("Open a model or a conversation first", severity="warning")
            return

        async def done(path: Path | None) -> None:
            if path is not None:
                await self.attach(path)
            self.query_one("#prompt", Input).focus()

        self.app.push_screen(ImagePickerScreen(self.picker_folder), done)

    def action_settings(self) -> None:
        conv = self.conversation
        if conv is None:
            self.notify("Open a model or a conversation first", severity="warning")
            return

        def done(result: ChatSettings | None) -> None:
            if result is None or self.conversation is None:
                return
            store: Any = self.app.conversations  # type: ignore[attr-defined]
            store.update_settings(self.conversation.id, result.system, result.settings, result.output)
            self.conversation = store.get(self.conversation.id)
            self.status.show(output=output_label(self.conversation.output))
            self.notify("Settings saved for this conversation")

        self.app.push_screen(SettingsScreen(conv.system, conv.settings, conv.output), done)

    def action_tools(self) -> None:
        """The conversation's MCP servers and tools, switched on and off; its tool choice and step limit."""
        conv = self.conversation
        if conv is None:
            self.notify("Open a model or a conversation first", severity="warning")
            return

        def done(result: ToolSettings | None) -> None:
            if result is None or self.conversation is None:
                return
            store: Any = self.app.conversations  # type: ignore[attr-defined]
            store.update_tools(self.conversation.id, result)
            self.conversation = store.get(self.conversation.id)
            self.notify("Tools saved for this conversation")

        self.app.push_screen(ToolsScreen(self.app.mcp, conv.tools), done)  # type: ignore[attr-defined]

    def action_conversations(self) -> None:
        store: Any = self.app.conversations  # type: ignore[attr-defined]

        async def done(cid: int | None) -> None:
            if cid is not None:
                await self.open_conversation(cid)

        self.app.push_screen(ConversationsScreen(store.list()), done)

    async def action_new(self) -> None:
        if self.conversation is None:
            self.notify("Pick a model in the Library first", severity="warning")
            return
        await self.open_model(self.conversation.model)

    def action_export(self) -> None:
        conv = self.conversation
        if conv is None or not conv.turns:
            self.notify("Nothing to export yet", severity="warning")
            return
        from localrun.store import home

        store: Any = self.app.conversations  # type: ignore[attr-defined]
        out = home() / "exports" / f"conversation-{conv.id}.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        # Markdown to read (thoughts in collapsed <details>), JSON to process (a thinking field per reply).
        _write(out, store.export_markdown(conv.id))
        _write(out.with_suffix(".json"), json.dumps(store.export_json(conv.id), ensure_ascii=False, indent=2) + "\n")
        self.notify(f"Exported to {out} (and {out.with_suffix('.json').name} beside it)")


def _write(path: Path, text: str) -> None:
    """Write a file under a temporary name and rename it over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
