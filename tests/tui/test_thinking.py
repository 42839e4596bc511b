"""A thinking model in the chat: the thought in a collapsible block above the answer, stored and
exported apart from it; on a tiny random Qwen3 with the real Qwen3 tokenizer and DeepSeek-R1's
template (tests/thinking_models.py), whose prompt opens the thought so the reply thinks until the
budget closes it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input

from localrun import api
from localrun.generation import GenerationParams
from localrun.store import home
from tests.thinking_models import R1_TEMPLATE
from tests.tui.helpers import wait_for
from tui.screens.chat import ChatScreen
from tui.widgets.chat import AssistantMessage, ThinkingBlock

pytestmark = pytest.mark.slow
SIZE = (100, 30)
BUDGET = 6
# Sampled: greedy, the random model repeats whitespace.
PARAMS = GenerationParams(temperature=1, seed=3, max_tokens=30, think_budget=BUDGET)


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
    app = make_app(params=PARAMS, model="r1:tiny")
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
