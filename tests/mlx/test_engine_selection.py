"""Which engine runs which model, what --engine says when it cannot, and what doctor reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.backends.mlx import MLXBackend
from localrun.errors import BackendUnavailableError
from localrun.store import ModelInfo, Store, detect_format

from .conftest import Models


def info(path: Path) -> ModelInfo:
    return Store(path.parent / ".store").get(str(path))


def test_formats_of_the_three_kinds(models: Models) -> None:
    assert detect_format(models.plain.gguf) == "gguf"
    assert detect_format(models.plain.hf) == "safetensors"
    # mlx-lm's converter marks its safetensors as format "mlx", quantized or not.
    assert detect_format(models.plain.mlx) == "mlx"


def test_each_format_goes_to_its_engine(models: Models) -> None:
    assert api.choose_engine(info(models.plain.gguf)) == "llama.cpp"
    assert api.choose_engine(info(models.plain.mlx)) == "mlx"
    assert api.choose_engine(info(models.plain.hf)) == "mlx"
    assert api.choose_engine(info(models.plain.hf), "mlx") == "mlx"


@pytest.mark.parametrize(("variant", "engine", "says", "hint"), [
    ("gguf", "mlx", "it is a GGUF file, which runs on llama.cpp", "--to mlx"),
    ("hf", "llama.cpp", "it is a Hugging Face safetensors folder, which runs on mlx", "convert it to GGUF"),
    ("mlx", "llama.cpp", "it is an MLX model folder, which runs on mlx", "drop --engine"),
])
def test_forced_engine_that_cannot_run_the_format_explains(models: Models, variant: str, engine: str, says: str,
                                                           hint: str) -> None:
    with pytest.raises(BackendUnavailableError) as e:
        api.choose_engine(info(getattr(models.plain, variant)), engine)
    assert says in e.value.message and hint in (e.value.hint or "")


def test_without_mlx_safetensors_points_to_gguf_conversion(models: Models, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(MLXBackend, "available", lambda self: False)
    hf = info(models.plain.hf)
    with pytest.raises(BackendUnavailableError) as e:
        api.choose_engine(hf)
    assert "safetensors folder and MLX is not installed" in e.value.message
    assert f"localrun convert {hf.path}" in (e.value.hint or "") and "localrun[mlx]" in (e.value.hint or "")
    with pytest.raises(BackendUnavailableError, match="MLX model folder and MLX is not installed") as e2:
        api.choose_engine(info(models.plain.mlx))
    assert "localrun[mlx]" in (e2.value.hint or "")
    with pytest.raises(BackendUnavailableError, match="the mlx engine is not installed"):
        api.choose_engine(hf, "mlx")
    assert api.choose_engine(info(models.plain.gguf)) == "llama.cpp"


def test_cli_runs_a_safetensors_folder_on_mlx(models: Models, cli: Any) -> None:
    gguf = cli("run", str(models.plain.gguf), "Once upon a time", "--raw", "-n", "12", "--temperature", "0")
    res = cli("run", str(models.plain.hf), "Once upon a time", "--raw", "-n", "12", "--temperature", "0", "--json")
    assert res.returncode == 0, res.stderr
    record = json.loads(res.stdout)
    assert record["completion_tokens"] == 12 and record["text"] + "\n" == gguf.stdout
    forced = cli("run", str(models.plain.mlx), "Once upon a time", "--raw", "-n", "12", "--temperature", "0",
                 "--engine", "mlx")
    assert forced.returncode == 0 and forced.stdout == gguf.stdout


@pytest.mark.parametrize(("variant", "engine", "says"), [
    ("gguf", "mlx", "the mlx engine cannot run"),
    ("hf", "llama.cpp", "convert it to GGUF with 'localrun convert"),
])
def test_cli_forced_engine_errors(models: Models, cli: Any, variant: str, engine: str, says: str) -> None:
    res = cli("run", str(getattr(models.plain, variant)), "hi", "--engine", engine)
    assert res.returncode == 1 and res.stdout == ""
    assert says in res.stderr and "Traceback" not in res.stderr


def test_doctor_reports_mlx_and_its_device(cli: Any) -> None:
    from importlib.metadata import version

    res = cli("doctor", "--json")
    assert res.returncode == 0, res.stderr
    mlx = json.loads(res.stdout)["engines"]["mlx"]
    assert mlx["available"] is True and mlx["mlx"] == version("mlx")
    assert mlx["device"].startswith("Metal GPU" if sys.platform == "darwin" else ("CPU", "CUDA GPU"))
    text = cli("doctor").stdout
    assert f"device      {mlx['device']}" in text


def test_store_lists_mlx_models_beside_gguf(models: Models, cli: Any) -> None:
    assert cli("add", str(models.plain.mlx), "--name", "stories:mlx").returncode == 0
    assert cli("add", str(models.plain.gguf), "--name", "stories:f32").returncode == 0
    listed = {m["name"]: m for m in json.loads(cli("list", "--json").stdout)}
    assert listed["stories:mlx"]["format"] == "mlx" and listed["stories:f32"]["format"] == "gguf"
    assert listed["stories:mlx"]["architecture"] == "LlamaForCausalLM"
    assert listed["stories:mlx"]["parameters"] == listed["stories:f32"]["parameters"]
    res = cli("run", "stories:mlx", "Once upon a time", "--raw", "-n", "5", "--temperature", "0")
    assert res.returncode == 0 and res.stdout.startswith(", there")
