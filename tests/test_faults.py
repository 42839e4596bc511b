"""Damaged state files: a truncated or garbled registry.json and chat-history database.

Each is either restored from the copy kept beside it (saying so once) or refused with an error
that names the file and the fix; never read as an empty library or an empty history.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from localrun.errors import StoreError
from tui.conversations import ConversationStore

from . import reliability

# Ways a file gets damaged: cut off mid-content, overwritten with junk, emptied.
DAMAGE = {
    "truncated": lambda raw: raw[: len(raw) // 2],
    "garbage": lambda raw: bytes(range(256)) * 4,
    "empty": lambda raw: b"",
}


def _registry_with_two_models(cli, home: Path, tmp_path: Path, stories: Path) -> tuple[str, str]:
    """Register two copies of stories260K through the CLI: registry.json.bak then holds the first only."""
    names = ("stories-a:f32", "stories-b:f32")
    for name in names:
        copy = tmp_path / f"{name.split(':')[0]}.gguf"
        shutil.copyfile(stories, copy)
        r = cli("add", str(copy), "--name", name)
        assert r.returncode == 0, r.stderr
    assert (home / "registry.json.bak").exists()
    return names


def _listed(cli) -> tuple[int, list[str], str]:
    r = cli("list", "--json")
    names = [m["name"] for m in json.loads(r.stdout)] if r.returncode == 0 else []
    return r.returncode, names, r.stderr


def test_every_registry_write_keeps_the_previous_version(
    cli, isolated_home: Path, tmp_path: Path, stories: Path
) -> None:
    a, b = _registry_with_two_models(cli, isolated_home, tmp_path, stories)
    current = json.loads((isolated_home / "registry.json").read_text())
    kept = json.loads((isolated_home / "registry.json.bak").read_text())
    assert sorted(current["models"]) == [a, b]
    assert sorted(kept["models"]) == [a]
    assert not list(isolated_home.glob(".registry-*"))  # no temporary file left


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_registry_is_restored_from_its_kept_copy(
    cli, isolated_home: Path, tmp_path: Path, stories: Path, damage: str
) -> None:
    a, b = _registry_with_two_models(cli, isolated_home, tmp_path, stories)
    registry = isolated_home / "registry.json"
    damaged = DAMAGE[damage](registry.read_bytes())
    registry.write_bytes(damaged)

    rc, names, err = _listed(cli)
    assert rc == 0, err
    assert a in names and b not in names  # the previous version: the last change is what is lost
    warning = [line for line in err.splitlines() if "registry" in line]
    assert len(warning) == 1 and "damaged" in warning[0] and "registry.json.bak" in warning[0], err
    broken = list(isolated_home.glob("registry.json.broken-*"))
    assert len(broken) == 1 and broken[0].read_bytes() == damaged  # kept for inspection
    assert a in json.loads(registry.read_text())["models"]

    rc, names_again, err = _listed(cli)  # said once: the registry is sound again
    assert rc == 0 and names_again == names and "registry" not in err
    reliability.fault("damaged file", "registry.json")


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_registry_without_a_kept_copy_is_an_error_naming_it(
    cli, isolated_home: Path, tmp_path: Path, stories: Path, damage: str
) -> None:
    _registry_with_two_models(cli, isolated_home, tmp_path, stories)
    registry = isolated_home / "registry.json"
    damaged = DAMAGE[damage](registry.read_bytes())
    registry.write_bytes(damaged)
    (isolated_home / "registry.json.bak").unlink()

    for args in (("list",), ("list", "--json"), ("show", "stories-a:f32")):
        r = cli(*args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        assert r.stdout == ""  # no empty table, no empty JSON list
        assert f"the model registry '{registry}' is damaged" in r.stderr
        assert "no kept copy" in r.stderr and f"mv '{registry}'" in r.stderr
        assert "Traceback" not in r.stderr
    assert registry.read_bytes() == damaged  # left as it was: the user decides
    reliability.fault("damaged file", "registry.json")


def test_a_damaged_registry_and_kept_copy_is_an_error_naming_both(
    cli, isolated_home: Path, tmp_path: Path, stories: Path
) -> None:
    _registry_with_two_models(cli, isolated_home, tmp_path, stories)
    (isolated_home / "registry.json").write_text('{"version": 1, "models": {"x": {"pa')
    (isolated_home / "registry.json.bak").write_bytes(b"\x00" * 64)
    r = cli("list")
    assert r.returncode == 1 and r.stdout == ""
    assert (
        "registry.json' is damaged" in r.stderr and "registry.json.bak' is damaged too" in r.stderr
    )
    reliability.fault("damaged file", "registry.json")


def test_a_write_to_a_damaged_registry_restores_it_first(
    cli, isolated_home: Path, tmp_path: Path, stories: Path
) -> None:
    """`add` reads the registry under its lock: the restore runs there too, and the change lands on it."""
    a, b = _registry_with_two_models(cli, isolated_home, tmp_path, stories)
    (isolated_home / "registry.json").write_bytes(b"{")
    r = cli("add", str(tmp_path / "stories-b.gguf"), "--name", "stories-c:f32")
    assert r.returncode == 0, r.stderr
    assert "registry.json.bak" in r.stderr
    rc, names, _ = _listed(cli)
    assert rc == 0 and sorted(n for n in names if n.startswith("stories")) == [a, "stories-c:f32"]
    reliability.fault("damaged file", "registry.json")


def test_a_registry_of_the_wrong_shape_counts_as_damaged(isolated_home: Path) -> None:
    from localrun.store import Store

    isolated_home.mkdir(parents=True)
    for text in ('["a list"]', '{"models": []}', '{"models": {"m": {"format": "gguf"}}}'):
        (isolated_home / "registry.json").write_text(text)
        with pytest.raises(StoreError, match="is damaged"):
            Store().list()
    reliability.fault("damaged file", "registry.json")


# --- the chat history -------------------------------------------------------------------------


def _history(path: Path) -> ConversationStore:
    store = ConversationStore(path)
    for i in range(40):  # a few pages, so that cutting the file in half cuts into the tables
        c = store.create("smollm2:135m", "Be brief.")
        store.add_exchange(c.id, f"question {i} " * 20, f"answer {i} " * 40)
    return store


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_history_is_restored_from_the_copy_kept_at_open(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "conversations.sqlite3"
    before = [c.title for c in _history(path).list()]
    ConversationStore(path)  # the next session opens it: the sound file is kept as .bak
    later = ConversationStore(path)
    c = later.create("m")
    later.add_exchange(c.id, "after the copy", "lost with the damage")
    damaged = DAMAGE[damage](path.read_bytes())
    path.write_bytes(damaged)

    store = ConversationStore(path)
    assert [c.title for c in store.list()] == before
    assert (
        store.notice is not None
        and "restored" in store.notice
        and "conversations.sqlite3.bak" in store.notice
    )
    assert any("chat history" in r.getMessage() for r in caplog.records)
    broken = list(tmp_path.glob("conversations.sqlite3.broken-*"))
    assert len(broken) == 1 and broken[0].read_bytes() == damaged
    again = ConversationStore(path)
    assert again.notice is None and len(again.list()) == len(before)
    reliability.fault("damaged file", "chat history")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_history_without_a_kept_copy_is_an_error_naming_it(
    tmp_path: Path, damage: str
) -> None:
    path = tmp_path / "conversations.sqlite3"
    _history(path)
    (tmp_path / "conversations.sqlite3.bak").unlink()
    damaged = DAMAGE[damage](path.read_bytes())
    path.write_bytes(damaged)
    with pytest.raises(StoreError) as e:
        ConversationStore(path)
    msg = str(e.value)
    assert (
        f"the chat history '{path}' is damaged" in msg
        and "no kept copy" in msg
        and f"mv '{path}'" in msg
    )
    assert path.read_bytes() == damaged  # not replaced by an empty database
    reliability.fault("damaged file", "chat history")


def test_a_damaged_history_and_kept_copy_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "conversations.sqlite3"
    _history(path)
    path.write_bytes(b"not a database" * 100)
    (tmp_path / "conversations.sqlite3.bak").write_bytes(b"\xff" * 8192)
    with pytest.raises(StoreError, match="kept copy .* is damaged too"):
        ConversationStore(path)
    reliability.fault("damaged file", "chat history")
