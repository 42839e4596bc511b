"""`import localrun` must stay light: engines and UI load lazily."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("llama_cpp", "mlx", "mlx_lm", "torch", "transformers", "textual", "numpy", "gguf", "huggingface_hub",
         "fastapi", "uvicorn", "starlette")


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    return {name.split(".")[0] for name in out}


def test_import_localrun_loads_no_engine_or_ui() -> None:
    loaded = _loaded_after("import localrun, localrun.api, localrun.store, localrun.chat, localrun.generation")
    assert not loaded & set(HEAVY), f"heavy modules loaded: {sorted(loaded & set(HEAVY))}"


def test_cli_help_loads_no_engine() -> None:
    loaded = _loaded_after("from localrun.cli import build_parser\nbuild_parser().format_help()")
    assert not loaded & set(HEAVY), f"heavy modules loaded: {sorted(loaded & set(HEAVY))}"


def test_convert_does_not_import_localrun() -> None:
    loaded = _loaded_after("import convert")
    assert "localrun" not in loaded and "tui" not in loaded
