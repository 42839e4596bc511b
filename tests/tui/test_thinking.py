"""A thinking model in the chat: the thought in a collapsible block above the answer, stored and
exported apart from it; on a tiny random Qwen3 with the real Qwen3 tokenizer and DeepSeek-R1's
template (tests/thinking_models.py), whose prompt opens the thought so the reply thinks until the
budget closes it."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input
from textual.worker import WorkerState

from localrun import api
from localrun.generation import Chunk
from localrun.store import home
from tests.thinking_models import R1_TEMPLATE
from tests.tui.helpers import wait_for
from tui.screens.chat import ChatScreen
from tui.widgets.chat import AssistantMessage, ThinkingBlock

pytestmark = pytest.mark.slow
SIZE = (100, 30)
BUDGET = 6
# Sampled: greedy, the random model repeats whitespace.
PARAMS = {"temperature": 1, "seed": 3, "max_tokens": 30, "think_budget": BUDGET}


@pytest.fixture(scope="module")
def r1(thinker: Callable[..., Path]) -> Path:
    return thinker(R1_TEMPLATE)


def chat(app: Any) -> ChatScreen:
    screen = app.mode_screens["chat"]
    assert isinstance(screen, ChatScreen)
    return screen


def test_the_thought_shows_above_the_answer_is_stored_apart_and_exported(make_app: Any, r1: Path) -> None:
    api.add_model(r1, "r1:tiny")
    asyncio.run(_flow(make_app))


async def _flow(make_app: Any) -> None:
    app = make_app(settings=PARAMS, model="r1:tiny")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None, "the chat")
        screen = chat(app)
        await wait_for(pilot, lambda: screen.query_one("#prompt").has_focus, "the prompt to take the keys")
        before = screen.generation
        screen.query_one("#prompt", Input).value = "Why is the sky blue?"
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.generation > before and not screen.generating, "the reply")
        assert not [m for sev, m in app.notices if sev == "error"], app.notices

        assert screen.conversation is not None
        turn = app.conversations.get(screen.conversation.id).turns[1]
        assert turn.thinking and turn.content.strip() and turn.stats["thinking_tokens"] == BUDGET
        assert "</think>" not in turn.content and "<think>" not in turn.thinking
        # On screen: one block with the thought, folded, titled with time and tokens, right above the answer.
        block = screen.query_one(ThinkingBlock)
        reply = screen.query_one(AssistantMessage)
        assert block.thinking == turn.thinking and reply.source == turn.content
        assert block.collapsed and block.title.startswith("Thought for ") and block.title.endswith(f"· {BUDGET} tokens")
        children = list(screen.query_one("#messages").children)
        assert children.index(block) + 1 == children.index(reply)
        await pilot.press("ctrl+g")
        assert not block.collapsed
        await pilot.press("ctrl+g")
        assert block.collapsed

        await pilot.press("ctrl+e")
        md, js = (home() / "exports" / f"conversation-{turn_id(screen)}{ext}" for ext in (".md", ".json"))
        await wait_for(pilot, lambda: md.exists() and js.exists(), "the export")
        text = md.read_text(encoding="utf-8")
        assert text.index(turn.thinking.strip()) < text.index("</details>") < text.rindex(turn.content.strip())
        assert json.loads(js.read_text())["messages"][1]["thinking"] == turn.thinking
        cid = screen.conversation.id

    # Resumed in a new app: the thought is back, folded above its answer.
    app2 = make_app()
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app2.screen, ChatScreen), "the chat screen")
        screen = chat(app2)
        await screen.open_conversation(cid)
        await wait_for(pilot, lambda: bool(screen.query(ThinkingBlock)), "the stored thought")
        block = screen.query_one(ThinkingBlock)
        assert block.thinking == turn.thinking and block.collapsed and block.title == turn.thought_title()


def turn_id(screen: ChatScreen) -> int:
    assert screen.conversation is not None
    return screen.conversation.id


class HeldStream:
    """`api.stream` as the chat's worker calls it (the real engine's reply), held before chosen chunks
    until the test has looked at the screen: before the thought's second piece, and before the
    answer's first and second pieces."""

    def __init__(self, real: Callable[..., Iterator[Chunk]]) -> None:
        self.real = real
        self.thinking = ""  # what was let through so far
        self.pieces = 0
        self.answer = ""
        self.held: str | None = None  # the stage the stream waits at
        self.passed: set[str] = set()
        self.free = False
        self._go = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Iterator[Chunk]:
        for chunk in self.real(*args, **kwargs):
            stage = self._stage(chunk)
            if stage is not None and not self.free:
                self.passed.add(stage)
                self.held = stage
                self._go.wait()
                self._go.clear()
                self.held = None
            self.thinking += chunk.thinking
            self.pieces += bool(chunk.thinking)
            self.answer += chunk.text
            yield chunk

    def _stage(self, chunk: Chunk) -> str | None:
        if chunk.thinking and self.pieces == 1 and "thinking" not in self.passed:
            return "thinking"
        if chunk.text and not self.answer:
            return "answer"
        if chunk.text and "answering" not in self.passed:
            return "answering"
        return None

    def go(self, free: bool = False) -> None:
        """Let the stream on, to its next stage (free: to its end)."""
        self.free = self.free or free
        self._go.set()


def test_the_block_while_the_thought_streams_then_when_it_closes(make_app: Any, r1: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    api.add_model(r1, "r1:tiny")
    held = HeldStream(api.stream)
    monkeypatch.setattr(api, "stream", held)
    # Every piece is posted as it comes (not coalesced in time), so a held stream has shown all it let through.
    monkeypatch.setattr("tui.screens.chat_replies.FLUSH_INTERVAL_S", 0)
    asyncio.run(_mid_stream(make_app, held))


THINKING = re.compile(r"Thinking… (\d+\.\d) s · (\d+) tokens?")
THOUGHT = re.compile(r"Thought for (\d+\.\d) s · (\d+) tokens?")


async def _mid_stream(make_app: Any, held: HeldStream) -> None:
    app = make_app(settings=PARAMS, model="r1:tiny")
    async with app.run_test(size=SIZE) as pilot:
        try:
            await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None, "the chat")
            screen = chat(app)
            await wait_for(pilot, lambda: screen.query_one("#prompt").has_focus, "the prompt to take the keys")
            screen.query_one("#prompt", Input).value = "Why is the sky blue?"
            await pilot.press("enter")

            def block() -> ThinkingBlock:
                return screen.query_one(ThinkingBlock)

            def shown(stage: str) -> Callable[[], bool]:
                # held at the stage, and everything let through before it is in the block
                return lambda: (held.held == stage and bool(screen.query(ThinkingBlock))
                                and block().thinking == held.thinking)

            # One piece of the thought: the block is open above the empty answer, titled with the time so far.
            await wait_for(pilot, shown("thinking"), "the thought's first piece")
            generating = [w for w in app.workers if w.group == "generate"]
            assert [w.state for w in generating] == [WorkerState.RUNNING] and screen.generating
            reply = screen.query_one(AssistantMessage)
            assert not block().collapsed and reply.source == "" and reply.thought is block()
            first = THINKING.fullmatch(str(block().title))
            assert first is not None and first[2] == "1", block().title
            assert str(block().thought.content) == held.thinking and held.thinking
            # The whole thought, the answer not begun: still open, its time and pieces counted on.
            held.go()
            await wait_for(pilot, shown("answer"), "the whole thought")
            whole = THINKING.fullmatch(str(block().title))
            assert whole is not None and int(whole[2]) == held.pieces > 1, block().title
            assert float(whole[1]) >= float(first[1])
            assert not block().collapsed and reply.source == "" and screen.status.state == "generating…"
            assert generating[0].state == WorkerState.RUNNING
            # The answer's first piece: the thought folds away, titled with its time and pieces.
            held.go()
            await wait_for(pilot, lambda: held.held == "answering" and block().collapsed, "the answer to start")
            closed = THOUGHT.fullmatch(str(block().title))
            assert closed is not None and int(closed[2]) == held.pieces, block().title
            await wait_for(pilot, lambda: reply.source == held.answer, "the answer's first piece on screen")
            assert screen.generating and block().thinking == held.thinking
            # The end: still folded, now titled with the engine's count of thought tokens (the budget).
            held.go(free=True)
            await wait_for(pilot, lambda: not screen.generating, "the reply")
            await wait_for(pilot, lambda: generating[0].state == WorkerState.SUCCESS, "the worker to end")
            assert block().collapsed and THOUGHT.fullmatch(str(block().title))
            assert str(block().title).endswith(f"· {BUDGET} tokens") and block().thinking == held.thinking
            assert screen.conversation is not None and screen.conversation.turns[-1].thinking == held.thinking
            assert reply.source == screen.conversation.turns[-1].content == held.answer
            assert not [m for sev, m in app.notices if sev == "error"], app.notices
        finally:
            held.go(free=True)
