"""The Chat's replies: started, streamed from the engine off the UI thread into the view, then
kept in the conversation or taken back. With MCP tools on, a reply goes through the tool loop
(tool_replies.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from textual import work
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Input, Markdown

from localrun import api
from localrun.errors import EngineCrashedError, LocalrunError, UsageError
from tui.attachments import Attachment
from tui.chat_tools import ChatTools
from tui.conversations import Conversation, Turn
from tui.messages import ReplyDone, ReplyFailed, ReplyText
from tui.screens.tool_replies import ReplyTools, ToolReplies, step_widgets
from tui.tool_calls import ToolStep
from tui.widgets.attachments import AttachmentTray
from tui.widgets.chat import AssistantMessage, ReplyError, ThinkingBlock, UserMessage

if TYPE_CHECKING:
    from localrun.generation import Chunk, Request
    from localrun.settings import GenerationParams
    from localrun.tool_loop import Reply

# Streamed text reaches the UI at most this often: on 2 cores each Markdown update takes CPU
# from the engine (20 Hz measured 0.87x of raw tok/s, 10 Hz 0.92x); the MarkdownStream coalesces further.
FLUSH_INTERVAL_S = 1 / 10


class ChatReplies(ToolReplies):
    """The part of the Chat that writes replies; ChatScreen builds on it and sets its state."""

    conversation: Conversation | None
    cancel: threading.Event
    _user_widget: UserMessage | None
    _pending_prompt: str
    _pending_images: tuple[Attachment, ...]
    _regenerating: bool
    stream_updates: int

    @property
    def tray(self) -> AttachmentTray:
        """The images attached to the next message."""
        return self.query_one(AttachmentTray)

    def _context_length(self, model: str) -> int | None:
        loaded = _loaded_model(self.app, model)
        n = loaded.info.get("n_ctx") if loaded is not None else None
        return int(n) if n else None

    async def _start(self, prompt: str, images: tuple[Attachment, ...], history: list[dict[str, Any]],
                     regenerate: bool) -> None:
        assert self.conversation is not None
        box = self.query_one("#messages", VerticalScroll)
        self._reply_widget = AssistantMessage()
        self._live = [self._reply_widget]
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
        tools: ChatTools = self.app.mcp  # type: ignore[attr-defined]
        with_tools = ReplyTools(tools, conv.id, conv.tools) if tools.is_on(conv.tools) else None
        self._generate(self.generation, conv.model, prompt, [a.data for a in images], conv.system, history,
                       conv.settings, conv.output, self.cancel, with_tools)

    @work(thread=True, group="generate")
    def _generate(self, generation: int, model: str, prompt: str, images: list[bytes], system: str,
                  history: list[dict[str, Any]], given: Mapping[str, Any], output: dict[str, Any] | None,
                  cancel: threading.Event, tools: ReplyTools | None = None) -> None:
        """The engine's token loop, off the UI thread; text and thought are posted in coalesced
        pieces. With tools, the tool loop runs the reply: each call asked about, run, shown, and
        its result fed back until the model answers."""
        models: Any = self.app.models  # type: ignore[attr-defined]
        loaded = model
        seen = bool(images) or any(m.get("images") for m in history)  # the request shows the model images
        try:
            loop = self._tool_loop(generation, tools, cancel) if tools is not None else None
            target = api.resolve_target(model)  # a model, an adapter, or base+adapter
            loaded = target.model.name
            with api.use_target(models, target, keep_alive=-1) as (session, engine):
                self.app.call_from_thread(self._loaded, generation, loaded, session.info().get("warning"))
                constraint = api.constraint(output) if output is not None else None
                steps: tuple[ToolStep, ...] = ()  # the replies that called tools, before the answer
                if loop is None or tools is None:
                    request = target.request(api.build_messages(prompt, system or None, history, images))
                    params = api.resolve_settings(given, target, engine, constraint=constraint)
                    stream = ReplyStream(self.post_message, generation)
                    text, last = stream.run(session, request, params, cancel)
                    thought = stream.thought
                else:
                    functions = loop.functions()

                    def step(msgs: list[dict[str, Any]], choice: str) -> tuple[Reply, ThoughtClock]:
                        request, params, plan = api.tool_step(target, engine, msgs, functions, api.tool_choice(choice),
                                                              given, constraint=constraint)
                        return tool_reply(ReplyStream(self.post_message, generation), session, request, params,
                                          plan, cancel)

                    outcome = self._run_tools(generation, loop, tools, _messages(prompt, system, history, images),
                                              step)
                    text, last, steps = outcome.text, outcome.final, outcome.steps
                    thought = outcome.thought or ThoughtClock()
                if last is None:
                    self.post_message(ReplyFailed(generation, "the engine ended the reply without finishing it"))
                    return
                stats = reply_stats(last, thought, seen)
                if loop is not None and cancel.is_set():  # stopped between the tool loop's steps
                    stats["finish_reason"] = "cancelled"
                self.post_message(ReplyDone(generation, text, stats, "".join(thought.parts), steps))
        except EngineCrashedError as e:
            models.unload(loaded)  # the next request loads it again
            self.post_message(ReplyFailed(generation, str(e)))
        except UsageError as e:  # this message's fault (images a text-only model cannot read)
            self.post_message(ReplyFailed(generation, str(e), refused=True))
        except LocalrunError as e:
            self.post_message(ReplyFailed(generation, str(e)))
        except Exception as e:  # noqa: BLE001 - whatever happens, the app keeps running
            self.post_message(ReplyFailed(generation, f"{type(e).__name__}: {e}"))

    def _loaded(self, generation: int, model: str = "", warning: str | None = None) -> None:
        """The model is loaded: the status line says so, and what the engine warns of about this
        model (its projector missing, its images read otherwise than trained) is shown once per app."""
        warned: set[tuple[str, str]] = self.app.model_warnings  # type: ignore[attr-defined]
        if warning and (model, warning) not in warned:
            warned.add((model, warning))
            self.notify(f"{model}: {warning}", title="Warning", severity="warning", timeout=15)
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
            self._live.append(reply.thought)
            await self.query_one("#messages", VerticalScroll).mount(reply.thought, before=reply)
        return reply.thought

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
            self.conversation = store.replace_last_reply(self.conversation.id, message.text, stats, message.thinking,
                                                         message.steps)
        else:
            self.conversation = store.add_exchange(self.conversation.id, self._pending_prompt, message.text, stats,
                                                   message.thinking, self._pending_images, message.steps)
        if self._reply_widget is not None:
            self._reply_widget.text = message.text
            self._reply_widget.parts = [w for w in self._live if w not in (self._reply_widget, self._thought_widget)]
        if self._thought_widget is not None:
            self._thought_widget.finish(stats.get("thinking_seconds"), stats.get("thinking_tokens"))
            # A reply that is all thought (cut inside it) keeps it open: there is nothing else to read.
            self._thought_widget.collapsed = bool(message.text.strip())
        self._user_widget = self._reply_widget = None
        self._live = []
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
        await self._remove_live()
        await self.query_one("#messages", VerticalScroll).mount(ReplyError(error))
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

    async def _remove_live(self) -> None:
        """Take the reply in progress out of the view: its text, thoughts and calls' blocks."""
        for widget in self._live:
            if widget.is_attached:
                await widget.remove()
        self._live = []

    async def _discard(self, note: str, error: bool = False) -> None:
        """Remove the unfinished exchange from the view; the stored conversation never had it."""
        await self._remove_live()
        if self._regenerating and self.conversation is not None:
            last = next((t for t in reversed(self.conversation.turns) if t.role == "assistant"), None)
            if last is not None:  # put the kept reply back
                await self.query_one("#messages", VerticalScroll).mount_all(reply_widgets(last))
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


class ThoughtClock:
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


class ReplyStream:
    """One reply from the engine, on the worker thread: its text, and its answer and thought posted
    to the chat in coalesced pieces (the answer without its tool calls where a tool plan's streamer
    reads them out)."""

    def __init__(self, post: Callable[[Message], Any], generation: int) -> None:
        self.post = post
        self.generation = generation
        self.thought = ThoughtClock()
        self.pending: list[str] = []

    def _post(self) -> None:
        thought = self.thought
        if self.pending or thought.pending:
            self.post(ReplyText(self.generation, "".join(self.pending), "".join(thought.pending), len(thought.parts),
                                thought.seconds()))
            self.pending.clear()
            thought.pending.clear()

    def run(self, session: Any, request: Request, params: GenerationParams, cancel: threading.Event,
            streamer: Any = None) -> tuple[str, Chunk | None]:
        """Stream the reply: its whole text and its final chunk (None: the engine never finished it)."""
        parts: list[str] = []
        last_post = time.monotonic()
        for chunk in api.stream(session, request, params, cancel):
            if chunk.done:
                self.thought.end()
                if streamer is not None:
                    self.pending.append(_content(streamer.flush()))
                self._post()
                return "".join(parts), chunk
            self.thought.feed(chunk.thinking, chunk.text)
            parts.append(chunk.text)
            self.pending.append(chunk.text if streamer is None else _content(streamer.feed(chunk.text)))
            now = time.monotonic()
            if now - last_post >= FLUSH_INTERVAL_S:
                self._post()
                last_post = now
        self._post()
        return "".join(parts), None


def _content(events: list[Any]) -> str:
    """The content of a tool streamer's events (calls are shown as they run)."""
    return "".join(e[1] for e in events if e[0] == "content" and isinstance(e[1], str))


def tool_reply(stream: ReplyStream, session: Any, request: Request, params: GenerationParams, plan: Any,
               cancel: threading.Event) -> tuple[Reply, ThoughtClock]:
    """One step of a reply with tools: its content streamed, its calls read from the whole text
    (none under "none", the step limit, nor in a stopped reply)."""
    raw, final = stream.run(session, request, params, cancel, plan.streamer())
    stopped = final is None or cancel.is_set()
    return api.tool_reply(plan, raw, final, "".join(stream.thought.parts), stopped), stream.thought


def reply_stats(chunk: Chunk, thought: ThoughtClock, seen: bool) -> dict[str, Any]:
    """What is kept of a reply's final chunk."""
    stats: dict[str, Any] = {"finish_reason": chunk.finish_reason, "prompt_tokens": chunk.prompt_tokens,
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
    return stats


def _messages(prompt: str, system: str, history: list[dict[str, Any]], images: list[bytes]) -> list[dict[str, Any]]:
    """The request's messages in the chat API's shape (what the tool loop extends)."""
    return [*([{"role": "system", "content": system}] if system else []), *history,
            {"role": "user", "content": prompt, **({"images": images} if images else {})}]


def reply_widgets(turn: Turn) -> list[Any]:
    """A stored reply's widgets: the tools it called (each step's text and calls' blocks), then its
    thought (collapsed) above its answer, when it has one."""
    reply = AssistantMessage(turn.content)
    reply.parts = step_widgets(turn.steps)
    if turn.thinking:
        reply.thought = ThinkingBlock(turn.thinking, turn.thought_title(), collapsed=True)
    return [*reply.parts, *([reply.thought] if reply.thought is not None else []), reply]


def _loaded_model(app: Any, model: str) -> Any:
    """The pool's entry for model when it is loaded, else None."""
    return next((m for m in app.models.loaded() if m.name in (model, model.split("+")[0])), None)
