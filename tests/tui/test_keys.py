"""The chat's and the library's keys the README lists, pressed in the real app with the real
starter model: ^R regenerates, ^Y copies, ^N starts a new chat, ^E exports, `a` adds a file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from localrun import api
from localrun.store import home
from tests.tui.helpers import wait_for
from tests.tui.test_flows import QUESTION, SIZE, ask, chat, library, open_starter_chat
from tui.widgets.chat import AssistantMessage, UserMessage


def test_regenerate_copy_new_and_export(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_regenerate_copy_new_and_export(make_app))


async def _test_regenerate_copy_new_and_export(make_app: Any) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_starter_chat(pilot)
        await ask(pilot, QUESTION)
        first = screen.conversation
        reply = first.turns[-1].content
        assert reply

        before = screen.generation
        await pilot.press("ctrl+r")  # greedy: the same reply again, in place of the first
        await wait_for(pilot, lambda: screen.generation > before and not screen.generating, "the new reply")
        stored = app.conversations.get(first.id)
        assert [t.role for t in stored.turns] == ["user", "assistant"] and stored.turns[1].content == reply
        assert len(screen.query(AssistantMessage)) == 1

        await pilot.press("ctrl+y")
        assert app.clipboard == reply

        await pilot.press("ctrl+e")
        exported = home() / "exports" / f"conversation-{first.id}.md"
        await wait_for(pilot, lambda: exported.exists(), "the export")
        text = exported.read_text(encoding="utf-8")
        assert QUESTION in text and reply.strip() in text

        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: screen.conversation is not None and screen.conversation.id != first.id,
                       "a new conversation")
        assert screen.conversation.model == first.model and not screen.conversation.turns
        assert not screen.query(UserMessage) and chat(app) is screen


def test_library_a_adds_a_gguf_file(make_app: Any, stories: Path) -> None:
    asyncio.run(_test_library_a_adds_a_gguf_file(make_app, stories))


async def _test_library_a_adds_a_gguf_file(make_app: Any, stories: Path) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        lib = library(app)
        await wait_for(pilot, lambda: lib.loaded, "the library to load")
        await pilot.press("a")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "TextPromptScreen", "the add dialog")
        app.screen.query_one("#prompt-input").value = str(stories)
        await pilot.press("enter")
        await wait_for(pilot, lambda: "stories260k:latest" in lib.row_names(), "the added model in the table")
        assert "stories260k:latest" in {m.name for m in api.list_models()}
        assert any("Added stories260k:latest" in m for _, m in app.notices)
