"""The real coding agents, installed by `make agents` from npm (Codex CLI, Claude Code): where they
are, and Codex's own apply_patch, which the Codex binary runs when it is called by that name."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO, skip_or_fail

BIN = REPO / ".agents" / "node_modules" / ".bin"


def agent_or_fail(name: str) -> Path:
    """An agent's command (codex, claude): $LOCALRUN_<NAME> or the one `make agents` installed."""
    path = Path(os.environ.get(f"LOCALRUN_{name.upper()}") or BIN / name)
    if not path.exists():
        skip_or_fail(f"{name} is not installed at {path}: run 'make agents' (npm, Node.js 20)")
    return path


def codex_native() -> Path:
    """The Codex binary itself (the npm package's launcher runs it)."""
    agent_or_fail("codex")
    found = sorted((REPO / ".agents" / "node_modules" / "@openai").glob("codex-*/vendor/*/bin/codex"))
    if not found:
        skip_or_fail("the Codex package has no binary for this platform")
    return found[0]


def apply_patch(patch: str, repo: Path) -> subprocess.CompletedProcess[str]:
    """Codex's own apply_patch on `repo`: its parser and applier, as Codex runs them for a call."""
    tool = repo.parent / "apply_patch"
    if not tool.exists():
        tool.symlink_to(codex_native())
    return subprocess.run([str(tool), patch], cwd=repo, capture_output=True, text=True, timeout=60)
