"""Pilot-driven flows of the real app with the real starter model (llama.cpp in its worker process)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.settings import LoadOptions
from tests.tui.helpers import wait_for
from tui.screens.chat import ChatScreen
from tui.screens.library import LibraryScreen
from tui.widgets.chat import AssistantMessage, UserMessage

from .. import reliability

pytestmark = pytest.mark.slow
SIZE = (80, 24)
QUESTION = "What is the opposite of hot?"
LONG = "Write a very long story about a dragon who learns to bake bread."


def library(app: Any) -> LibraryScreen:
    screen = app.mode_screens["library"]
    assert isinstance(screen, LibraryScreen)
    return screen


def chat(app: Any) -> ChatScreen:
    screen = app.mode_screens["chat"]
    assert isinstance(screen, ChatScreen)
    return screen


async def ask(pilot: Any, text: str, typed: bool = True) -> ChatScreen:
    """Type (or paste) a prompt into the chat and send it; returns once the reply is finished."""
    screen = chat(pilot.app)
    before = screen.generation
    await pilot.click("#prompt")
    if typed:
        await pilot.press(*text)
    else:
        screen.query_one("#prompt").value = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.generation > before and not screen.generating, "the reply to finish")
    return screen


async def open_starter_chat(pilot: Any) -> ChatScreen:
    lib = library(pilot.app)
    await wait_for(pilot, lambda: lib.loaded, "the library to load")
    assert "smollm2:135m" in lib.row_names()
    lib.query_one("#models").move_cursor(row=lib.row_names().index("smollm2:135m"))
    await pilot.press("enter")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen), "the chat screen")
    return chat(pilot.app)


def test_library_chat_streams_a_greedy_reply_and_resumes_after_restart(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_library_chat_streams_a_greedy_reply_and_resumes_after_restart(make_app, starter))


async def _test_library_chat_streams_a_greedy_reply_and_resumes_after_restart(make_app: Any, starter: Path) -> None:
    app = make_app(settings={"temperature": 0, "seed": 1, "max_tokens": 24})
    async with app.run_test(size=SIZE) as pilot:
        lib = library(app)
        await wait_for(pilot, lambda: lib.loaded, "the library to load")
        table = lib.query_one("#models")
        assert table.row_count == len(lib.row_names()) >= 1
        screen = await open_starter_chat(pilot)
        assert screen.conversation is not None and screen.conversation.model == "smollm2:135m"
        await ask(pilot, QUESTION)
        reply = screen.query(AssistantMessage).last()
        assert "cold" in reply.source.lower()
        assert screen.stream_updates >= 2, "the reply arrived in one piece, not streamed"
        status = screen.status.text()
        assert "ready" in status and "ctx " in status and "/1024" in status
        stored = app.conversations.get(screen.conversation.id)
        assert [t.role for t in stored.turns] == ["user", "assistant"]
        assert stored.turns[0].content == QUESTION and "cold" in stored.turns[1].content.lower()
        assert stored.turns[1].stats["completion_tokens"] > 0
        cid = stored.id

    # A new app on the same data directory: the conversation is listed and resumes.
    app2 = make_app()
    async with app2.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app2.screen, ChatScreen), "the chat screen")
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(app2.screen).__name__ == "ConversationsScreen", "the conversation list")
        await pilot.press("enter")
        screen = chat(app2)
        await wait_for(pilot, lambda: screen.conversation is not None, "the conversation to open")
        assert screen.conversation is not None and screen.conversation.id == cid
        assert [w.text for w in screen.query(UserMessage)] == [QUESTION]
        assert "cold" in screen.query(AssistantMessage).last().source.lower()
        # The history goes to the model: a follow-up is stored after the first exchange.
        await ask(pilot, "And the opposite of up?")
        stored = app2.conversations.get(cid)
        assert [t.role for t in stored.turns] == ["user", "assistant", "user", "assistant"]
        assert stored.turns[2].content == "And the opposite of up?" and stored.turns[3].content


def test_escape_stops_a_long_reply_and_keeps_nothing(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_escape_stops_a_long_reply_and_keeps_nothing(make_app, starter))


async def _test_escape_stops_a_long_reply_and_keeps_nothing(make_app: Any, starter: Path) -> None:
    app = make_app(settings={"temperature": 0, "seed": 1, "max_tokens": 2000}, model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None,
                       "the chat with the model given on the command line")
        screen = chat(app)
        # Keys typed before the prompt has focus go elsewhere (a busy machine shows it).
        await wait_for(pilot, lambda: screen.query_one("#prompt").has_focus, "the prompt to take the keys")
        await pilot.press(*LONG)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.stream_updates >= 3, "streamed text")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not screen.generating, "the reply to stop")
        assert screen.conversation is not None
        assert app.conversations.get(screen.conversation.id).turns == ()
        assert not screen.query(AssistantMessage) and not screen.query(UserMessage)
        assert screen.query_one("#prompt").value == LONG  # given back to edit or resend
        assert ("information", "Stopped; the reply was not kept") in app.notices
        # The engine is still usable after a stop: the next reply completes and is stored.
        screen.query_one("#prompt").value = ""
        screen.conversation = app.conversations.get(screen.conversation.id)
        app.conversations.update_settings(screen.conversation.id, "", {"temperature": 0, "max_tokens": 8})
        screen.conversation = app.conversations.get(screen.conversation.id)
        await ask(pilot, "Hi")
        assert len(app.conversations.get(screen.conversation.id).turns) == 2


def test_engine_crash_is_a_notification_and_the_app_recovers(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_engine_crash_is_a_notification_and_the_app_recovers(make_app, starter))


async def _test_engine_crash_is_a_notification_and_the_app_recovers(make_app: Any, starter: Path) -> None:
    app = make_app(settings={"temperature": 0, "max_tokens": 2000}, model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None,
                       "the chat")
        screen = chat(app)
        # Keys typed before the prompt has focus go elsewhere (a busy machine shows it).
        await wait_for(pilot, lambda: screen.query_one("#prompt").has_focus, "the prompt to take the keys")
        await pilot.press(*LONG)
        await pilot.press("enter")
        await wait_for(pilot, lambda: screen.stream_updates >= 2, "streamed text")
        os.kill(app.models.loaded()[0].pid, 9)  # the engine process dies mid-reply
        await wait_for(pilot, lambda: not screen.generating, "the failure to be reported")
        errors = [m for sev, m in app.notices if sev == "error"]
        assert errors and "crashed" in errors[-1] and "smollm2:135m" in errors[-1]
        assert screen.status.state == "error"
        assert app.conversations.get(screen.conversation.id).turns == ()
        assert app.models.loaded() == []  # dropped; the next request loads the model again
        screen.query_one("#prompt").value = ""
        app.conversations.update_settings(screen.conversation.id, "", {"temperature": 0, "max_tokens": 8})
        screen.conversation = app.conversations.get(screen.conversation.id)
        await ask(pilot, "Hi")
        assert len(app.conversations.get(screen.conversation.id).turns) == 2
    reliability.fault("SIGKILL", "the engine during a TUI reply")


def test_backend_error_is_a_notification(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_backend_error_is_a_notification(make_app, starter))


async def _test_backend_error_is_a_notification(make_app: Any, starter: Path) -> None:
    # A real engine error: the prompt does not fit in a 64-token context.
    app = make_app(load_options=LoadOptions(n_ctx=64), model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None,
                       "the chat")
        screen = chat(app)
        await ask(pilot, "word " * 80, typed=False)
        errors = [m for sev, m in app.notices if sev == "error"]
        assert errors and "context" in errors[-1].lower()
        assert app.conversations.get(screen.conversation.id).turns == ()
        assert not screen.query(UserMessage)


def test_delete_a_model_with_confirmation(make_app: Any, stories: Path, cli: Any) -> None:
    asyncio.run(_test_delete_a_model_with_confirmation(make_app, stories, cli))


async def _test_delete_a_model_with_confirmation(make_app: Any, stories: Path, cli: Any) -> None:
    res = cli("add", str(stories), "--name", "stories:260k")
    assert res.returncode == 0, res.stderr
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        lib = library(app)
        await wait_for(pilot, lambda: "stories:260k" in lib.row_names(), "the added model in the library")
        lib.query_one("#models").move_cursor(row=lib.row_names().index("stories:260k"))
        await pilot.pause()
        assert "stories260K.gguf" in str(lib.query_one("#details-text").render())
        await pilot.press("d")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", "the confirmation")
        await pilot.press("n")  # cancelled: still there
        await wait_for(pilot, lambda: app.screen is lib, "the library again")
        assert "stories:260k" in [m.name for m in api.list_models()]
        await pilot.press("d")
        await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmScreen", "the confirmation")
        await pilot.press("y")
        await wait_for(pilot, lambda: "stories:260k" not in lib.row_names(), "the model to leave the table")
        assert "stories:260k" not in [m.name for m in api.list_models()]
        assert stories.exists()  # added in place: the file is not ours to delete
        assert ("information", "Deleted stories:260k") in app.notices


async def open_settings(pilot: Any) -> Any:
    await pilot.press("ctrl+s")
    await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "SettingsScreen", "the settings dialog")
    return pilot.app.screen


async def choose_output(pilot: Any, dialog: Any, label: str, text: str) -> None:
    """Pick a structured-output kind in the dialog's Select, by keys, and type its text."""
    select = dialog.query_one("#set-output")
    await pilot.click("#set-output")
    await wait_for(pilot, lambda: select.expanded, "the structured-output list to open")
    await pilot.press("home")
    labels = ["none", "JSON object", "JSON schema", "GBNF grammar", "choice"]
    await pilot.press(*["down"] * labels.index(label), "enter")
    await wait_for(pilot, lambda: dialog.query_one("#output-text").display, "the text box for the spec")
    await pilot.click("#output-text")
    await pilot.press(*text)


def test_settings_choice_constrains_the_next_reply(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_settings_choice_constrains_the_next_reply(make_app, starter))


async def _test_settings_choice_constrains_the_next_reply(make_app: Any, starter: Path) -> None:
    app = make_app(settings={"temperature": 0, "seed": 1, "max_tokens": 24})
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_starter_chat(pilot)
        dialog = await open_settings(pilot)
        await choose_output(pilot, dialog, "choice", "yes,no")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is screen, "the dialog to close")
        assert screen.conversation is not None
        stored = app.conversations.get(screen.conversation.id)
        assert stored.output == {"choice": "yes,no"}
        assert "output: choice" in screen.status.text()
        await ask(pilot, QUESTION)  # unconstrained, the model answers "cold"
        reply = app.conversations.get(stored.id).turns[-1]
        assert reply.role == "assistant" and reply.content in ("yes", "no"), reply.content
        assert reply.stats["finish_reason"] == "stop"
        # The dialog shows the spec as typed next time.
        dialog = await open_settings(pilot)
        assert dialog.query_one("#set-output").value == "choice"
        assert dialog.query_one("#output-text").text == "yes,no"


def test_settings_turn_on_a_draft_model_and_the_status_line_counts_drafts(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_settings_turn_on_a_draft_model(make_app, starter))


async def _test_settings_turn_on_a_draft_model(make_app: Any, starter: Path) -> None:
    """`localrun tui --draft MODEL` loads the draft model; the settings dialog turns drafting on for
    a conversation, and the status line shows what the last reply drafted and kept."""
    app = make_app(settings={"temperature": 0, "max_tokens": 24, "draft_always": True},  # tui --draft-always
                   load_options=LoadOptions(n_ctx=1024, draft=str(starter)))
    async with app.run_test(size=SIZE) as pilot:
        screen = await open_starter_chat(pilot)
        dialog = await open_settings(pilot)
        select = dialog.query_one("#set-draft")
        assert select.value == "default"  # not set: the model's preset and the model decide
        await pilot.click("#set-draft")
        await wait_for(pilot, lambda: select.expanded, "the drafter list to open")
        await pilot.press("home", "down", "down", "down", "enter")
        await wait_for(pilot, lambda: select.value == "model", "the draft model chosen")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is screen, "the dialog to close")
        assert screen.conversation is not None
        assert app.conversations.get(screen.conversation.id).settings["speculative"] == "model"
        await ask(pilot, QUESTION)
        reply = app.conversations.get(screen.conversation.id).turns[-1]
        assert reply.stats["accepted_tokens"] > 0 and reply.stats["drafted_tokens"] >= reply.stats["accepted_tokens"]
        assert f"drafts {reply.stats['accepted_tokens']}/{reply.stats['drafted_tokens']} kept" in screen.status.text()


def test_settings_refuse_an_invalid_schema_and_stay_open(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_settings_refuse_an_invalid_schema_and_stay_open(make_app, starter))


async def _test_settings_refuse_an_invalid_schema_and_stay_open(make_app: Any, starter: Path) -> None:
    app = make_app(model="smollm2:135m")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None, "the chat")
        screen = chat(app)
        dialog = await open_settings(pilot)
        await choose_output(pilot, dialog, "JSON schema", '{"type": "object", "oneof": []}')
        error = dialog.query_one("#settings-error")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: str(error.render()).strip() != "", "the error in the dialog")
        assert "unsupported JSON Schema keyword 'oneof'" in str(error.render())
        assert app.screen is dialog  # still open, the text kept to fix
        assert dialog.query_one("#output-text").text == '{"type": "object", "oneof": []}'
        assert screen.conversation is not None
        stored = app.conversations.get(screen.conversation.id)
        assert stored.output is None
