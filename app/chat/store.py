"""Chats and messages in SQLite (write-ahead log) under STRATA_HOME: no Qt, no engine.

Contract: `ChatStore(path)` opens or creates the database and, on opening, marks every
message left 'streaming' by a process that died as 'interrupted', keeping its partial text.
A streaming reply is a row written when the reply starts and updated as text arrives, so a
crash or kill loses at most the text since the last update. Writes commit at once.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DB_NAME = "chats.sqlite3"
DEFAULT_TITLE = "New chat"
STATUSES = ("complete", "interrupted", "streaming")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS chats (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    system_prompt TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    sampling TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chats(id) ON DELETE CASCADE,
    role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
    content TEXT NOT NULL DEFAULT '',
    status TEXT NOT NULL DEFAULT 'complete'
        CHECK (status IN ('complete', 'interrupted', 'streaming')),
    stats TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_chat ON messages(chat_id, id);
CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512

    @classmethod
    def from_json(cls, text: str) -> Sampling:
        try:
            data = json.loads(text or "{}")
        except ValueError:
            data = {}
        base = cls()
        return cls(temperature=float(data.get("temperature", base.temperature)),
                   top_p=float(data.get("top_p", base.top_p)),
                   max_tokens=int(data.get("max_tokens", base.max_tokens)))

    def to_json(self) -> str:
        return json.dumps({"temperature": self.temperature, "top_p": self.top_p,
                           "max_tokens": self.max_tokens})


KV_MODES = ("mlx", "exact", "sparse")
KV_BITS = (16, 8, 4)


@dataclass(frozen=True)
class EngineSettings:
    """App-wide engine settings, kept in the settings table (issue 5: the CLI's KV flags).

    kv_mode: 'mlx' (mlx-lm's cache in RAM), 'exact' or 'sparse' (the paged KV cache with an
    SSD tier). kv_bits: 16 keeps the paged cache's pages as computed, 8 or 4 quantizes them
    (paged modes only; ignored with 'mlx'). kv_ram_mb: the paged cache's RAM budget, 0 for
    automatic (a quarter of RAM).
    kv_budget_tokens: sparse attention's budget per query. prefix_cache: keep prompt prefixes'
    KV on disk (STRATA_HOME/prefix) so system prompts stay warm across restarts. prefix_mb: that
    folder's disk budget in MB (2^20 bytes); least recently used prefixes leave past it.
    """

    kv_mode: str = "mlx"
    kv_bits: int = 16
    kv_ram_mb: int = 0
    kv_budget_tokens: int = 2048
    prefix_cache: bool = True
    prefix_mb: int = 4096

    @classmethod
    def load(cls, store: ChatStore) -> EngineSettings:
        base = cls()
        try:
            mode = store.setting("kv_mode", base.kv_mode) or base.kv_mode
            bits = int(store.setting("kv_bits", str(base.kv_bits)) or base.kv_bits)
            return cls(kv_mode=mode if mode in KV_MODES else base.kv_mode,
                       kv_bits=bits if bits in KV_BITS else base.kv_bits,
                       kv_ram_mb=max(0, int(store.setting("kv_ram_mb", "0") or 0)),
                       kv_budget_tokens=int(store.setting("kv_budget_tokens",
                                                          str(base.kv_budget_tokens)) or 0)
                       or base.kv_budget_tokens,
                       prefix_cache=store.setting("prefix_cache", "1") != "0",
                       prefix_mb=max(0, int(store.setting("prefix_mb")
                                            or str(base.prefix_mb))))
        except ValueError:
            return base

    def save(self, store: ChatStore) -> None:
        store.set_setting("kv_mode", self.kv_mode)
        store.set_setting("kv_bits", str(self.kv_bits))
        store.set_setting("kv_ram_mb", str(self.kv_ram_mb))
        store.set_setting("kv_budget_tokens", str(self.kv_budget_tokens))
        store.set_setting("prefix_cache", "1" if self.prefix_cache else "0")
        store.set_setting("prefix_mb", str(self.prefix_mb))

    def as_dict(self) -> dict[str, Any]:
        return {"kv_mode": self.kv_mode, "kv_bits": self.kv_bits, "kv_ram_mb": self.kv_ram_mb,
                "kv_budget_tokens": self.kv_budget_tokens, "prefix_cache": self.prefix_cache,
                "prefix_mb": self.prefix_mb}


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    system_prompt: str
    model: str
    sampling: Sampling
    created: float
    updated: float


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    role: str
    content: str
    status: str
    stats: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0


class ChatStore:
    """One connection to the chat database, used from the GUI thread."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path) if str(path) != ":memory:" else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self.recovered = self._recover()

    @classmethod
    def in_home(cls, home: Path) -> ChatStore:
        return cls(Path(home) / DB_NAME)

    def close(self) -> None:
        self._db.close()

    def _recover(self) -> int:
        """Mark replies left streaming by a dead process as interrupted; return how many."""
        cur = self._db.execute(
            "UPDATE messages SET status='interrupted' WHERE status='streaming'")
        return cur.rowcount

    # -- chats -------------------------------------------------------------------------
    def chats(self) -> list[Chat]:
        rows = self._db.execute("SELECT * FROM chats ORDER BY updated DESC, id DESC")
        return [_chat(r) for r in rows]

    def chat(self, chat_id: int) -> Chat | None:
        row = self._db.execute("SELECT * FROM chats WHERE id=?", (chat_id,)).fetchone()
        return _chat(row) if row else None

    def create_chat(self, model: str = "", title: str = DEFAULT_TITLE,
                    system_prompt: str = "", sampling: Sampling | None = None) -> Chat:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO chats (title, system_prompt, model, sampling, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (title, system_prompt, model, (sampling or Sampling()).to_json(), now, now))
        chat = self.chat(int(cur.lastrowid or 0))
        assert chat is not None
        return chat

    def update_chat(self, chat_id: int, *, title: str | None = None,
                    system_prompt: str | None = None, model: str | None = None,
                    sampling: Sampling | None = None, touch: bool = False) -> None:
        sets: list[str] = []
        values: list[Any] = []
        for column, value in (("title", title), ("system_prompt", system_prompt),
                              ("model", model),
                              ("sampling", sampling.to_json() if sampling else None)):
            if value is not None:
                sets.append(f"{column}=?")
                values.append(value)
        if touch:
            sets.append("updated=?")
            values.append(time.time())
        if sets:
            self._db.execute(f"UPDATE chats SET {', '.join(sets)} WHERE id=?",
                             (*values, chat_id))

    def delete_chat(self, chat_id: int) -> None:
        self._db.execute("DELETE FROM chats WHERE id=?", (chat_id,))

    # -- messages ----------------------------------------------------------------------
    def messages(self, chat_id: int) -> list[Message]:
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id=? ORDER BY id",
                                (chat_id,))
        return [_message(r) for r in rows]

    def message(self, message_id: int) -> Message | None:
        row = self._db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        return _message(row) if row else None

    def add_message(self, chat_id: int, role: str, content: str = "",
                    status: str = "complete", stats: dict[str, Any] | None = None) -> Message:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO messages (chat_id, role, content, status, stats, created) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (chat_id, role, content, status, json.dumps(stats or {}), now))
        self._db.execute("UPDATE chats SET updated=? WHERE id=?", (now, chat_id))
        msg = self.message(int(cur.lastrowid or 0))
        assert msg is not None
        return msg

    def update_message(self, message_id: int, content: str, status: str | None = None,
                       stats: dict[str, Any] | None = None) -> None:
        if status is not None and status not in STATUSES:
            raise ValueError(f"unknown message status {status!r}")
        self._db.execute(
            "UPDATE messages SET content=?, status=COALESCE(?, status), "
            "stats=COALESCE(?, stats) WHERE id=?",
            (content, status, json.dumps(stats) if stats is not None else None, message_id))

    def recent_stats(self, limit: int = 40) -> list[dict[str, Any]]:
        """Stats of the latest replies that have them, oldest first (the memory chart)."""
        rows = self._db.execute(
            "SELECT stats FROM messages WHERE role='assistant' AND stats != '{}' "
            "ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [json.loads(r["stats"]) for r in reversed(rows)]

    # -- settings ----------------------------------------------------------------------
    def setting(self, key: str, default: str | None = None) -> str | None:
        row = self._db.execute("SELECT value FROM settings WHERE key=?", (key,)).fetchone()
        return str(row["value"]) if row else default

    def set_setting(self, key: str, value: str) -> None:
        self._db.execute("INSERT INTO settings (key, value) VALUES (?, ?) "
                         "ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(id=row["id"], title=row["title"], system_prompt=row["system_prompt"],
                model=row["model"], sampling=Sampling.from_json(row["sampling"]),
                created=row["created"], updated=row["updated"])


def _message(row: sqlite3.Row) -> Message:
    try:
        stats = json.loads(row["stats"] or "{}")
    except ValueError:
        stats = {}
    return Message(id=row["id"], chat_id=row["chat_id"], role=row["role"],
                   content=row["content"], status=row["status"], stats=stats,
                   created=row["created"])
