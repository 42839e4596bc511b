"""The Convert screen's ladder on the real stories260K model: rungs built, measured, registered,
tabulated and plotted; a bad type shows the error and the app keeps running."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.tui.helpers import wait_for
from tui.screens.convert import ConvertScreen
from tui.screens.library import LibraryScreen
from tui.widgets.ladder import MARK

pytestmark = pytest.mark.slow


def small_settings(tmp_path: Path) -> dict[str, Any]:
    """Ladder options that keep a run short: a short context, two chunks, a tiny benchmark."""
    text = tmp_path / "eval.txt"
    text.write_text((Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    return dict(out_dir=tmp_path / "ladder", n_ctx=64, chunks=2, bench=(16, 4, 1), imatrix=None, text=str(text),
                threads=2)


async def open_convert(pilot: Any, src: Path | None, types: str, options: dict[str, Any]) -> ConvertScreen:
    await pilot.press("f5")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ConvertScreen), "the convert screen")
    screen = pilot.app.screen
    assert isinstance(screen, ConvertScreen)
    screen.ladder_options = options
    if src is not None:
        screen.query_one("#convert-src").value = str(src)
    screen.query_one("#convert-ladder").value = types
    screen.query_one("#convert-name").value = "stories"
    return screen


def status_of(screen: ConvertScreen) -> str:
    return str(screen.query_one("#convert-status").render())


def test_ladder_tabulates_plots_and_registers(make_app: Any, stories: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(stories, models / stories.name)
    (models / "notes.txt").write_text("not a source")
    monkeypatch.chdir(models)  # the file tree shows the working folder
    # A budget every rung meets: the smallest, q4_0, is the recommendation whatever the KLDs.
    options = {**small_settings(tmp_path), "budget": 10.0}
    asyncio.run(_ladder_flow(make_app, models / stories.name, options))
    from localrun import api

    for t in ("q8_0", "q4_0"):
        assert api.get_model(f"stories:{t}").quantization == t.upper()
    assert (tmp_path / "ladder" / "report.md").is_file() and not list(models.glob("*-ladder"))


async def _ladder_flow(make_app: Any, source: Path, options: dict[str, Any]) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_convert(pilot, None, "q8_0, Q4_0", options)
        tree = screen.query_one("#convert-tree")
        await wait_for(pilot, lambda: len(tree.root.children) > 0, "the file listing")
        assert [str(n.label) for n in tree.root.children] == [source.name]  # folders and GGUF files only
        tree.select_node(tree.root.children[0])
        src = screen.query_one("#convert-src")
        await wait_for(pilot, lambda: src.value == str(source.resolve()), "the selected file as the source")
        select = screen.query_one("#convert-type")
        await wait_for(pilot, lambda: select.disabled, "the type select disabled (each rung has its own)")
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: not screen.running, "the ladder to finish")
        assert status_of(screen).startswith("Ladder done: q4_0 is recommended"), status_of(screen)

        table = screen.query_one("#ladder-table")
        await wait_for(pilot, lambda: table.row_count == 2, "two rows in the table")
        types = [str(table.get_row_at(i)[0]) for i in range(2)]
        assert types == ["  q8_0", f"{MARK} q4_0"]
        q8, q4 = screen.ladder.rungs
        assert q8.size > q4.size and q8.kld_mean < q4.kld_mean  # what the plot has to show
        tabs = screen.query_one("#convert-tabs")
        assert tabs.active == "convert-rungs"

        tabs.active = "convert-plot"
        plot = screen.query_one("#ladder-plot")
        await wait_for(pilot, lambda: any("q4_0" in line for line in plot.drawn), "the plot")
        lines = plot.drawn
        (r8, line8), = [(i, s) for i, s in enumerate(lines) if "q8_0" in s]
        (r4, line4), = [(i, s) for i, s in enumerate(lines) if "q4_0" in s]
        assert MARK in line4 and MARK not in line8
        assert line8.index("q8_0") > line4.index("q4_0")  # the bigger file to the right
        assert r8 > r4  # the lower KLD further down
        assert plot.size.height <= 24 and len(lines) == plot.size.height

        await pilot.press("f2")
        lib = pilot.app.mode_screens["library"]
        assert isinstance(lib, LibraryScreen)
        await wait_for(pilot, lambda: {"stories:q8_0", "stories:q4_0"} <= set(lib.row_names()),
                       "the rungs in the library")


def test_ladder_bad_type_shows_the_error(make_app: Any, stories: Path, tmp_path: Path) -> None:
    asyncio.run(_bad_type_flow(make_app, stories, small_settings(tmp_path)))


async def _bad_type_flow(make_app: Any, stories: Path, options: dict[str, Any]) -> None:
    app = make_app()
    async with app.run_test(size=(80, 24)) as pilot:
        screen = await open_convert(pilot, stories, "q9_9", options)
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: not screen.running, "the ladder to fail")
        assert status_of(screen).startswith("Failed: unknown output type 'q9_9'"), status_of(screen)
        assert any(sev == "error" and "q9_9" in msg for sev, msg in app.notices), app.notices
        tabs = screen.query_one("#convert-tabs")
        assert tabs.get_tab("convert-rungs").disabled and screen.ladder is None
        # The app keeps running: the next ladder starts.
        screen.query_one("#convert-ladder").value = "q8_0"
        await pilot.press("ctrl+g")
        await wait_for(pilot, lambda: not screen.running, "the second ladder")
        assert status_of(screen).startswith("Ladder done"), status_of(screen)
