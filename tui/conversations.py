"""Chat conversations persisted in SQLite under the data directory.

A turn is stored only when its reply is complete: the user message and the assistant reply are
written in one transaction, so a cancelled or failed reply leaves nothing half-written. A thinking
model's thought is stored apart from its answer (the `thinking` column), never sent back as content.
A message's images are kept in the history itself (the `attachments` table, the files' bytes): a
conversation still shows and sends them when the files have moved or gone. The tools a reply
called (MCP) are kept with it (the `tool_steps` column): shown again when the conversation is
reopened, exported, and sent back to the model as the calls and results it read.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localrun import api, settings
from localrun.errors import StoreError
from localrun.images import to_base64
from tui.attachments import Attachment
from tui.tool_calls import ToolSettings, ToolStep, markdown, read_steps, steps_json

_log = logging.getLogger(__name__)

# The params column: {"settings": the settings the user set (by field name), "output": the
# structured-output spec as the user gave it}. A column from before holds every field of the settings.
SETTINGS_KEY = "settings"
OUTPUT_KEY = "output"
TOOLS_KEY = "tools"  # the conversation's ToolSettings (servers and tools off, tool choice, steps)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    title TEXT NOT NULL,
    model TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    params TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    thinking TEXT NOT NULL DEFAULT '',
    tool_steps TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
CREATE TABLE IF NOT EXISTS attachments (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
    name TEXT NOT NULL,
    data BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS attachments_by_message ON attachments(message_id, id);
"""


@dataclass(frozen=True)
class Turn:
    """One stored message."""

    role: str
    content: str
    stats: dict[str, Any] = field(default_factory=dict, compare=False)
    thinking: str = ""  # an assistant turn's thought, apart from its answer (content)
    images: tuple[Attachment, ...] = ()  # a user turn's images, shown before its text
    steps: tuple[ToolStep, ...] = ()  # an assistant turn's replies that called tools, before its answer

    def thought_title(self) -> str:
        """'Thought for 3.2 s · 41 tokens', from the turn's stats (what of it is known)."""
        return thought_title(self.stats.get("thinking_seconds"), self.stats.get("thinking_tokens"))


@dataclass(frozen=True)
class Conversation:
    """A conversation's settings and, when loaded, its messages."""

    id: int
    title: str
    model: str
    system: str
    settings: Mapping[str, Any]  # the settings the user set for it (settings.py's names); the rest as the model says
    updated: float
    turns: tuple[Turn, ...] = ()
    message_count: int = 0
    output: dict[str, Any] | None = None  # structured-output spec (Constraint.from_spec)
    tools: ToolSettings = field(default_factory=ToolSettings)

    def history(self, turns: Sequence[Turn] | None = None) -> list[dict[str, Any]]:
        """The messages (of all turns, or those given) in the shape `api.build_messages` takes. A
        turn's thought goes apart from its content: the engine gives it to the template under its
        format's field (Seed-OSS, Bielik, Command A read earlier thoughts), or drops it where the
        template does. A turn's images go again with every later request (the engine finds them in
        its cache). A reply that called tools is its calls and their results, then its answer."""
        out: list[dict[str, Any]] = []
        for t in self.turns if turns is None else turns:
            for step in t.steps:
                out.extend(step.messages())
            out.append({"role": t.role, "content": t.content, **({"thinking": t.thinking} if t.thinking else {}),
                        **({"images": [a.data for a in t.images]} if t.images else {})})
        return out


def thought_title(seconds: float | None, tokens: int | None) -> str:
    """The title of a thought's block: 'Thought for 3.2 s · 41 tokens' (parts not known left out)."""
    title = f"Thought for {seconds:.1f} s" if seconds is not None else "Thought"
    return f"{title} · {tokens} token{'' if tokens == 1 else 's'}" if tokens is not None else title


def default_path() -> Path:
    """conversations.sqlite3 under the localrun data directory."""
    from localrun.store import home

    return home() / "conversations.sqlite3"


def _settings(raw: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The params column's settings and output spec (a spec this version refuses is dropped). A
    column from before kept every field: the values that differ from localrun's defaults were set."""
    try:
        data = json.loads(raw or "{}")
        output = data.pop(OUTPUT_KEY, None)
        if SETTINGS_KEY in data:
            given = data[SETTINGS_KEY]
        else:
            given = {k: v for k, v in data.items()
                     if k in settings.GENERATION and v != settings.GENERATION[k].default and v != []}
        values = settings.read(given, "batch", strict=False)
    except Exception:  # noqa: BLE001 - a settings row from another version: fall back to defaults
        return {}, None
    if output is None:
        return values, None
    try:
        api.constraint(output)
    except Exception:  # noqa: BLE001 - a spec this version refuses, or llguidance is gone: no constraint
        return values, None
    return values, output


def _params_json(given: Mapping[str, Any], output: dict[str, Any] | None = None,
                 tools: ToolSettings | None = None) -> str:
    data: dict[str, Any] = {SETTINGS_KEY: {k: list(v) if isinstance(v, tuple) else v for k, v in given.items()}}
    if output is not None:
        data[OUTPUT_KEY] = output
    if tools is not None and tools != ToolSettings():
        data[TOOLS_KEY] = tools.to_dict()
    return json.dumps(data)


def _tool_settings(raw: str) -> ToolSettings:
    """The params column's tool settings (none: every server and tool on, the app's choice)."""
    try:
        data = json.loads(raw or "{}")
    except ValueError:
        return ToolSettings()
    return ToolSettings.from_dict(data.get(TOOLS_KEY) if isinstance(data, dict) else None)


class ConversationStore:
    """Create, list, extend and export conversations."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.backup_path = self.path.with_name(self.path.name + ".bak")
        self.notice: str | None = None  # set when a damaged history was restored from its kept copy
        problem = _damage(self.path, empty_is_damage=self.backup_path.exists())
        if problem is not None:
            self._restore(problem)
        with self._connect() as db:
            db.executescript(_SCHEMA)
            columns = {r[1] for r in db.execute("PRAGMA table_info(messages)")}
            if "thinking" not in columns:  # a history from before thinking models
                db.execute("ALTER TABLE messages ADD COLUMN thinking TEXT NOT NULL DEFAULT ''")
            if "tool_steps" not in columns:  # a history from before tools
                db.execute("ALTER TABLE messages ADD COLUMN tool_steps TEXT NOT NULL DEFAULT ''")
        self._keep_copy()

    def _restore(self, problem: str) -> None:
        """Replace a damaged history with its kept copy (the damaged files moved aside), or fail saying what to do."""
        why = _damage(self.backup_path) if self.backup_path.exists() else "there is no kept copy"
        if why is not None:
            raise StoreError(
                f"the chat history '{self.path}' is damaged ({problem}) and "
                + (why if why == "there is no kept copy" else f"its kept copy '{self.backup_path}' is damaged too ({why})"),
                f"move it aside to start a new history: mv '{self.path}' '{self.path}.broken'",
            )
        stamp = time.strftime("%Y%m%d-%H%M%S")
        broken = self.path.with_name(f"{self.path.name}.broken-{stamp}")
        os.replace(self.path, broken)
        # A journal left beside the damaged file must not be rolled back into the restored copy.
        for suffix in ("-journal", "-wal", "-shm"):
            side = self.path.with_name(self.path.name + suffix)
            if side.exists():
                os.replace(side, broken.with_name(broken.name + suffix))
        _copy_db(self.backup_path, self.path)
        self.notice = (f"the chat history {self.path} was damaged ({problem}); restored the copy kept at "
                       f"{self.backup_path.name} (the damaged file is kept as {broken.name})")
        _log.warning("localrun: %s", self.notice)

    def _keep_copy(self) -> None:
        """Snapshot the history (checked sound at open) to the .bak file beside it, atomically."""
        try:
            _copy_db(self.path, self.backup_path)
        except (OSError, sqlite3.Error) as e:  # a full disk must not keep the chats from opening
            _log.warning("localrun: could not keep a copy of the chat history at %s: %s", self.backup_path, e)

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # One short-lived connection per operation: safe from worker threads and other processes.
        db = sqlite3.connect(self.path, timeout=10)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            with db:
                yield db
        finally:
            db.close()

    def create(self, model: str, system: str = "", given: Mapping[str, Any] | None = None,
               title: str = "New chat") -> Conversation:
        """A new, empty conversation with the settings the user set (`given`)."""
        now = time.time()
        p = dict(given or {})
        with self._connect() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, model, system, params, created, updated) VALUES (?, ?, ?, ?, ?, ?)",
                (title, model, system, _params_json(p), now, now),
            )
            cid = int(cur.lastrowid or 0)
        return Conversation(cid, title, model, system, p, now)

    def list(self) -> list[Conversation]:
        """Every conversation that has at least one turn, most recent first (without messages)."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT c.id, c.title, c.model, c.system, c.params, c.updated, COUNT(m.id) AS n "
                "FROM conversations c JOIN messages m ON m.conversation_id = c.id "
                "GROUP BY c.id ORDER BY c.updated DESC, c.id DESC"
            ).fetchall()
        return [_conversation(r[:6], message_count=r[6]) for r in rows]

    def get(self, cid: int) -> Conversation:
        """A conversation with its messages; KeyError when it does not exist."""
        with self._connect() as db:
            row = db.execute(
                "SELECT id, title, model, system, params, updated FROM conversations WHERE id = ?", (cid,)
            ).fetchone()
            if row is None:
                raise KeyError(cid)
            msgs = db.execute(
                "SELECT id, role, content, stats, thinking, tool_steps FROM messages WHERE conversation_id = ? "
                "ORDER BY id", (cid,),
            ).fetchall()
            attached: dict[int, list[Attachment]] = {}
            for mid, name, data in db.execute(
                "SELECT a.message_id, a.name, a.data FROM attachments a JOIN messages m ON m.id = a.message_id "
                "WHERE m.conversation_id = ? ORDER BY a.id", (cid,)
            ):
                attached.setdefault(mid, []).append(Attachment(name, bytes(data)))
        turns = tuple(Turn(r[1], r[2], json.loads(r[3] or "{}"), r[4] or "", tuple(attached.get(r[0], ())),
                           read_steps(r[5])) for r in msgs)
        return _conversation(row, turns, len(turns))

    def add_exchange(self, cid: int, user: str, reply: str, stats: dict[str, Any] | None = None,
                     thinking: str = "", images: Sequence[Attachment] = (),
                     steps: Sequence[ToolStep] = ()) -> Conversation:
        """Store a complete exchange (prompt with its images, and reply with its thought and the
        tools it called) atomically; the first one titles the chat."""
        now = time.time()
        with self._connect() as db:
            n = db.execute("SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (cid,)).fetchone()[0]
            cur = db.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created) VALUES (?, 'user', ?, '{}', ?)",
                (cid, user, now),
            )
            db.executemany("INSERT INTO attachments (message_id, name, data) VALUES (?, ?, ?)",
                           [(cur.lastrowid, a.name, a.data) for a in images])
            db.execute(
                "INSERT INTO messages (conversation_id, role, content, stats, created, thinking, tool_steps) "
                "VALUES (?, 'assistant', ?, ?, ?, ?, ?)",
                (cid, reply, json.dumps(stats or {}), now, thinking, steps_json(steps)),
            )
            if n == 0:
                db.execute("UPDATE conversations SET title = ? WHERE id = ?",
                           (_title(user or ", ".join(a.name for a in images)), cid))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, cid))
        return self.get(cid)

    def replace_last_reply(self, cid: int, reply: str, stats: dict[str, Any] | None = None,
                           thinking: str = "", steps: Sequence[ToolStep] = ()) -> Conversation:
        """Swap the last assistant reply (and its thought and tool calls) for a regenerated one."""
        with self._connect() as db:
            row = db.execute(
                "SELECT id FROM messages WHERE conversation_id = ? AND role = 'assistant' ORDER BY id DESC LIMIT 1",
                (cid,),
            ).fetchone()
            if row is None:
                raise KeyError(cid)
            db.execute("UPDATE messages SET content = ?, stats = ?, thinking = ?, tool_steps = ? WHERE id = ?",
                       (reply, json.dumps(stats or {}), thinking, steps_json(steps), row[0]))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (time.time(), cid))
        return self.get(cid)

    def update_settings(self, cid: int, system: str, given: Mapping[str, Any],
                        output: dict[str, Any] | None = None) -> None:
        """Save the system prompt, the settings the user set and the structured-output spec of a conversation."""
        with self._connect() as db:
            db.execute("UPDATE conversations SET system = ?, params = ? WHERE id = ?",
                       (system, _params_json(given, output, self._tools(db, cid)), cid))

    def update_tools(self, cid: int, tools: ToolSettings) -> None:
        """Save which servers and tools are on in a conversation, its tool choice and step limit."""
        with self._connect() as db:
            row = db.execute("SELECT params FROM conversations WHERE id = ?", (cid,)).fetchone()
            if row is None:
                raise KeyError(cid)
            given, output = _settings(row[0])
            db.execute("UPDATE conversations SET params = ? WHERE id = ?", (_params_json(given, output, tools), cid))

    @staticmethod
    def _tools(db: sqlite3.Connection, cid: int) -> ToolSettings:
        row = db.execute("SELECT params FROM conversations WHERE id = ?", (cid,)).fetchone()
        return _tool_settings(row[0]) if row is not None else ToolSettings()

    def set_model(self, cid: int, model: str) -> None:
        """Record the model a conversation continues with."""
        with self._connect() as db:
            db.execute("UPDATE conversations SET model = ? WHERE id = ?", (model, cid))

    def delete(self, cid: int) -> None:
        """Delete a conversation and its messages."""
        with self._connect() as db:
            db.execute("DELETE FROM attachments WHERE message_id IN "
                       "(SELECT id FROM messages WHERE conversation_id = ?)", (cid,))
            db.execute("DELETE FROM messages WHERE conversation_id = ?", (cid,))
            db.execute("DELETE FROM conversations WHERE id = ?", (cid,))

    def export_markdown(self, cid: int) -> str:
        """The conversation as a Markdown document; a thought is a collapsed <details> block before its
        answer, an image a line naming it before its message's text."""
        conv = self.get(cid)
        lines = [f"# {conv.title}", "", f"Model: `{conv.model}`", ""]
        if conv.system:
            lines += ["## System", "", conv.system, ""]
        for t in conv.turns:
            lines += [f"## {'You' if t.role == 'user' else 'Assistant'}", ""]
            if t.thinking:
                lines += ["<details>", f"<summary>{t.thought_title()}</summary>", "", t.thinking.strip(), "",
                          "</details>", ""]
            lines += [f"*[image {a.label}]*" for a in t.images] + ([""] if t.images else [])
            for step in t.steps:  # the calls before the answer, each in a collapsed <details> block
                lines += [step.content, ""] if step.content.strip() else []
                for call in step.calls:
                    lines += markdown(call)
            lines += [t.content, ""]
        return "\n".join(lines)

    def export_json(self, cid: int) -> dict[str, Any]:
        """The conversation as JSON: its settings and each message, a thought in its `thinking` field,
        images as base64 in `images` (Ollama's shape) with their file names in `image_names`; a
        reply that called tools is preceded by its calls and their results as the chat API's
        messages, each result with its server, tool, state and time."""
        conv = self.get(cid)
        messages: list[dict[str, Any]] = []
        for t in conv.turns:
            for step in t.steps:
                turn, *results = step.messages()
                messages.append(turn)
                for message, call in zip(results, step.calls, strict=True):
                    messages.append({**message, "server": call.server, "tool": call.tool, "state": call.state,
                                     "seconds": round(call.seconds, 4)})
            m: dict[str, Any] = {"role": t.role, "content": t.content}
            if t.thinking:
                m["thinking"] = t.thinking
            if t.images:
                m["images"] = [to_base64(a.data) for a in t.images]
                m["image_names"] = [a.name for a in t.images]
            if t.stats:
                m["stats"] = t.stats
            messages.append(m)
        return {"title": conv.title, "model": conv.model, "system": conv.system, "messages": messages}


def _damage(path: Path, empty_is_damage: bool = False) -> str | None:
    """What is wrong with an SQLite file (None when sound or absent): sqlite's error or quick_check's report."""
    try:
        if path.stat().st_size == 0:
            # A fresh file is empty too; with a kept copy beside it, an empty one was truncated.
            return "the file is empty" if empty_is_damage else None
    except FileNotFoundError:
        return None
    try:
        # Read-write, so that a hot journal of an interrupted write is rolled back rather than reported.
        with closing(sqlite3.connect(path, timeout=10)) as db:
            rows = db.execute("PRAGMA quick_check").fetchall()
    except sqlite3.DatabaseError as e:
        return str(e)
    report = "; ".join(" ".join(str(r[0]).split()) for r in rows)
    return None if report == "ok" else report[:200]


def _copy_db(src: Path, dst: Path) -> None:
    """A consistent copy of an SQLite database, written beside dst and renamed over it."""
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with closing(sqlite3.connect(src, timeout=10)) as a, closing(sqlite3.connect(tmp)) as b:
            a.backup(b)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _conversation(row: Any, turns: tuple[Turn, ...] = (), message_count: int = 0) -> Conversation:
    """A Conversation from (id, title, model, system, params, updated)."""
    given, output = _settings(row[4])
    return Conversation(row[0], row[1], row[2], row[3], given, row[5], turns, message_count, output,
                        _tool_settings(row[4]))


def _title(prompt: str) -> str:
    line = " ".join(prompt.split())
    return line if len(line) <= 48 else line[:47] + "…"
