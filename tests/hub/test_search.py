"""Search, file listings with quantizations, quantization choice, the fit estimate."""

from __future__ import annotations

import json

import pytest

from localrun import api
from localrun.errors import HubError, UsageError
from localrun.hub import detect_quant

from .repos import HUGE_REPO, NOQ4_REPO, QUANT_REPO, SPLIT_REPO, ST_REPO
from .server import HubServer


def test_search_cli_table_json_and_filters(hub: HubServer, cli) -> None:
    res = cli("search", "stories")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["REPOSITORY", "FORMATS", "DOWNLOADS", "LIKES", "UPDATED"]
    assert lines[1].split()[:5] == [QUANT_REPO, "gguf", "5.0K", "40", "2025-03-01"]  # most downloaded first
    assert lines[2].split()[:2] == [ST_REPO, "safetensors"]
    assert any("(gated)" in line for line in lines)

    res = cli("search", "stories", "--format", "gguf", "--sort", "likes", "--limit", "2", "--json")
    assert res.returncode == 0, res.stderr
    found = json.loads(res.stdout)
    assert [r["id"] for r in found] == [QUANT_REPO, SPLIT_REPO]
    assert all("gguf" in r["formats"] for r in found)
    # --sort likes orders otherwise than downloads: the safetensors repo has the most likes, fewer downloads.
    res = cli("search", "stories", "--sort", "likes", "--limit", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert [(r["id"], r["likes"]) for r in json.loads(res.stdout)] == [(ST_REPO, 70), (QUANT_REPO, 40)]
    assert len(hub.requests("/api/models", "GET")) == 3  # each search is one Hub query

    res = cli("search", "stories", "--format", "onnx")
    assert res.returncode == 2 and "invalid choice" in res.stderr


def test_search_offline_says_so(hub: HubServer, cli) -> None:
    res = cli("search", "stories", env={"HF_HUB_OFFLINE": "1"})
    assert res.returncode == 1
    assert "HF_HUB_OFFLINE" in res.stderr and res.stdout == ""
    assert hub.requests("/api/models") == []


def test_files_listing_shows_quantizations_and_default(hub: HubServer, cli) -> None:
    listing = api.list_repo_files(QUANT_REPO)
    quants = {f.path: f.quant for f in listing.files if f.path.endswith(".gguf")}
    assert quants == {f"stories-260k-{q}.gguf": q for q in ("Q2_K", "Q4_0", "Q4_K_M", "Q5_K_M", "Q8_0", "F16")}
    assert listing.default == ("stories-260k-Q4_K_M.gguf",)
    assert all(f.sha256 for f in listing.files if f.path.endswith(".gguf"))

    res = cli("search", "--files", SPLIT_REPO)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line.split()[1:] for line in res.stdout.splitlines()[1:]}
    assert rows["Q8_0/stories-Q8_0-00001-of-00002.gguf"][2] == "Q8_0"
    assert rows["Q8_0/stories-Q8_0-00002-of-00002.gguf"][2] == "Q8_0"
    assert rows["stories-Q4_0.gguf"][-1] == "*"  # Q4_0 (4-bit) beats the 8-bit split by default


@pytest.mark.parametrize("name, quant", [
    ("Qwen3-0.6B-Q4_K_M.gguf", "Q4_K_M"),
    ("qwen2.5-0.5b-instruct-q8_0.gguf", "Q8_0"),
    ("Llama-3.2-1B-Instruct-IQ4_XS.gguf", "IQ4_XS"),
    ("gemma-3-27b-it-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
    ("BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "BF16"),
    ("Q4_K_M/model-00002-of-00003.gguf", "Q4_K_M"),
    ("SmolLM2-135M.f16.gguf", "F16"),
    ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
    ("mmproj-model.gguf", None),
])
def test_quantization_from_file_names(name: str, quant: str | None) -> None:
    assert detect_quant(name) == quant


def test_quant_selection(hub: HubServer) -> None:
    from localrun.hub import plan

    assert [f.path for f in plan(QUANT_REPO).files] == ["stories-260k-Q4_K_M.gguf"]
    assert plan(f"{QUANT_REPO}:q8_0").quant == "Q8_0"  # case-insensitive
    assert plan(f"hf.co/{QUANT_REPO}:F16").name == "stories-260k:f16"
    assert [f.path for f in plan(f"{QUANT_REPO}:stories-260k-Q2_K.gguf").files] == ["stories-260k-Q2_K.gguf"]
    # No 4-bit file: the closest above 4 bits, not the 2-bit one.
    assert plan(NOQ4_REPO).quant == "Q5_K_M"
    split = plan(f"{SPLIT_REPO}:Q8_0")
    assert [f.path for f in split.files] == ["Q8_0/stories-Q8_0-00001-of-00002.gguf",
                                             "Q8_0/stories-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(HubError, match=r"has no Q3_K_S file; available: Q4_K_M, Q4_0, .*Q2_K"):
        plan(f"{QUANT_REPO}:Q3_K_S")
    with pytest.raises(UsageError, match="selects GGUF files only"):
        plan(f"{ST_REPO}:Q4_K_M")


def test_check_estimates_from_remote_header_without_downloading(hub: HubServer, cli, tmp_path) -> None:
    res = cli("pull", "--check", QUANT_REPO, "--json")
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout)
    # stories260K: 5 layers, 4 KV heads of 8 dims, 2048 context, f16 K and V.
    assert est["kv_cache_bytes"] == 5 * 2048 * 4 * (8 + 8) * 2
    assert est["architecture"] == "llama" and est["verdict"] in ("ram", "gpu")
    lfs = hub.requests("/lfs/")
    assert lfs and all(r.range and r.range.startswith("bytes=0-") for r in lfs)
    assert not (tmp_path / "hf-cache").exists() or not list((tmp_path / "hf-cache").rglob("*.gguf"))

    res = cli("pull", "--check", HUGE_REPO)
    assert res.returncode == 3, res.stderr
    assert "does not fit" in res.stdout


def test_check_safetensors_from_config(hub: HubServer) -> None:
    est = api.estimate_fit(ST_REPO, context=1024)
    assert est.kv_cache_bytes == 5 * 1024 * 4 * (8 + 8) * 2
    assert est.weights_bytes == sum(f.size for f in api.list_repo_files(ST_REPO).files
                                    if f.path == "model.safetensors")
