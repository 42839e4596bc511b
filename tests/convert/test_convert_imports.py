"""`convert` stands alone: it never imports localrun or tui, nor an engine at import time."""

from __future__ import annotations

import subprocess
import sys

from convert_helpers import ROOT


def test_convert_imports_no_localrun_tui_or_engines() -> None:
    code = (
        "import sys, convert, convert.archs; convert.supported_architectures(); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'localrun', 'tui', 'torch', 'llama_cpp', 'transformers', 'textual', 'mlx'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_convert_sources_never_mention_localrun() -> None:
    for path in (ROOT / "convert").rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert "import localrun" not in text and "from localrun" not in text, path
        assert "from tui" not in text and "import tui" not in text, path
