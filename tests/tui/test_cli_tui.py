"""`localrun tui [MODEL]` takes the generation flags of `run`; `localrun` alone opens the TUI."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from localrun.cli import build_parser
from localrun.cli.tui import app_from_args, cmd_tui
from localrun.errors import UsageError
from tests.tui.helpers import wait_for


def test_no_command_defaults_to_the_tui() -> None:
    args = build_parser().parse_args([])
    assert getattr(args, "func", None) is None
    assert args.default_func.__module__ == "localrun.cli.tui"


def test_generation_flags_become_the_defaults_of_new_chats(starter: Path) -> None:
    args = build_parser().parse_args(["tui", "smollm2:135m", "--temperature", "0", "--seed", "1", "--top-k", "5",
                                      "--max-tokens", "7", "--system", "Be brief.", "--ctx", "512"])
    app = app_from_args(args)

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: "chat" in app.mode_screens and app.mode_screens["chat"].conversation,
                           "the chat opened from the command line")
            conv = app.mode_screens["chat"].conversation
            assert conv.model == "smollm2:135m" and conv.system == "Be brief."
            assert conv.settings == {"temperature": 0.0, "seed": 1, "top_k": 5, "max_tokens": 7}
            assert app.models.options.n_ctx == 512

    try:
        asyncio.run(run())
    finally:
        app.models.close()


def test_bad_flag_values_fail_before_the_ui_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # the flag is refused as it is parsed, by the settings table's check
        cmd_tui(build_parser().parse_args(["tui", "--temperature", "-1"]))
    assert e.value.code == 2 and "argument --temperature: expected a number >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--draft-min"):  # values that only fail together: before the UI too
        cmd_tui(build_parser().parse_args(["tui", "--draft-min", "9", "--draft-max", "4"]))


def test_unknown_model_is_a_notification(make_app: Any) -> None:
    app = make_app(model="no-such-model:1b")

    async def run() -> None:
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_for(pilot, lambda: any(sev == "error" for sev, _ in app.notices), "the error")
            assert "no-such-model:1b" in app.notices[-1][1] and "not installed" in app.notices[-1][1]
            assert type(app.screen).__name__ == "LibraryScreen"  # still usable

    asyncio.run(run())
