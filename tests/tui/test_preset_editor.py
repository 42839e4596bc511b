"""The Library's preset editor (`p`): a new preset from the starter model, bad lines refused with
the dialog kept open, and an existing preset edited in place. No model is loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from localrun import api
from localrun.presets import Preset
from tests.tui.helpers import wait_for
from tests.tui.test_flows import SIZE, library
from tui.screens.library import LibraryScreen
from tui.screens.preset_editor import PresetEditorScreen, parameters_text, parse_parameters

STARTER = "smollm2:135m"


async def open_editor(pilot: Any, model: str) -> PresetEditorScreen:
    """Highlight `model` in the Library and press `p`."""
    lib = library(pilot.app)
    await wait_for(pilot, lambda: lib.loaded and model in lib.row_names(), f"{model} in the library")
    lib.query_one("#models").move_cursor(row=lib.row_names().index(model))
    await pilot.press("p")
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, PresetEditorScreen), "the preset editor")
    screen = pilot.app.screen
    assert isinstance(screen, PresetEditorScreen)
    return screen


async def type_into(pilot: Any, selector: str, text: str) -> None:
    """Focus a field and type text into it, key by key (a newline is Enter)."""
    pilot.app.screen.query_one(selector).focus()
    await pilot.press(*["enter" if c == "\n" else c for c in text])


async def saved(pilot: Any, name: str) -> LibraryScreen:
    """Wait for the dialog to close and the Library to list `name`."""
    lib = library(pilot.app)
    await wait_for(pilot, lambda: pilot.app.screen is lib and name in lib.row_names(), f"{name} in the library")
    return lib


def presets() -> list[str]:
    return [m.name for m in api.list_models() if m.is_preset]


def test_new_preset_from_the_starter(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_new_preset_from_the_starter(make_app))


async def _test_new_preset_from_the_starter(make_app: Any) -> None:
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        editor = await open_editor(pilot, STARTER)
        assert editor.query_one("#preset-name").value == "smollm2-preset:latest"
        await type_into(pilot, "#preset-system", "Be terse.")
        await type_into(pilot, "#preset-parameters", "temperature 0\nnum_predict 4")
        await pilot.press("ctrl+s")
        lib = await saved(pilot, "smollm2-preset:latest")

        info = api.get_model("smollm2-preset:latest")
        assert info.is_preset and info.base == STARTER
        assert info.details["preset"] == {"base": STARTER, "parameters": {"temperature": 0.0, "num_predict": 4},
                                          "system": "Be terse."}
        assert ("information", "Saved preset smollm2-preset:latest") in app.notices
        # Listed as a preset of its base, highlighted, its settings in the details pane.
        table = lib.query_one("#models")
        assert lib.selected_name() == "smollm2-preset:latest"
        assert [str(c.label) for c in table.columns.values()][:2] == ["Name", "Kind"]
        assert table.get_row("smollm2-preset:latest")[:2] == ["smollm2-preset:latest", f"preset of {STARTER}"]
        assert table.get_row(STARTER)[1] == ""
        details = str(lib.query_one("#details-text").content)
        assert f"preset of {STARTER}" in details
        assert "parameters: temperature 0.0; num_predict 4" in details
        assert "system: Be terse." in details


def test_bad_lines_are_named_and_the_dialog_stays_open(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_bad_lines_are_named_and_the_dialog_stays_open(make_app))


async def _test_bad_lines_are_named_and_the_dialog_stays_open(make_app: Any) -> None:
    app = make_app()
    typed = "top_k x\nmirostat 1\nnonsense 3\ntemperature 0.5"
    async with app.run_test(size=SIZE) as pilot:
        editor = await open_editor(pilot, STARTER)
        await type_into(pilot, "#preset-system", "Be brief.")
        await type_into(pilot, "#preset-parameters", typed)
        editor.query_one("#preset-template").load_text("{% if %}")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: bool(editor.error), "the error")

        assert app.screen is editor
        lines = editor.error.splitlines()
        assert lines[0].startswith("parameters line 1 ('top_k x'): bad value 'x' for parameter 'top_k'")
        assert lines[1].startswith("parameters line 2 ('mirostat 1'): parameter 'mirostat' is not supported")
        assert lines[2].startswith("parameters line 3 ('nonsense 3'): unknown parameter 'nonsense'")
        assert "line 4" not in editor.error and "temperature, top_p, top_k" in editor.error  # the known names, once
        assert any(line.startswith("template: the TEMPLATE is not a valid Jinja template") for line in lines)
        assert str(editor.query_one("#preset-error").content) == editor.error
        # The user's text is intact.
        assert editor.query_one("#preset-parameters").text == typed
        assert editor.query_one("#preset-system").text == "Be brief."
        assert editor.query_one("#preset-template").text == "{% if %}"
        assert presets() == []

        await pilot.press("escape")
        lib = library(app)
        await wait_for(pilot, lambda: app.screen is lib, "the Library")
        assert presets() == [] and STARTER in lib.row_names()


def test_editing_a_preset_prefills_it_and_saves_changes(make_app: Any, starter: Path) -> None:
    asyncio.run(_test_editing_a_preset_prefills_it_and_saves_changes(make_app))


async def _test_editing_a_preset_prefills_it_and_saves_changes(make_app: Any) -> None:
    api.create_preset("terse", preset=Preset(STARTER, {"temperature": 0.2, "stop": ["User:", " Q:"]}, system="Be brief."))
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        editor = await open_editor(pilot, "terse:latest")
        assert editor.query_one("#preset-name").value == "terse:latest"
        assert editor.query_one("#preset-system").text == "Be brief."
        assert editor.query_one("#preset-parameters").text == 'temperature 0.2\nstop User:\nstop " Q:"'
        assert editor.query_one("#preset-template").text == ""

        await type_into(pilot, "#preset-system", "")  # focus: the cursor is at the start of the line
        await pilot.press("ctrl+k")
        await type_into(pilot, "#preset-system", "Say less.")
        editor.query_one("#preset-parameters").focus()
        await pilot.press("ctrl+k")
        await type_into(pilot, "#preset-parameters", "temperature 0.9")
        editor.query_one("#preset-template").load_text("{{ .System }} {{ .Prompt }}")  # Ollama's Go form
        await pilot.press("ctrl+s")
        await saved(pilot, "terse:latest")
        await wait_for(pilot, lambda: ("information", "Saved preset terse:latest") in app.notices, "the notice")

        preset = api.get_model("terse:latest").details["preset"]
        assert preset["base"] == STARTER and preset["system"] == "Say less."
        assert preset["parameters"] == {"temperature": 0.9, "stop": ["User:", " Q:"]}
        assert preset["template_source"] == "{{ .System }} {{ .Prompt }}" and "{%" in preset["template"]
        assert presets() == ["terse:latest"]

        # Opened again: the Go source as written, and a name taken by a model is refused.
        editor = await open_editor(pilot, "terse:latest")
        assert editor.query_one("#preset-template").text == "{{ .System }} {{ .Prompt }}"
        editor.query_one("#preset-name").value = STARTER
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: bool(editor.error), "the error")
        assert editor.error == f"name: a model named '{STARTER}' is already in the library; choose another name"
        assert app.screen is editor and presets() == ["terse:latest"]


def test_the_default_name_is_free_and_parameters_round_trip(starter: Path) -> None:
    from tui.screens.preset_editor import default_name

    model = api.get_model(STARTER)
    assert default_name(model, {STARTER}) == "smollm2-preset:latest"
    assert default_name(model, {"smollm2-preset:latest", "smollm2-preset-2:latest"}) == "smollm2-preset-3:latest"
    params = {"temperature": 0.2, "num_ctx": 2048, "stop": ["User:", "\nQ:", " x", '"quoted"']}
    text = parameters_text(params)
    assert parse_parameters(text) == (params, [], [])
    assert parse_parameters("PARAMETER top_k 5\n# a comment\n\nseed\ttwo\ntop_k 6")[1] == [
        "parameters line 4 ('seed\\ttwo'): bad value 'two' for parameter 'seed': expected an integer in [0, 2^32) (-1: a random seed)",
        "parameters line 5 ('top_k 6'): 'top_k' is already set on line 1 (only stop may repeat)",
    ]
