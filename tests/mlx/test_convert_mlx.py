"""`localrun convert SRC --to mlx`: mlx-lm's converter, with and without quantization, registered."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from localrun import api
from localrun.backends.mlx_convert import convert_to_mlx
from localrun.errors import ConversionError, UsageError
from localrun.generation import Request
from localrun.settings import GenerationParams
from localrun.store import Store

from .conftest import Models, collect

PROMPT = "Once upon a time"


def dtypes(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype, from the headers of the folder's weight files."""
    out: dict[str, str] = {}
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        out.update({k: v["dtype"] for k, v in header.items() if k != "__metadata__"})
    return out


def greedy(name_or_info: Any, n: int = 20) -> str:
    session = api.load(name_or_info)
    try:
        return collect(session, Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=n))[0]
    finally:
        session.close()


@pytest.fixture(scope="module")
def expected(models: Models) -> str:
    """Greedy text of the source checkpoint (MLX on the unconverted Hugging Face folder)."""
    return greedy(Store(models.plain.hf.parent / ".store").get(str(models.plain.hf)))


def test_cli_convert_keeps_precision_and_registers(models: Models, cli: Any, isolated_home: Path,
                                                   expected: str) -> None:
    res = cli("convert", str(models.plain.hf), "--to", "mlx")
    assert res.returncode == 0, res.stderr
    out = Path(res.stdout.strip())
    assert out.parent == isolated_home / "models" and "registered as stories-hf:mlx" in res.stderr
    assert "[INFO]" in res.stderr  # mlx-lm's chatter goes to stderr, stdout carries only the path
    assert set(dtypes(out).values()) == {"F32"}  # the checkpoint is F32; no --q-bits keeps it
    listed = {m["name"]: m for m in json.loads(cli("list", "--json").stdout)}
    assert listed["stories-hf:mlx"]["format"] == "mlx" and listed["stories-hf:mlx"]["path"] == str(out)
    assert greedy("stories-hf:mlx") == expected
    # The store owns the folder: rm deletes it.
    assert cli("rm", "stories-hf:mlx").returncode == 0 and not out.exists()


def test_cli_convert_quantized_to_a_chosen_folder(models: Models, cli: Any, tmp_path: Path, expected: str) -> None:
    out = tmp_path / "q8"
    res = cli("convert", str(models.plain.hf), "--to", "mlx", "--q-bits", "8", "--q-group-size", "32", "-o", str(out),
              "--name", "stories:q8")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 8 and cfg["quantization"]["group_size"] == 32
    types = dtypes(out)
    assert types["model.layers.0.self_attn.q_proj.weight"] == "U32"  # packed 8-bit values
    # Scales in 16 bits: an F32 checkpoint would otherwise keep F32 scales.
    assert types["model.layers.0.self_attn.q_proj.scales"] == "F16"
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size < 0.5 * sum(f.stat().st_size for f in models.plain.mlx.glob("*.safetensors"))
    info = api.get_model("stories:q8")
    assert info.format == "mlx" and info.quantization == "8bit" and info.source == "added"
    # 8 bits in groups of 32 keep this model's greedy text for a while.
    start = greedy("stories:q8", 8)
    assert len(start) > 20 and expected.startswith(start)
    assert cli("rm", "stories:q8").returncode == 0 and out.exists()  # added, not owned: kept


def test_convert_4bit_default_group_size(models: Models) -> None:
    info = convert_to_mlx(models.plain.hf, q_bits=4)
    assert info.name == "stories-hf:mlx-q4" and info.format == "mlx" and info.quantization == "4bit"
    cfg = json.loads((Path(info.path) / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["group_size"] == 64
    session = api.load(info)
    try:
        text, last, _ = collect(session, Request.raw(PROMPT), GenerationParams(temperature=0, max_tokens=10))
    finally:
        session.close()
    assert last.completion_tokens == 10 and text


def test_convert_from_gguf_through_transformers(models: Models, expected: str) -> None:
    messages: list[str] = []
    info = convert_to_mlx(models.plain.gguf, progress=messages.append)
    assert info.name == "stories:mlx" and info.format == "mlx"
    assert any("GGUF" in m for m in messages)
    assert greedy(info) == expected


def test_refusals_leave_nothing_behind(models: Models, tmp_path: Path, isolated_home: Path) -> None:
    with pytest.raises(UsageError, match="--q-bits"):
        convert_to_mlx(models.plain.hf, q_bits=7)
    with pytest.raises(UsageError, match="--q-group-size"):
        convert_to_mlx(models.plain.hf, q_bits=4, q_group_size=48)
    work = tmp_path / "work"
    taken = work / "taken"
    taken.mkdir(parents=True)
    with pytest.raises(UsageError, match="already exists"):
        convert_to_mlx(models.plain.hf, out=taken)
    first = convert_to_mlx(models.plain.hf, q_bits=8, name="s:q8")
    with pytest.raises(UsageError, match="already installed"):
        convert_to_mlx(models.plain.hf, name="s:q8")
    with pytest.raises(UsageError, match="already in MLX format"):
        convert_to_mlx("s:q8", q_bits=4)
    assert sorted(p.name for p in work.iterdir()) == ["taken"]
    assert sorted(p.name for p in (isolated_home / "models").iterdir()) == [Path(first.path).name]


def test_failed_conversion_cleans_up(models: Models, tmp_path: Path, isolated_home: Path) -> None:
    import shutil

    work = tmp_path / "work"
    broken = work / "broken-hf"
    shutil.copytree(models.plain.hf, broken)
    cfg = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**cfg, "model_type": "no_such_arch"}))
    out = work / "out"
    with pytest.raises(ConversionError, match="no_such_arch") as e:
        convert_to_mlx(broken, out=out)
    assert e.value.hint
    assert sorted(p.name for p in work.iterdir()) == ["broken-hf"]
    assert api.list_models() == [m for m in api.list_models() if m.format != "mlx"]


def test_cli_flag_mixups_are_usage_errors(models: Models, cli: Any) -> None:
    res = cli("convert", str(models.plain.hf), "--q-bits", "4", "--to", "gguf")
    assert res.returncode == 2 and "--q-bits is for MLX output" in res.stderr
    res = cli("convert", str(models.plain.hf), "--to", "mlx", "--outtype", "q8_0")
    assert res.returncode == 2 and "for GGUF output" in res.stderr
    res = cli("convert", str(models.plain.hf), "--to", "mlx", "--q-bits", "3")
    assert res.returncode == 2 and "invalid choice" in res.stderr
