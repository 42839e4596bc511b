"""Mistral's native layout (params.json + consolidated.safetensors + tekken.json) is refused with
the Hugging Face layout to use, before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from convert_helpers import need_asset
from safetensors.numpy import save_file
from test_convert_cli import run

from convert.errors import ConvertError
from convert.source import check_native_layout

PARAMS = {
    "dim": 64,
    "n_layers": 1,
    "head_dim": 16,
    "hidden_dim": 128,
    "n_heads": 4,
    "n_kv_heads": 2,
    "norm_eps": 1e-05,
    "vocab_size": 32,
    "rope_theta": 1000000.0,
}


def _native(folder: Path, tokenizer: str) -> Path:
    """A folder as Mistral publishes it: params.json, consolidated.safetensors and its tokenizer."""
    folder.mkdir(parents=True)
    (folder / "params.json").write_text(json.dumps(PARAMS))
    rng = np.random.default_rng(0)
    save_file(
        {
            "tok_embeddings.weight": rng.standard_normal((32, 64), dtype=np.float32),
            "layers.0.attention.wq.weight": rng.standard_normal((64, 64), dtype=np.float32),
            "norm.weight": np.ones(64, dtype=np.float32),
        },
        str(folder / "consolidated.safetensors"),
    )
    if tokenizer == "tekken.json":
        (folder / "tekken.json").write_text(json.dumps({"config": {"pattern": ""}, "vocab": []}))
    else:
        (folder / tokenizer).write_bytes(
            need_asset("tokenizers", "llama2-spm", "tokenizer.model").read_bytes()
        )
    return folder


@pytest.mark.parametrize("tokenizer", ["tekken.json", "tokenizer.model.v3"])
def test_native_layout_is_refused_on_one_line(tokenizer: str, tmp_path: Path) -> None:
    folder = _native(tmp_path / "Devstral-Small-2505", tokenizer)
    out = tmp_path / "out"
    out.mkdir()
    p = run("convert", str(folder), "-o", str(out / "m.gguf"), "--outtype", "f16", home=tmp_path / "h")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"localrun: {folder} is in Mistral's native layout (params.json, consolidated.safetensors, {tokenizer})")
    assert "mistral-community/Devstral-Small-2505" in lines[0] and "config.json" in lines[0]
    assert list(out.iterdir()) == [] and sorted(f.name for f in folder.iterdir()) == sorted(
        ["params.json", "consolidated.safetensors", tokenizer]
    )
    # the default output (inside the folder) is not written either
    assert run("convert", str(folder), home=tmp_path / "h").returncode == 1
    assert not [f for f in folder.iterdir() if f.suffix == ".gguf"]


def test_the_library_refuses_it_too(tmp_path: Path) -> None:
    """convert.convert (the TUI, the ladder, scripts) says the same, before writing anything."""
    import convert

    folder = _native(tmp_path / "Ministral-8B", "tekken.json")
    with pytest.raises(ConvertError, match="Mistral's native layout"):
        convert.convert(folder, tmp_path / "m.gguf", outtype="f16")
    assert not (tmp_path / "m.gguf").exists()


def test_hugging_face_cache_snapshot_names_its_repository(tmp_path: Path) -> None:
    snap = tmp_path / "models--mistralai--Magistral-Small-2506" / "snapshots" / "0123abcd"
    _native(snap, "tekken.json")
    with pytest.raises(ConvertError, match="Mistral's native layout") as e:
        check_native_layout(snap)
    assert "layout of mistralai/Magistral-Small-2506 instead" in (e.value.hint or "")
    assert "mistral-community/Magistral-Small-2506" in (e.value.hint or "")


def test_hugging_face_files_beside_native_ones_are_converted_as_usual(tmp_path: Path) -> None:
    """Many Mistral repositories carry both layouts: config.json decides."""
    folder = _native(tmp_path / "both", "tokenizer.model.v3")
    (folder / "config.json").write_text("{}")
    check_native_layout(folder)  # no error: the Hugging Face files are there


def test_meta_original_layout_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "Llama-2-7b"
    folder.mkdir()
    (folder / "params.json").write_text(json.dumps(PARAMS))
    (folder / "consolidated.00.pth").write_bytes(b"")
    with pytest.raises(ConvertError, match="Meta's original Llama layout") as e:
        check_native_layout(folder)
    assert "meta-llama/Llama-2-7b-hf" in (e.value.hint or "")
