"""SVG snapshots of each screen at 80x24 (update with `pytest --snapshot-update`).

Deterministic by construction: a fixed terminal size, model paths shown under a fixed folder,
conversations written by the test, no generation (so no speeds or timestamps on screen).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from tests.tui.helpers import wait_for
from tui.screens.chat import ChatScreen
from tui.screens.library import LibraryScreen

SIZE = (80, 24)
REPLY = """The opposite of **hot** is *cold*. In Python:

```python
def opposite(word: str) -> str:
    return {"hot": "cold", "up": "down"}[word]
```
"""


@pytest.fixture(autouse=True)
def fixed_model_paths(monkeypatch: pytest.MonkeyPatch, starter: Path) -> None:
    """Show the real models' metadata, but under /models so the picture does not depend on the venv."""
    real = api.list_models

    def listed() -> list[Any]:
        return [dataclasses.replace(m, path=f"/models/{Path(m.path).name}") for m in real()]

    monkeypatch.setattr("tui.screens.library.api.list_models", listed)


def laid_out(table: Any) -> bool:
    """Whether a DataTable has sized its columns and rows for every row it holds (it does so when
    idle): its virtual size then covers the header and each row."""
    return bool(table.row_count) and table.virtual_size.height == table.row_count + (1 if table.show_header else 0)


async def library_loaded(pilot: Any) -> None:
    lib = pilot.app.mode_screens["library"]
    assert isinstance(lib, LibraryScreen)
    await wait_for(pilot, lambda: lib.loaded, "the library to load")
    table = lib.query_one("#models")
    # DataTable sizes its columns when idle; the picture must not catch it half-way.
    await wait_for(pilot, lambda: laid_out(table), "the table's column widths")
    await pilot.pause()


def saved_chat(app: Any) -> int:
    conv = app.conversations.create("smollm2:135m", "You answer briefly.", {"temperature": 0, "seed": 1})
    app.conversations.add_exchange(conv.id, "What is the opposite of hot?", REPLY,
                                   {"prompt_tokens": 40, "completion_tokens": 50})
    return int(conv.id)


def test_library(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=library_loaded)


def test_library_light_theme(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(make_app(theme="textual-light"), terminal_size=SIZE, run_before=library_loaded)


def test_delete_confirmation(snap_compare: Any, make_app: Any) -> None:
    async def before(pilot: Any) -> None:
        await library_loaded(pilot)
        await pilot.press("d")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ConfirmScreen", "the dialog")

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_help(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(make_app(), press=["f1"], terminal_size=SIZE, run_before=library_loaded)


async def open_saved_chat(pilot: Any) -> None:
    cid = saved_chat(pilot.app)
    await pilot.press("f4")
    chat = pilot.app.mode_screens["chat"]
    assert isinstance(chat, ChatScreen)
    await chat.open_conversation(cid)
    # The reply's Markdown blocks (code fence included) are mounted asynchronously.
    await wait_for(pilot, lambda: len(chat.query("MarkdownFence")) == 1, "the rendered reply")
    await pilot.pause()


def test_chat(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=open_saved_chat)


def test_chat_thinking(snap_compare: Any, make_app: Any) -> None:
    """A thinking model's replies: the thought folded above the first answer, opened above the second."""

    async def before(pilot: Any) -> None:
        store = pilot.app.conversations
        conv = store.create("smollm2:135m")
        store.add_exchange(conv.id, "What is the opposite of hot?", "The opposite of **hot** is *cold*.",
                           {"thinking_tokens": 41, "thinking_seconds": 3.24},
                           "Opposites of temperature words: hot and cold.")
        store.add_exchange(conv.id, "And of up?", "*Down*.", {"thinking_tokens": 1, "thinking_seconds": 0.4},
                           "Up goes with down.")
        await pilot.press("f4")
        chat = pilot.app.mode_screens["chat"]
        assert isinstance(chat, ChatScreen)
        await chat.open_conversation(conv.id)
        await wait_for(pilot, lambda: len(chat.query("ThinkingBlock")) == 2, "the thoughts")
        await pilot.press("ctrl+g")
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_chat_settings(snap_compare: Any, make_app: Any) -> None:
    async def before(pilot: Any) -> None:
        await open_saved_chat(pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "SettingsScreen", "the settings")

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_conversations(snap_compare: Any, make_app: Any) -> None:
    async def before(pilot: Any) -> None:
        await open_saved_chat(pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: type(pilot.app.screen).__name__ == "ConversationsScreen", "the list")

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def test_discover(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(make_app(), press=["f3"], terminal_size=SIZE, run_before=library_loaded)


def test_convert(snap_compare: Any, make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    for folder in ("tiny-llama", "qwen3-finetune"):
        (work / folder).mkdir(parents=True)
    monkeypatch.chdir(work)

    async def before(pilot: Any) -> None:
        await library_loaded(pilot)
        await pilot.press("f5")
        tree = pilot.app.screen.query_one("#convert-tree")
        await wait_for(pilot, lambda: len(tree.root.children) == 2, "the folder listing")
        for field in pilot.app.screen.query("Input"):
            field.cursor_blink = False  # a blinking cursor is in the picture or not depending on timing
        await pilot.pause()

    assert snap_compare(make_app(), terminal_size=SIZE, run_before=before)


def measured_ladder() -> Any:
    """A ladder as the core returns it, with fixed measurements (so no speeds that vary)."""
    from localrun.workbench.ladder import Ladder, Rung

    rows = [("q8_0", 145.0, 8.5, 12.91, 0.0016, 0.972, 3150, 118), ("q6_k", 112.0, 6.56, 12.96, 0.0052, 0.951, 3320, 131),
            ("q4_k_m", 85.0, 4.89, 13.42, 0.031, 0.893, 3600, 152), ("iq4_xs", 79.0, 4.46, 13.55, 0.044, 0.874, 3410, 149),
            ("q3_k_m", 70.0, 3.91, 14.61, 0.118, 0.81, 3050, 139), ("q2_k", 58.0, 3.26, 19.8, 0.52, 0.66, 2980, 141)]
    rungs = [Rung(t, f"/models/ladder/SmolLM2-{t.upper()}.gguf", int(mib * 2**20), bpw, t not in ("q8_0",), ppl, kld,
                  kld * 0.6, kld * 5, kld * 40, top, kld * 2, pp, tg, f"smollm2:{t}") for t, mib, bpw, ppl, kld, top, pp, tg
             in rows]
    return Ladder("/models/SmolLM2", "/models/ladder/SmolLM2-F16.gguf", 12.88, "/models/ladder/eval-text.txt", None,
                  None, 0.05, rungs)


def ladder_shown(tab: str) -> Any:
    async def before(pilot: Any) -> None:
        await library_loaded(pilot)
        await pilot.press("f5")
        screen = pilot.app.screen
        pilot.app.notify = lambda *args, **kwargs: None  # the toast would cover the picture
        for field in screen.query("Input"):
            field.cursor_blink = False  # a blinking cursor is in the picture or not depending on timing
        screen._ladder_done(measured_ladder())
        screen.query_one("#convert-tabs").active = tab
        table = screen.query_one("#ladder-table")
        await wait_for(pilot, lambda: table.row_count == 6 and laid_out(table), "the table")
        await pilot.pause()

    return before


def test_convert_ladder_table(snap_compare: Any, make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=ladder_shown("convert-rungs"))


def test_convert_ladder_plot(snap_compare: Any, make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert snap_compare(make_app(), terminal_size=SIZE, run_before=ladder_shown("convert-plot"))
