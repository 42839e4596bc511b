"""A local Hub per test, selected with HF_ENDPOINT; the test files are built once per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import STORIES, assets_or_skip
from .repos import build_files, populate
from .server import HubServer


@pytest.fixture(scope="session")
def hub_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    return build_files(assets_or_skip(STORIES), tmp_path_factory.mktemp("hub-files"))


@pytest.fixture
def hub(hub_files: dict[str, dict[str, Path]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """The local Hub, online: HF_ENDPOINT points at it, offline mode off, no stored token."""
    import huggingface_hub.constants as constants

    with HubServer() as server:
        populate(server, hub_files)
        for key, value in server.env().items():
            if key != "HOME":
                monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token stored on this machine
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        yield server
