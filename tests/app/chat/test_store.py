"""The chat database: WAL, recovery of replies left streaming, cascade delete, settings;
migration of an old database, branches, export and import, search, presets."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from app.chat.store import (
    SCHEMA_VERSION,
    Attachment,
    ChatFileError,
    ChatStore,
    Preset,
    Sampling,
)


def test_store_round_trip_and_recovery(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    chat = store.create_chat(model="starter", system_prompt="Be brief.",
                             sampling=Sampling(temperature=0.0, top_p=0.9, max_tokens=64))
    store.add_message(chat.id, "user", "hello")
    reply = store.add_message(chat.id, "assistant", "", status="streaming")
    store.update_message(reply.id, "partial answ")
    store.set_setting("default_model", "starter")

    again = ChatStore(db)  # a second process would see the same
    assert again.recovered == 1
    messages = again.messages(chat.id)
    assert [(m.role, m.content, m.status) for m in messages] == [
        ("user", "hello", "complete"), ("assistant", "partial answ", "interrupted")]
    loaded = again.chat(chat.id)
    assert loaded is not None and loaded.sampling == Sampling(0.0, 0.9, 64)
    assert loaded.system_prompt == "Be brief."
    assert again.setting("default_model") == "starter"

    again.update_message(reply.id, "partial answer", status="complete",
                         stats={"ttft_s": 0.1, "decode_tps": 10.0})
    assert again.recent_stats() == [{"ttft_s": 0.1, "decode_tps": 10.0}]
    again.delete_chat(chat.id)
    assert again.messages(chat.id) == []
    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0


# The chats database as the first release wrote it (schema version 0: no branches).
OLD_SCHEMA = """
CREATE TABLE chats (id INTEGER PRIMARY KEY, title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '', model TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'complete'
        CHECK (status IN ('complete', 'interrupted', 'streaming')),
    stats TEXT NOT NULL DEFAULT '{}', created REAL NOT NULL);
CREATE INDEX messages_chat ON messages(chat_id, id);
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO chats VALUES (1, 'Old chat', 'Be brief.', 'starter', '{}', 1.0, 2.0);
INSERT INTO messages VALUES (1, 1, 'user', 'first question', 'complete', '{}', 1.0);
INSERT INTO messages VALUES (2, 1, 'assistant', 'first answer', 'complete', '{}', 1.1);
INSERT INTO messages VALUES (3, 1, 'user', 'second question', 'complete', '{}', 1.2);
INSERT INTO messages VALUES (4, 1, 'assistant', 'half an ans', 'streaming', '{}', 1.3);
"""


def test_an_old_database_migrates_and_keeps_its_chats(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    old = sqlite3.connect(db)
    old.executescript(OLD_SCHEMA)
    old.close()
    store = ChatStore(db)
    assert store.migrated_from == 0
    assert store._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    path = store.messages(1)
    assert [m.content for m in path] == ["first question", "first answer", "second question",
                                         "half an ans"]
    assert [m.parent_id for m in path] == [None, 1, 2, 3]
    assert path[-1].status == "interrupted" and store.recovered == 1
    # The migrated chat branches like a new one; a reopened database does not migrate again.
    store.add_message(1, "assistant", "another answer", parent_id=3)
    again = ChatStore(db)
    assert again.migrated_from == SCHEMA_VERSION
    assert [m.content for m in again.messages(1)][-1] == "another answer"
    assert len(again.siblings(4)) == 2


def test_branches_survive_a_reopen_and_switch(tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    chat = store.create_chat()
    q = store.add_message(chat.id, "user", "question")
    a1 = store.add_message(chat.id, "assistant", "answer one")
    a2 = store.add_message(chat.id, "assistant", "answer two", parent_id=q.id)  # regenerate
    store.add_message(chat.id, "user", "follow-up")
    q2 = store.add_message(chat.id, "user", "question, edited", parent_id=None)  # edit
    store.close()
    again = ChatStore(db)
    assert [m.content for m in again.messages(chat.id)] == ["question, edited"]
    assert [m.id for m in again.siblings(q.id)] == [q.id, q2.id]
    again.show_branch(q.id)  # back to the first question: its latest reply and what follows
    assert [m.content for m in again.messages(chat.id)] == ["question", "answer two",
                                                            "follow-up"]
    again.show_branch(a1.id)
    assert [m.content for m in again.messages(chat.id)] == ["question", "answer one"]
    assert [m.id for m in again.siblings(a2.id)] == [a1.id, a2.id]
    assert len(again.all_messages(chat.id)) == 5


def test_export_round_trips_and_markdown_shows_the_branch(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    chat = store.create_chat(model="starter", system_prompt="Answer in French.",
                             sampling=Sampling(temperature=0.2, top_p=0.9, max_tokens=99))
    store.update_chat(chat.id, title="Exported")
    q = store.add_message(chat.id, "user", "Summarize the file.")
    store.add_attachment(q.id, Attachment(name="notes.pdf", text="PELICAN " * 5, kind="pdf",
                                          pages=3, tokens=12, kv_bytes=276_480))
    store.add_message(chat.id, "assistant", "```python\nprint(1)\n```", stats={"model": "m"})
    store.add_message(chat.id, "assistant", "| a | b |\n|---|---|\n| 1 | 2 |",
                      status="interrupted", parent_id=q.id)
    data = store.export_chat(chat.id)
    text = json.dumps(data)
    copy = store.import_chat(json.loads(text))
    assert copy.id != chat.id
    assert store.export_chat(copy.id) == data
    other = ChatStore(tmp_path / "other.sqlite3")  # another machine's database
    assert other.export_chat(other.import_chat(json.loads(text)).id) == data
    md = store.chat_markdown(chat.id)
    assert md.startswith("# Exported\n")
    assert "> Answer in French." in md and "Attached: **notes.pdf** (3 pages, 12 tokens)" in md
    assert "| 1 | 2 |" in md and "print(1)" not in md  # the shown branch only
    with pytest.raises(ChatFileError, match="^x.json: is not a Strata chat export$"):
        store.import_chat({"format": "other"}, source="x.json")
    broken = dict(data, messages=[{"role": "user", "parent": 5}])
    with pytest.raises(ChatFileError, match="^x.json: message 0 has parent 5"):
        store.import_chat(broken, source="x.json")
    assert len(store.chats()) == 2  # nothing half-imported


def test_search_and_presets(tmp_path: Path) -> None:
    store = ChatStore(tmp_path / "chats.sqlite3")
    a = store.create_chat(title="Pelicans")
    b = store.create_chat(title="Other")
    store.add_message(b.id, "user", "Tell me about the brown pelican, please.")
    store.add_message(b.id, "assistant", "100% sure: no")
    hits = store.search("PELICAN")
    assert {(h.chat_id, h.message_id is None) for h in hits} == {(a.id, True), (b.id, False)}
    assert "brown pelican" in [h for h in hits if h.chat_id == b.id][0].snippet
    assert [h.chat_id for h in store.search("100%")] == [b.id]
    assert store.search("1_0") == [] and store.search("  ") == []
    store.save_preset(Preset("Terse", "Be terse.", Sampling(0.0, 1.0, 64)))
    store.save_preset(Preset("Terse", "Be very terse.", Sampling(0.1, 1.0, 32)))
    assert store.presets() == [Preset("Terse", "Be very terse.", Sampling(0.1, 1.0, 32))]
    store.delete_preset("Terse")
    assert store.presets() == []
