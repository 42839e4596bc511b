"""The SQLite conversation store: complete turns only, settings per conversation, export."""

from __future__ import annotations

from pathlib import Path

from localrun.generation import GenerationParams
from tui.conversations import ConversationStore, default_path


def test_store_lives_under_the_data_directory(isolated_home: Path) -> None:
    store = ConversationStore()
    assert store.path == default_path() == isolated_home / "conversations.sqlite3"
    assert store.path.exists()


def test_exchanges_are_stored_whole_and_listed_most_recent_first(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    a = store.create("smollm2:135m", "Be brief.", GenerationParams(temperature=0, seed=3))
    b = store.create("smollm2:135m")
    assert store.list() == []  # empty conversations are not offered for resuming
    store.add_exchange(a.id, "What is the opposite of hot?", "Cold.", {"completion_tokens": 3})
    store.add_exchange(b.id, "hi", "hello")
    store.add_exchange(a.id, "And of up?", "Down.")
    listed = store.list()
    assert [c.id for c in listed] == [a.id, b.id]
    assert listed[0].title == "What is the opposite of hot?" and listed[0].message_count == 4
    again = ConversationStore(tmp_path / "c.sqlite3").get(a.id)  # a fresh connection: persisted
    assert again.system == "Be brief." and again.params == GenerationParams(temperature=0, seed=3)
    assert again.history() == [
        {"role": "user", "content": "What is the opposite of hot?"},
        {"role": "assistant", "content": "Cold."},
        {"role": "user", "content": "And of up?"},
        {"role": "assistant", "content": "Down."},
    ]
    assert again.turns[1].stats == {"completion_tokens": 3}


def test_regenerate_replaces_only_the_last_reply_and_settings_persist(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("m")
    store.add_exchange(c.id, "one", "first")
    store.add_exchange(c.id, "two", "second")
    c = store.replace_last_reply(c.id, "second, again")
    assert [t.content for t in c.turns] == ["one", "first", "two", "second, again"]
    store.update_settings(c.id, "You are terse.", GenerationParams(top_k=7, max_tokens=12, stop=("END",)))
    c = store.get(c.id)
    assert c.system == "You are terse." and c.params.top_k == 7 and c.params.stop == ("END",)


def test_export_markdown_and_delete(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("smollm2:135m", "Be kind.")
    store.add_exchange(c.id, "Say hi", "Hi!\n\n```python\nprint('hi')\n```")
    md = store.export_markdown(c.id)
    assert md.startswith("# Say hi\n")
    assert "## System\n\nBe kind." in md and "## You\n\nSay hi" in md and "print('hi')" in md
    store.delete(c.id)
    assert store.list() == []
