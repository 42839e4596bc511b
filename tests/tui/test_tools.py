"""MCP tools in the chat: the real starter model calls the test server's tools (tests/mcp_test_server.py
over stdio) through the app. Each call waits on an approval prompt (Esc and a stopped reply mean
no; always and never hold for the conversation), shows as a collapsible block, is stored with its reply and sent back
to the model in later turns, exported, and shown again when the conversation is reopened; the tools
panel turns servers and tools off for one conversation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input, Select, Switch

from localrun.cli import build_parser
from localrun.cli.tui import app_from_args
from localrun.errors import UsageError
from localrun.store import home
from localrun.tool_loop import REFUSED
from tests.tui.helpers import wait_for
from tui.conversations import ConversationStore
from tui.screens.chat import ChatScreen
from tui.screens.dialogs import HELP_TOOLS, HelpScreen
from tui.screens.tools import ToolApprovalScreen, ToolsScreen
from tui.tool_calls import ToolCallRecord, ToolSettings, ToolStep
from tui.widgets.chat import ToolCallBlock

SERVER = Path(__file__).resolve().parent.parent / "mcp_test_server.py"
SIZE = (100, 30)
ASK = "What is the codeword of project Falcon?"
ANSWER = "The codeword of Project Falcon is PELICAN-14."  # the tool's result, and the starter's answer with it


def write_config(folder: Path) -> Path:
    """An mcp.json with the test server and one whose command does not exist."""
    path = folder / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"t": {"command": sys.executable, "args": [str(SERVER), "stdio"]},
                                               "missing": {"command": "/nonexistent/mcp-server"}}}))
    return path


def chat(app: Any) -> ChatScreen:
    screen = app.mode_screens["chat"]
    assert isinstance(screen, ChatScreen)
    return screen


# -- the flow, with the real model and the real server -------------------------------------------


@pytest.mark.slow
def test_calls_are_asked_about_shown_stored_exported_and_switched_off(make_app: Any, starter: Path,
                                                                      tmp_path: Path) -> None:
    asyncio.run(_flow(make_app, write_config(tmp_path)))


async def _send(pilot: Any, screen: ChatScreen, text: str) -> int:
    """Send a message; returns the generation of its reply."""
    before = screen.generation
    prompt = screen.query_one("#prompt", Input)
    prompt.value = text
    prompt.focus()
    await pilot.press("enter")
    await wait_for(pilot, lambda: screen.generation > before, "the reply to start")
    return screen.generation


def _approval(app: Any) -> bool:
    return isinstance(app.screen, ToolApprovalScreen)


def _prompt_ready(app: Any) -> bool:
    """The approval prompt is shown with its buttons, the No button focused (composed and mounted)."""
    return _approval(app) and app.screen.focused is not None and app.screen.focused.id == "no"


async def _asked(pilot: Any, screen: ChatScreen) -> ToolApprovalScreen:
    """Wait for the approval prompt, ready to answer (failing if the reply ends without one)."""
    app = pilot.app
    await wait_for(pilot, lambda: _prompt_ready(app) or not screen.generating, "the approval prompt")
    assert _approval(app), "the reply ended without asking"
    return app.screen  # type: ignore[no-any-return]


async def _done(pilot: Any, screen: ChatScreen, generation: int) -> None:
    """Wait for the reply to end; fail if it asks (again), or an error was shown."""
    await wait_for(pilot, lambda: _approval(pilot.app) or (screen.generation == generation and not screen.generating),
                   "the reply to end")
    assert not _approval(pilot.app), "asked again"
    await pilot.app.workers.wait_for_complete()
    assert not [m for sev, m in pilot.app.notices if sev == "error"], pilot.app.notices


async def _flow(make_app: Any, cfg: Path) -> None:
    app = make_app(model="smollm2:135m", mcp=cfg, tool_choice="codeword", max_tool_steps=1)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: "chat" in app.mode_screens and chat(app).conversation is not None, "the chat")
        screen = chat(app)
        first = screen.conversation
        assert first is not None and not app.mcp.started  # the servers start with the first message

        # Stopped while the prompt is open: the prompt goes, nothing hangs, nothing is kept.
        await _send(pilot, screen, ASK)
        prompt = await _asked(pilot, screen)
        assert app.mcp.started
        shown = str(prompt.query_one("#approval-tool").render())
        assert "t" in shown and "codeword" in shown
        assert json.loads(str(prompt.query_one("#approval-arguments").render())) == {"project": "Project Falcon"}
        missing = [m for _, m in app.notices if "'missing'" in m]
        assert len(missing) == 1 and "MCP server 'missing' is not available: its command was not found" in missing[0]
        screen.action_stop()
        await wait_for(pilot, lambda: not screen.generating, "the stopped reply")
        await app.workers.wait_for_complete()
        assert not _approval(app) and not app.conversations.get(first.id).turns
        assert not screen.query(ToolCallBlock) and screen.query_one("#prompt", Input).value == ASK

        # No (Esc): the block says refused, and the model is told.
        generation = await _send(pilot, screen, ASK)
        await _asked(pilot, screen)
        await pilot.press("escape")
        await _done(pilot, screen, generation)
        stored = app.conversations.get(first.id)
        call = stored.turns[1].steps[0].calls[0]
        assert (call.server, call.tool, call.state, call.result) == ("t", "codeword", "refused", REFUSED)
        assert {"role": "tool", "tool_call_id": call.id, "name": "codeword", "content": REFUSED} in stored.history()
        block = screen.query_one(ToolCallBlock)
        assert block.call == call and str(block.title) == "t/codeword · refused" and block.collapsed
        # Never: refused now, and from then on without asking.
        generation = await _send(pilot, screen, ASK)
        await _asked(pilot, screen)
        await pilot.press("v")
        await _done(pilot, screen, generation)
        generation = await _send(pilot, screen, ASK)
        await _done(pilot, screen, generation)
        stored = app.conversations.get(first.id)
        assert [c.state for t in stored.turns for s in t.steps for c in s.calls] == ["refused"] * 3
        assert len(screen.query(ToolCallBlock)) == 3

        # Always, in a new conversation: the result is read and answered with; no second ask.
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: screen.conversation is not None and screen.conversation.id != first.id,
                       "a new conversation")
        second = screen.conversation
        assert second is not None and not screen.query(ToolCallBlock)
        generation = await _send(pilot, screen, ASK)
        await _asked(pilot, screen)
        await pilot.press("a")
        await _done(pilot, screen, generation)
        turn = app.conversations.get(second.id).turns[1]
        call = turn.steps[0].calls[0]
        assert (call.state, call.arguments, call.result) == ("ran", {"project": "Project Falcon"}, ANSWER)
        assert turn.content == ANSWER
        block = screen.query_one(ToolCallBlock)
        assert str(block.title).startswith("t/codeword · ran · ") and str(block.title).endswith(" ms")
        assert block.collapsed and block.result.region.area == 0  # folded: arguments and result hidden
        await pilot.click(block.query_one("CollapsibleTitle"))
        await wait_for(pilot, lambda: not block.collapsed and block.result.region.area > 0, "the block to open")
        assert json.loads(str(block.arguments.render())) == {"project": "Project Falcon"}
        assert str(block.result.render()) == ANSWER

        generation = await _send(pilot, screen, ASK)  # allowed always: runs without asking
        await _done(pilot, screen, generation)
        again = app.conversations.get(second.id)
        assert [c.state for t in again.turns for s in t.steps for c in s.calls] == ["ran", "ran"]
        assert len(screen.query(ToolCallBlock)) == 2
        # The first exchange's call and result went back to the model with the second message.
        assert again.history()[:3] == [{"role": "user", "content": ASK}, *turn.steps[0].messages()]

        # Regenerated, the reply's calls are replaced with the new reply's (greedy: the same again).
        generation = screen.generation
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: screen.generation > generation, "the regeneration to start")
        await _done(pilot, screen, screen.generation)
        regenerated = app.conversations.get(second.id)

        def calls(conv: Any) -> list[tuple[str, Any, str]]:
            return [(c.state, c.arguments, c.result) for t in conv.turns for s in t.steps for c in s.calls]

        assert [t.content for t in regenerated.turns] == [t.content for t in again.turns]
        assert calls(regenerated) == calls(again) and len(screen.query(ToolCallBlock)) == 2

        # The export keeps the calls: Markdown blocks, and the chat API's messages in JSON.
        await pilot.press("ctrl+e")
        md, js = (home() / "exports" / f"conversation-{second.id}{ext}" for ext in (".md", ".json"))
        await wait_for(pilot, lambda: md.exists() and js.exists(), "the export")
        text = md.read_text(encoding="utf-8")
        assert text.count("<summary>Tool t/codeword · ran · ") == 2 and '"project": "Project Falcon"' in text
        assert text.index("<summary>Tool t/codeword") < text.index(f"```\n\n</details>\n\n{ANSWER}")
        messages = json.loads(js.read_text(encoding="utf-8"))["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"] * 2
        assert messages[1]["tool_calls"][0]["function"]["name"] == "codeword"
        assert messages[2]["content"] == ANSWER and messages[2]["server"] == "t" and messages[2]["state"] == "ran"

        # The tools panel: codeword off for this conversation, and the next request goes without it
        # (forced to call a tool, the model calls another one).
        await pilot.press("ctrl+l")
        await wait_for(pilot, lambda: isinstance(app.screen, ToolsScreen) and app.screen.loaded, "the tools panel")
        panel = app.screen
        assert "not available (its command was not found" in str(panel.query_one(".tools-failed").render())
        switch = next(panel.query_one(f"#{sid}", Switch) for sid, key in panel.switches.items()
                      if key == ("t", "codeword"))
        choice = panel.query_one("#tools-choice", Select)
        assert choice.value == "codeword"
        await pilot.click(switch)
        await wait_for(pilot, lambda: not switch.value and choice.value == "auto", "codeword off")
        choice.value = "required"
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, ToolsScreen), "the panel to close")
        assert screen.conversation is not None
        assert screen.conversation.tools == ToolSettings(frozenset({"t/codeword"}), "required")
        generation = await _send(pilot, screen, ASK)
        asked = await _asked(pilot, screen)
        shown = str(asked.query_one("#approval-tool").render())
        assert "codeword" not in shown and any(f"Tool    {t}" in shown for t in ("add", "fail", "sleep", "crash"))
        await pilot.press("escape")
        await _done(pilot, screen, generation)

        # Reopened, the first conversation shows its refused calls again.
        await screen.open_conversation(first.id)
        await wait_for(pilot, lambda: len(screen.query(ToolCallBlock)) == 3, "the stored calls")
        assert [b.call.state for b in screen.query(ToolCallBlock)] == ["refused"] * 3
        assert screen.conversation is not None and screen.conversation.tools == ToolSettings()
        assert app.mcp.servers.running == ["t"]
    # stopped with the app: no process of the test server is left
    left = subprocess.run(["pgrep", "-f", "mcp_test_server.py stdio"], capture_output=True, text=True)
    assert left.stdout.strip() == ""


# -- the parts that need no model ----------------------------------------------------------------


def _steps() -> tuple[ToolStep, ...]:
    ran = ToolCallRecord("call_1", "codeword", "t", "codeword", {"project": "X"}, "The codeword of X is PELICAN-1.",
                         False, True, 0.0123)
    refused = ToolCallRecord("call_2", "add", "t", "add", {"a": 1, "b": 2}, REFUSED, True, False, refused=True)
    return (ToolStep("Let me look.", "", (ran, refused)),)


def test_calls_are_stored_with_their_reply_sent_back_and_exported(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("m")
    store.add_exchange(c.id, "q", "X's is PELICAN-1.", {"completion_tokens": 5}, steps=_steps())
    again = ConversationStore(tmp_path / "c.sqlite3").get(c.id)
    assert again.turns[1].steps == _steps() and again.turns[0].steps == ()
    assert [c.state for c in again.turns[1].steps[0].calls] == ["ran", "refused"]
    assert again.history() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "codeword", "arguments": '{"project": "X"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "codeword", "content": "The codeword of X is PELICAN-1."},
        {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": REFUSED},
        {"role": "assistant", "content": "X's is PELICAN-1."},
    ]
    md = store.export_markdown(c.id)
    assert "<summary>Tool t/codeword · ran · 12 ms</summary>" in md and "<summary>Tool t/add · refused</summary>" in md
    assert md.index("Let me look.") < md.index("PELICAN-1.\n```") < md.index("X's is PELICAN-1.")
    data = store.export_json(c.id)
    assert [m["role"] for m in data["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
    assert data["messages"][3] | {} == {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": REFUSED,
                                        "server": "t", "tool": "add", "state": "refused", "seconds": 0.0}
    again = store.replace_last_reply(c.id, "Regenerated.")  # without calls this time
    assert again.turns[1].steps == () and "<details>" not in store.export_markdown(c.id)


def test_tool_settings_are_kept_per_conversation_through_settings_saves(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    a, b = store.create("m"), store.create("m")
    assert a.tools == ToolSettings() and a.tools.enabled("t", "add")
    chosen = ToolSettings(frozenset({"t/add", "web"}), "codeword", 2)
    store.update_tools(a.id, chosen)
    store.update_settings(a.id, "Be brief.", {"top_k": 3}, {"format": "json"})
    again = ConversationStore(tmp_path / "c.sqlite3").get(a.id)
    assert again.tools == chosen and again.settings == {"top_k": 3} and again.output == {"format": "json"}
    assert not again.tools.enabled("t", "add") and again.tools.enabled("t", "codeword")
    assert not again.tools.enabled("web") and not again.tools.enabled("web", "fetch")
    assert store.get(b.id).tools == ToolSettings()


def test_tui_mcp_flags(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    args = build_parser().parse_args(["tui", "--mcp", str(cfg), "--tool-choice", "codeword", "--max-tool-steps", "2",
                                      "--allow-tools", "t/add"])
    app = app_from_args(args)
    try:
        assert app.mcp.configured and app.mcp.names() == ["t", "missing"] and not app.mcp.started
        assert (app.mcp.choice, app.mcp.max_steps, app.mcp.allowed) == ("codeword", 2, ("t/add",))
    finally:
        app.models.close()
    with pytest.raises(UsageError, match="does not exist"):  # before the UI starts
        app_from_args(build_parser().parse_args(["tui", "--mcp", str(tmp_path / "none.json")]))
    with pytest.raises(UsageError, match="opposite"):
        app_from_args(build_parser().parse_args(["tui", "--mcp", str(cfg), "--no-mcp"]))
    off = app_from_args(build_parser().parse_args(["tui", "--no-mcp"]))
    off.models.close()
    assert not off.mcp.configured


def test_the_tools_key_shows_only_where_servers_are_configured(make_app: Any, tmp_path: Path) -> None:
    async def run(app: Any, configured: bool) -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("f4")
            await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen), "the chat")
            assert app.screen.check_action("tools", ()) is configured
            shown = [b.binding.key for b in app.screen.active_bindings.values() if b.enabled]
            assert ("ctrl+l" in shown) is configured
            await pilot.press("f1")
            await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), "the help")
            assert (HELP_TOOLS in app.screen.text) is configured

    asyncio.run(run(make_app(), False))
    asyncio.run(run(make_app(mcp=write_config(tmp_path)), True))


def test_a_broken_mcp_json_of_localrun_is_one_notice_and_the_app_goes_on(make_app: Any, isolated_home: Path) -> None:
    isolated_home.mkdir(parents=True, exist_ok=True)
    (isolated_home / "mcp.json").write_text("{")
    app = make_app()
    assert not app.mcp.configured

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: bool(app.notices), "the notice")
            assert [sev for sev, _ in app.notices] == ["warning"]
            notice = app.notices[0][1]
            assert "cannot read the MCP configuration" in notice and "without MCP tools" in notice

    asyncio.run(run())
