"""The model store: add, list, show, rm; discovery; concurrent writers."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest

from localrun.errors import BadModelFileError, ModelNotFoundError, StoreError, UsageError
from localrun.store import STARTER_NAME, Store, name_from_filename


def test_starter_model_appears_without_any_command(starter: Path) -> None:
    names = Store().names()
    assert STARTER_NAME in names
    info = Store().get("smollm2:135m")
    assert info.path == str(starter) and info.source == "starter"
    assert Store().get("smollm2").name == STARTER_NAME  # family alone when it has one tag


def test_add_list_show_rm(stories: Path, isolated_home: Path) -> None:
    store = Store()
    info = store.add(stories, name="stories:260k")
    assert info.name == "stories:260k" and info.parameters == 292800 and info.context_length == 2048
    listed = {m.name: m for m in store.list()}
    assert listed["stories:260k"].path == os.path.abspath(stories)
    assert json.loads((isolated_home / "registry.json").read_text())["models"]["stories:260k"]["path"] == os.path.abspath(stories)
    removed = store.remove("stories:260k")
    assert removed.name == "stories:260k"
    assert stories.exists(), "a model added in place must keep its file"
    with pytest.raises(ModelNotFoundError):
        store.get("stories:260k")


def test_default_names() -> None:
    assert name_from_filename("SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct:q4_1"
    assert name_from_filename("Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "qwen2.5-0.5b-instruct:q4_k_m"
    assert name_from_filename("model-IQ4_XS-00001-of-00003.gguf") == "model:iq4_xs"
    assert name_from_filename("stories260K.gguf") == "stories260k:latest"


def test_name_conflicts_and_invalid_names(stories: Path, tmp_path: Path) -> None:
    store = Store()
    store.add(stories, name="a:1")
    other = tmp_path / "copy.gguf"
    shutil.copy(stories, other)
    with pytest.raises(UsageError, match="already installed"):
        store.add(other, name="a:1")
    store.add(other, name="a:1", replace=True)
    assert store.get("a:1").path == os.path.abspath(other)
    with pytest.raises(UsageError, match="not a valid model name"):
        store.add(other, name="Bad Name!")


def test_add_refuses_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 40)
    with pytest.raises(BadModelFileError):
        Store().add(bad)
    assert "bad:latest" not in Store().names()


def test_unknown_model_suggests_near_matches(stories: Path) -> None:
    Store().add(stories, name="stories:260k")
    with pytest.raises(ModelNotFoundError) as e:
        Store().get("storys:260k")
    assert "stories:260k" in str(e.value)
    with pytest.raises(ModelNotFoundError) as e:
        Store().get("zzzz-qqqq")
    assert "localrun list" in str(e.value)


def test_path_is_accepted_as_model(stories: Path) -> None:
    info = Store().get(str(stories))
    assert info.source == "path" and info.architecture == "llama"


def test_hf_cache_ggufs_are_discovered(stories: Path, tmp_path: Path) -> None:
    repo = tmp_path / "hf-cache" / "models--someone--Tiny-Stories-GGUF"
    blob = repo / "blobs" / "abc123"
    blob.parent.mkdir(parents=True)
    shutil.copy(stories, blob)
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (snap / "tiny-stories.Q8_0.gguf").symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    store = Store()
    info = store.get("tiny-stories:q8_0")
    assert info.source == "hf-cache" and info.parameters == 292800
    store.remove("tiny-stories:q8_0")
    assert not blob.exists() and "tiny-stories:q8_0" not in store.names()


def test_rm_starter_hides_it_and_add_brings_it_back(starter: Path) -> None:
    store = Store()
    store.remove(STARTER_NAME)
    assert STARTER_NAME not in store.names()
    assert starter.exists()
    store.add(starter, name=STARTER_NAME)
    assert STARTER_NAME in store.names()


def test_corrupt_registry_is_reported(isolated_home: Path) -> None:
    isolated_home.mkdir(parents=True)
    (isolated_home / "registry.json").write_text("{not json")
    with pytest.raises(StoreError, match="registry"):
        Store().names()


def _add_many(args: tuple[str, str, int]) -> None:
    home, path, worker = args
    os.environ["LOCALRUN_HOME"] = home
    store = Store()
    for i in range(15):
        store.add(path, name=f"w{worker}:m{i}")


def test_concurrent_writers_lose_nothing(stories: Path, isolated_home: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        pool.map(_add_many, [(str(isolated_home), str(stories), w) for w in range(4)])
    names = set(Store().names())
    expected = {f"w{w}:m{i}" for w in range(4) for i in range(15)}
    assert expected <= names
    leftovers = [p.name for p in isolated_home.iterdir() if p.name.startswith(".registry-")]
    assert leftovers == []
