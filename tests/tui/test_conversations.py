"""The SQLite conversation store: complete turns only, settings per conversation, export."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from localrun.settings import GenerationParams
from tui.conversations import ConversationStore, default_path


def test_store_lives_under_the_data_directory(isolated_home: Path) -> None:
    store = ConversationStore()
    assert store.path == default_path() == isolated_home / "conversations.sqlite3"
    assert store.path.exists()


def test_exchanges_are_stored_whole_and_listed_most_recent_first(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    a = store.create("smollm2:135m", "Be brief.", {"temperature": 0.0, "seed": 3})
    b = store.create("smollm2:135m")
    assert store.list() == []  # empty conversations are not offered for resuming
    store.add_exchange(a.id, "What is the opposite of hot?", "Cold.", {"completion_tokens": 3})
    store.add_exchange(b.id, "hi", "hello")
    store.add_exchange(a.id, "And of up?", "Down.")
    listed = store.list()
    assert [c.id for c in listed] == [a.id, b.id]
    assert listed[0].title == "What is the opposite of hot?" and listed[0].message_count == 4
    again = ConversationStore(tmp_path / "c.sqlite3").get(a.id)  # a fresh connection: persisted
    assert again.system == "Be brief." and again.settings == {"temperature": 0.0, "seed": 3}
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
    store.update_settings(c.id, "You are terse.", {"top_k": 7, "max_tokens": 12, "stop": ("END",)})
    c = store.get(c.id)
    assert c.system == "You are terse." and c.settings == {"top_k": 7, "max_tokens": 12, "stop": ("END",)}


def test_structured_output_spec_persists_and_reloads(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("m")
    assert c.output is None and c.settings == {}
    schema = '{"type": "object", "properties": {"answer": {"type": "string"}}}'
    store.update_settings(c.id, "", {"top_k": 7}, {"schema": schema})
    store.add_exchange(c.id, "q", '{"answer": "a"}')
    for again in (ConversationStore(tmp_path / "c.sqlite3").get(c.id), store.list()[0]):
        assert again.output == {"schema": schema}  # the text as typed, for the dialog and the reply's grammar
        assert again.settings == {"top_k": 7}
    store.update_settings(c.id, "", {}, {"choice": "yes, no"})
    assert store.get(c.id).output == {"choice": "yes, no"}
    # Settings without a spec clear it.
    store.update_settings(c.id, "", {})
    again = store.get(c.id)
    assert again.output is None and again.settings == {}


def test_an_invalid_stored_spec_falls_back_to_no_constraint(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("m")
    for bad in ({"schema": '{"type": "object", "nope": 1}'}, {"choice": 5}, ["not", "a", "spec"]):
        params = {"settings": {"seed": 4}, "output": bad}
        with closing(sqlite3.connect(store.path)) as db, db:
            db.execute("UPDATE conversations SET params = ? WHERE id = ?", (json.dumps(params), c.id))
        again = store.get(c.id)
        assert again.output is None and again.settings == {"seed": 4}, bad


def test_settings_saved_by_an_earlier_version_keep_what_differs_from_the_defaults(tmp_path: Path) -> None:
    """An earlier version saved every field; the values that differ from localrun's defaults were set,
    the others are left to the model's preset and the model."""
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("m")
    old = {**GenerationParams(temperature=0, seed=4).to_dict(), "stop": ["END"], "output": {"choice": "a,b"}}
    with closing(sqlite3.connect(store.path)) as db, db:
        db.execute("UPDATE conversations SET params = ? WHERE id = ?", (json.dumps(old), c.id))
    again = store.get(c.id)
    assert again.settings == {"temperature": 0.0, "seed": 4, "stop": ("END",)} and again.output == {"choice": "a,b"}


def test_export_markdown_and_delete(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("smollm2:135m", "Be kind.")
    store.add_exchange(c.id, "Say hi", "Hi!\n\n```python\nprint('hi')\n```")
    md = store.export_markdown(c.id)
    assert md.startswith("# Say hi\n")
    assert "## System\n\nBe kind." in md and "## You\n\nSay hi" in md and "print('hi')" in md
    store.delete(c.id)
    assert store.list() == []


def test_a_thought_is_stored_apart_and_exported_with_its_answer(tmp_path: Path) -> None:
    store = ConversationStore(tmp_path / "c.sqlite3")
    c = store.create("r1:tiny")
    stats = {"completion_tokens": 9, "thinking_tokens": 6, "thinking_seconds": 3.21}
    store.add_exchange(c.id, "Why is the sky blue?", "Rayleigh scattering.", stats, "Light scatters\nby air.")
    turns = ConversationStore(tmp_path / "c.sqlite3").get(c.id).turns
    assert (turns[0].thinking, turns[1].thinking) == ("", "Light scatters\nby air.")
    assert turns[1].content == "Rayleigh scattering." and turns[1].thought_title() == "Thought for 3.2 s · 6 tokens"
    # The thought goes back to the model apart from the answer, never as content.
    assert store.get(c.id).history()[1] == {"role": "assistant", "content": "Rayleigh scattering.",
                                            "thinking": "Light scatters\nby air."}
    md = store.export_markdown(c.id)
    assert ("## Assistant\n\n<details>\n<summary>Thought for 3.2 s · 6 tokens</summary>\n\nLight scatters\nby air.\n\n"
            "</details>\n\nRayleigh scattering.\n") in md
    data = store.export_json(c.id)
    assert data["messages"][1] == {"role": "assistant", "content": "Rayleigh scattering.",
                                   "thinking": "Light scatters\nby air.", "stats": stats}
    assert "thinking" not in data["messages"][0]
    # A regenerated reply replaces the thought with its own (none, here).
    again = store.replace_last_reply(c.id, "Blue light scatters most.", {})
    assert again.turns[1].thinking == "" and "<details>" not in store.export_markdown(c.id)


def test_a_history_from_before_thoughts_loads_and_takes_them(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite3"
    with closing(sqlite3.connect(path)) as db, db:  # the schema as it was before the thinking column
        db.executescript(
            "CREATE TABLE conversations (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, model TEXT NOT NULL,"
            " system TEXT NOT NULL DEFAULT '', params TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL,"
            " updated REAL NOT NULL);"
            "CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, conversation_id INTEGER NOT NULL"
            " REFERENCES conversations(id) ON DELETE CASCADE, role TEXT NOT NULL, content TEXT NOT NULL,"
            " stats TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);"
            "INSERT INTO conversations VALUES (1, 'hi', 'smollm2:135m', '', '{}', 1.0, 1.0);"
            "INSERT INTO messages VALUES (1, 1, 'user', 'hi', '{}', 1.0), (2, 1, 'assistant', 'hello', '{}', 1.0);"
        )
    store = ConversationStore(path)
    old = store.get(1)
    assert [(t.role, t.content, t.thinking) for t in old.turns] == [("user", "hi", ""), ("assistant", "hello", "")]
    assert [c.id for c in store.list()] == [1]
    store.add_exchange(1, "and?", "more", {"thinking_tokens": 2}, "hmm")
    assert ConversationStore(path).get(1).turns[3].thinking == "hmm"
