"""The Chat: streamed Markdown replies (a thinking model's thought in a block above), images
attached to messages, stop, regenerate, settings, saved conversations."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Input, Markdown, Static
from textual.widgets.markdown import MarkdownStream

from localrun import api
from localrun.errors import EngineCrashedError, LocalrunError, UsageError
from localrun.generation import GenerationParams
from tui import attachments
from tui.attachments import Attachment
from tui.conversations import Conversation, Turn
from tui.messages import ReplyDone, ReplyFailed, ReplyText
from tui.screens.dialogs import ChatSettings, ConversationsScreen, SettingsScreen, output_label
from tui.screens.image_picker import ImagePickerScreen
from tui.widgets.attachments import AttachmentTray, PendingImageChip
from tui.widgets.chat import (
    AssistantMessage,
    PromptInput,
    ReplyError,
    StatusBar,
    ThinkingBlock,
    UserMessage,
)
from tui.widgets.navbar import NavBar

# Streamed text reaches the UI at most this often: on 2 cores each Markdown update takes CPU
# from the engine (20 Hz measured 0.87x of raw tok/s, 10 Hz 0.92x); the MarkdownStream coalesces further.
FLUSH_INTERVAL_S = 1 / 10


class ChatScreen(Screen[None]):
    """One conversation with one model."""

    BINDINGS = [
        Binding("escape", "stop", "Stop", show=True),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+y", "copy", "Copy"),
        Binding("ctrl+s", "settings", "Settings"),
        Binding("ctrl+o", "conversations", "Chats"),
        Binding("ctrl+n", "new", "New"),
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

    @property
    def status(self) -> StatusBar:
        return self.query_one(StatusBar)

    @property
    def tray(self) -> AttachmentTray:
        """The images attached to the next message."""
        return self.query_one(AttachmentTray)

    # -- opening conversations ---------------------------------------------------------------
    async def open_model(self, model: str) -> None:
        """Start a new conversation with a model, using the app's default settings."""
        app: Any = self.app
        conv = app.conversations.create(model, app.default_system or "", app.default_params)
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
                           else _reply_widgets(turn))
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

    def _context_length(self, model: str) -> int | None:
        loaded = _loaded_model(self.app, model)
        n = loaded.info.get("n_ctx") if loaded is not None else None
        return int(n) if n else None

    # -- sending -----------------------------------------------------------------------------
    @on(Input.Submitted, "#prompt")
    async def _submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if self.conversation is None:
            return
        command, _, rest = text.partition(" ")
        path = attachments.unquoted(rest) if command == "/image" else attachments.pasted_image(text)
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

    async def _start(self, prompt: str, images: tuple[Attachment, ...], history: list[dict[str, Any]],
                     regenerate: bool) -> None:
        assert self.conversation is not None
        box = self.query_one("#messages", VerticalScroll)
        self._reply_widget = AssistantMessage()
        await box.mount(self._reply_widget)
        box.scroll_end(animate=False)
        self._stream = Markdown.get_stream(self._reply_widget)
        self._pending_prompt = prompt
        self._pending_images = images
        self._regenerating = regenerate
        self.generation += 1
        self.generating = True
        self.cancel = threading.Event()
        state = "loading model…" if _loaded_model(self.app, self.conversation.model) is None else "generating…"
        self.status.show(state=state, tokens_per_second=None)
        conv = self.conversation
        self._generate(self.generation, conv.model, prompt, [a.data for a in images], conv.system, history,
                       conv.params, self.cancel)

    @work(thread=True, group="generate")
    def _generate(self, generation: int, model: str, prompt: str, images: list[bytes], system: str,
                  history: list[dict[str, Any]], params: GenerationParams, cancel: threading.Event) -> None:
        """The engine's token loop, off the UI thread; text and thought are posted in coalesced pieces."""
        models: Any = self.app.models  # type: ignore[attr-defined]
        parts: list[str] = []
        pending: list[str] = []
        thought = _ThoughtClock()
        last_post = time.monotonic()

        def post() -> None:
            if pending or thought.pending:
                self.post_message(ReplyText(generation, "".join(pending), "".join(thought.pending),
                                            len(thought.parts), thought.seconds()))
                pending.clear()
                thought.pending.clear()
        loaded = model
        seen = bool(images) or any(m.get("images") for m in history)  # the request shows the model images
        try:
            target = api.resolve_target(model)  # a model, an adapter, or base+adapter
            loaded = target.model.name
            with api.use_target(models, target, keep_alive=-1) as (session, engine):
                self.app.call_from_thread(self._loaded, generation)
                request = target.request(api.build_messages(prompt, system or None, history, images))
                for chunk in api.stream(session, request, target.params(target.under(params), engine), cancel):
                    if chunk.done:
                        thought.end()
                        post()
                        stats = {"finish_reason": chunk.finish_reason, "prompt_tokens": chunk.prompt_tokens,
                                 "completion_tokens": chunk.completion_tokens,
                                 "tokens_per_second": round(chunk.tokens_per_second, 2)}
                        if seen:  # 0: every image was found in the engine's cache
                            stats["images_encoded"] = chunk.images_encoded
                        if chunk.drafted_tokens:
                            stats["drafted_tokens"] = chunk.drafted_tokens
                            stats["accepted_tokens"] = chunk.accepted_tokens
                        if thought.parts or chunk.thinking_tokens:
                            stats["thinking_tokens"] = chunk.thinking_tokens
                            stats["thinking_seconds"] = round(thought.seconds(), 2)
                        self.post_message(ReplyDone(generation, "".join(parts), stats, "".join(thought.parts)))
                        return
                    thought.feed(chunk.thinking, chunk.text)
                    parts.append(chunk.text)
                    pending.append(chunk.text)
                    now = time.monotonic()
                    if now - last_post >= FLUSH_INTERVAL_S:
                        post()
                        last_post = now
            self.post_message(ReplyFailed(generation, "the engine ended the reply without finishing it"))
        except EngineCrashedError as e:
            models.unload(loaded)  # the next request loads it again
            self.post_message(ReplyFailed(generation, str(e)))
        except UsageError as e:  # this message's fault (images a text-only model cannot read)
            self.post_message(ReplyFailed(generation, str(e), refused=True))
        except LocalrunError as e:
            self.post_message(ReplyFailed(generation, str(e)))
        except Exception as e:  # noqa: BLE001 - whatever happens, the app keeps running
            self.post_message(ReplyFailed(generation, f"{type(e).__name__}: {e}"))

    def _loaded(self, generation: int) -> None:
        if generation == self.generation and self.generating:
            n = self._context_length(self.conversation.model) if self.conversation else None
            self.status.show(state="generating…", context_length=int(n) if n else None)

    async def on_reply_text(self, message: ReplyText) -> None:
        if message.generation != self.generation or self._stream is None:
            return
        self.stream_updates += 1
        if message.thinking:
            block = await self._thought_block()
            block.append(message.thinking)
            block.progress(message.thinking_seconds, message.thinking_pieces)
        if message.text:
            if self._thought_widget is not None and not self._thought_widget.collapsed:
                # The answer started: the thought folds away above it.
                self._thought_widget.finish(message.thinking_seconds, message.thinking_pieces)
                self._thought_widget.collapsed = True
            await self._stream.write(message.text)
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    @property
    def _thought_widget(self) -> ThinkingBlock | None:
        """The thinking block of the reply in progress (the one its answer holds), if it thought."""
        return self._reply_widget.thought if self._reply_widget is not None else None

    async def _thought_block(self) -> ThinkingBlock:
        """The reply's thinking block, mounted above the answer when the first thought arrives."""
        reply = self._reply_widget
        assert reply is not None
        if reply.thought is None:
            reply.thought = ThinkingBlock()
            await self.query_one("#messages", VerticalScroll).mount(reply.thought, before=reply)
        return reply.thought

    async def _finish_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def on_reply_done(self, message: ReplyDone) -> None:
        if message.generation != self.generation:
            return
        await self._finish_stream()
        stats = message.stats
        if stats.get("finish_reason") == "cancelled":
            await self._discard("Stopped; the reply was not kept")
            self.generating = False  # settled: what the screen shows is final
            return
        assert self.conversation is not None
        store: Any = self.app.conversations  # type: ignore[attr-defined]
        if self._regenerating:
            self.conversation = store.replace_last_reply(self.conversation.id, message.text, stats, message.thinking)
        else:
            self.conversation = store.add_exchange(self.conversation.id, self._pending_prompt, message.text, stats,
                                                   message.thinking, self._pending_images)
        if self._reply_widget is not None:
            self._reply_widget.text = message.text
        if self._thought_widget is not None:
            self._thought_widget.finish(stats.get("thinking_seconds"), stats.get("thinking_tokens"))
            # A reply that is all thought (cut inside it) keeps it open: there is nothing else to read.
            self._thought_widget.collapsed = bool(message.text.strip())
        self._user_widget = self._reply_widget = None
        assert self.conversation is not None
        self.sub_title = self.conversation.title
        drafted = int(stats.get("drafted_tokens") or 0)
        self.status.show(state="ready", tokens_per_second=stats.get("tokens_per_second") or None,
                         drafts=(drafted, int(stats.get("accepted_tokens") or 0)) if drafted else None,
                         context_used=int(stats.get("prompt_tokens", 0)) + int(stats.get("completion_tokens", 0)))
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)
        self.generating = False

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        if message.generation != self.generation:
            return
        await self._finish_stream()
        if message.refused and not self._regenerating:
            await self._refused(message.error)
        else:
            await self._discard(message.error, error=True)
        self.generating = False  # after the error is shown and the exchange removed

    async def _refused(self, error: str) -> None:
        """The model refused the message: the error stays in its reply's place, the message above it
        (not kept); its text goes back to the prompt to send again without what was refused."""
        if self._thought_widget is not None:
            await self._thought_widget.remove()
        if self._reply_widget is not None:
            await self.query_one("#messages", VerticalScroll).mount(ReplyError(error), before=self._reply_widget)
            await self._reply_widget.remove()
        if self._user_widget is not None:
            self._user_widget.add_class("-refused")
            if self._user_widget.chips is not None:
                self._user_widget.chips.add_class("-refused")
        prompt = self.query_one("#prompt", Input)
        if not prompt.value:
            prompt.value = self._pending_prompt
        self._user_widget = self._reply_widget = None
        self.status.show(state="ready")
        self.query_one("#messages", VerticalScroll).scroll_end(animate=False)

    async def _discard(self, note: str, error: bool = False) -> None:
        """Remove the unfinished exchange from the view; the stored conversation never had it."""
        if self._thought_widget is not None:
            await self._thought_widget.remove()
        if self._reply_widget is not None:
            await self._reply_widget.remove()
        if self._regenerating and self.conversation is not None:
            last = next((t for t in reversed(self.conversation.turns) if t.role == "assistant"), None)
            if last is not None:  # put the kept reply back
                await self.query_one("#messages", VerticalScroll).mount_all(_reply_widgets(last))
        elif self._user_widget is not None:
            await self._user_widget.remove_all()
            prompt = self.query_one("#prompt", Input)
            if not prompt.value:
                prompt.value = self._pending_prompt  # give the prompt back to edit or resend
            if not self.tray.items:
                for image in self._pending_images:  # and its images
                    await self.tray.add(image)
        self._user_widget = self._reply_widget = None
        self.status.show(state="ready" if not error else "error")
        self.notify(note, severity="error" if error else "information", timeout=10 if error else 4)

    # -- actions -----------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating:
            self.cancel.set()
            self.status.show(state="stopping…")

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
            if last.thought is not None:
                await last.thought.remove()
            await last.remove()
        await self._start(conv.turns[-2].content, conv.turns[-2].images, conv.history()[:-2], regenerate=True)

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
            store.update_settings(self.conversation.id, result.system, result.params, result.output)
            self.conversation = store.get(self.conversation.id)
            self.status.show(output=output_label(self.conversation.output))
            self.notify("Settings saved for this conversation")

        self.app.push_screen(SettingsScreen(conv.system, conv.params, conv.output), done)

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


class _ThoughtClock:
    """A streaming reply's thought: its pieces, those not yet posted, and how long it took (from
    its first piece to the answer's first, or to the end of a reply that never answered)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.pending: list[str] = []
        self.start: float | None = None
        self.stop: float | None = None

    def feed(self, thinking: str, answer: str) -> None:
        if thinking:
            if self.start is None:
                self.start = time.monotonic()
            self.parts.append(thinking)
            self.pending.append(thinking)
        if answer:
            self.end()

    def end(self) -> None:
        if self.start is not None and self.stop is None:
            self.stop = time.monotonic()

    def seconds(self) -> float:
        if self.start is None:
            return 0.0
        return (self.stop if self.stop is not None else time.monotonic()) - self.start


def _reply_widgets(turn: Turn) -> list[Any]:
    """A stored reply's widgets: its thought (collapsed) above its answer, when it has one."""
    reply = AssistantMessage(turn.content)
    if not turn.thinking:
        return [reply]
    reply.thought = ThinkingBlock(turn.thinking, turn.thought_title(), collapsed=True)
    return [reply.thought, reply]


def _write(path: Path, text: str) -> None:
    """Write a file under a temporary name and rename it over the old one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _loaded_model(app: Any, model: str) -> Any:
    """The pool's entry for model when it is loaded, else None."""
    return next((m for m in app.models.loaded() if m.name in (model, model.split("+")[0])), None)
