"""An mlx-community style repository pulled from a local Hub runs on the MLX engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from localrun import api
from localrun.generation import Request
from localrun.settings import GenerationParams
from localrun.store import Store

from ..hub.server import HubServer
from .conftest import Models, collect, mlx_lm_convert

REPO = "mlx-community/stories260K-4bit"


@pytest.fixture(scope="module")
def mlx_4bit(models: Models, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # What mlx-community publishes: mlx-lm's converter, 4-bit, 16-bit scales.
    return mlx_lm_convert(models.plain.hf, tmp_path_factory.mktemp("hub-mlx") / "stories-4bit",
                          quantize=True, q_bits=4, q_group_size=32, dtype="float16")


@pytest.fixture
def hub(mlx_4bit: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    import huggingface_hub.constants as constants

    with HubServer() as server:
        server.add_repo(REPO, {p.name: p for p in mlx_4bit.iterdir() if p.is_file()},
                        tags=["mlx", "safetensors"], library_name="mlx")
        for key, value in server.env().items():
            if key != "HOME":
                monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        yield server


def test_pulled_mlx_repository_runs_on_mlx(hub: HubServer, mlx_4bit: Path) -> None:
    pulled = api.pull(REPO)
    model = pulled.model
    assert model.format == "mlx" and model.quantization == "4bit"
    assert api.choose_engine(model) == "mlx"
    params = GenerationParams(temperature=0, max_tokens=12)
    session = api.load(model.name)
    try:
        text, last, _ = collect(session, Request.raw("Once upon a time"), params)
    finally:
        session.close()
    direct = api.load(Store(mlx_4bit.parent / ".store").get(str(mlx_4bit)))
    try:
        assert collect(direct, Request.raw("Once upon a time"), params)[0] == text
    finally:
        direct.close()
    assert last.completion_tokens == 12 and text
