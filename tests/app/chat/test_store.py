"""The chat database: WAL, recovery of replies left streaming, cascade delete, settings."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from app.chat.store import ChatStore, Sampling


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
