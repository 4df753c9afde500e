"""Chats and messages in SQLite (write-ahead log) under STRATA_HOME: no Qt, no engine.

Contract: `ChatStore(path)` opens or creates the database, migrates an older one to
SCHEMA_VERSION (PRAGMA user_version; each step in one transaction) and, on opening, marks every
message left 'streaming' by a process that died as 'interrupted', keeping its partial text.
A streaming reply is a row written when the reply starts and updated as text arrives, so a
crash or kill loses at most the text since the last update. Writes commit at once.

Branches: messages form a tree (`parent_id`; NULL for a chat's first messages). A regenerated
reply or an edited message is a sibling of the one it replaces, and nothing is deleted; the
chat's `leaf_id` says which branch it shows, and `messages(chat)` is the path from the root to
that leaf. `add_message` appends to that path unless given a parent. Attachments (documents
whose text joined a user message's context) hang off their message; presets are named system
prompts with sampling. `export_chat` / `import_chat` write and read the whole tree as JSON
(no database ids: an import re-exports identically); `chat_markdown` is the shown branch.
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
SCHEMA_VERSION = 2
# Each step takes the database from version i + 1 to i + 2 (version 0: the schema above as
# it was first shipped, before branches, attachments and presets).
_MIGRATIONS = (
    """
    ALTER TABLE messages ADD COLUMN parent_id INTEGER;
    ALTER TABLE chats ADD COLUMN leaf_id INTEGER;
    UPDATE messages SET parent_id = (SELECT MAX(p.id) FROM messages p
        WHERE p.chat_id = messages.chat_id AND p.id < messages.id);
    UPDATE chats SET leaf_id = (SELECT MAX(m.id) FROM messages m WHERE m.chat_id = chats.id);
    CREATE INDEX IF NOT EXISTS messages_parent ON messages(chat_id, parent_id);
    """,
    """
    CREATE TABLE IF NOT EXISTS attachments (
        id INTEGER PRIMARY KEY,
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        kind TEXT NOT NULL DEFAULT 'text',
        text TEXT NOT NULL,
        pages INTEGER NOT NULL DEFAULT 1,
        tokens INTEGER NOT NULL DEFAULT 0,
        kv_bytes INTEGER NOT NULL DEFAULT 0
    );
    CREATE INDEX IF NOT EXISTS attachments_message ON attachments(message_id);
    CREATE TABLE IF NOT EXISTS presets (
        name TEXT PRIMARY KEY,
        system_prompt TEXT NOT NULL DEFAULT '',
        sampling TEXT NOT NULL DEFAULT '{}',
        updated REAL NOT NULL
    );
    """,
)
EXPORT_FORMAT = "strata-chat"
EXPORT_VERSION = 1
_LEAF = -1  # add_message's default parent: the end of the branch the chat shows


class ChatFileError(ValueError):
    """A chat file to import is not one (one line: the file and the reason)."""


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

    kv_mode: 'exact' (the default) or 'sparse' (the paged KV cache with an SSD tier), 'mlx'
    (mlx-lm's cache in RAM). kv_bits: 16 keeps the paged cache's pages as computed, 8 or 4
    quantizes them (paged modes only; ignored with 'mlx'). kv_ram_mb: the paged cache's RAM
    budget, 0 for automatic (a quarter of RAM).
    kv_budget_tokens: sparse attention's budget per query. prefix_cache: keep prompt prefixes'
    KV on disk (STRATA_HOME/prefix) so system prompts stay warm across restarts. prefix_mb: that
    folder's disk budget in MB (2^20 bytes); least recently used prefixes leave past it.
    draft: speculative decoding (engine.runtime.speculative): 'auto' (prompt lookup when it
    pays), 'off', 'lookup' (always) or a library model's name (a draft model).
    """

    kv_mode: str = "exact"  # the engine's default (engine.kv.settings.DEFAULT_MODE)
    kv_bits: int = 16
    kv_ram_mb: int = 0
    kv_budget_tokens: int = 2048
    prefix_cache: bool = True
    prefix_mb: int = 4096
    draft: str = "auto"

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
                                            or str(base.prefix_mb))),
                       draft=store.setting("draft", base.draft) or base.draft)
        except ValueError:
            return base

    def save(self, store: ChatStore) -> None:
        store.set_setting("kv_mode", self.kv_mode)
        store.set_setting("kv_bits", str(self.kv_bits))
        store.set_setting("kv_ram_mb", str(self.kv_ram_mb))
        store.set_setting("kv_budget_tokens", str(self.kv_budget_tokens))
        store.set_setting("prefix_cache", "1" if self.prefix_cache else "0")
        store.set_setting("prefix_mb", str(self.prefix_mb))
        store.set_setting("draft", self.draft)

    def as_dict(self) -> dict[str, Any]:
        return {"kv_mode": self.kv_mode, "kv_bits": self.kv_bits, "kv_ram_mb": self.kv_ram_mb,
                "kv_budget_tokens": self.kv_budget_tokens, "prefix_cache": self.prefix_cache,
                "prefix_mb": self.prefix_mb, "draft": self.draft}


@dataclass(frozen=True)
class Chat:
    id: int
    title: str
    system_prompt: str
    model: str
    sampling: Sampling
    created: float
    updated: float
    leaf_id: int | None = None


@dataclass(frozen=True)
class Message:
    id: int
    chat_id: int
    role: str
    content: str
    status: str
    stats: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0
    parent_id: int | None = None


@dataclass(frozen=True)
class Attachment:
    """A document whose text joined a user message's context (tokens and KV bytes as
    measured on the model it was sent to)."""

    name: str
    text: str
    kind: str = "text"
    pages: int = 1
    tokens: int = 0
    kv_bytes: int = 0
    id: int = 0
    message_id: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "text": self.text, "pages": self.pages,
                "tokens": self.tokens, "kv_bytes": self.kv_bytes}


@dataclass(frozen=True)
class Preset:
    """A named system prompt and sampling, saved from one chat and applied to others."""

    name: str
    system_prompt: str
    sampling: Sampling


@dataclass(frozen=True)
class SearchHit:
    chat_id: int
    title: str
    message_id: int | None  # None: the title matched
    snippet: str


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
        self.migrated_from = self._migrate()
        self.recovered = self._recover()

    @classmethod
    def in_home(cls, home: Path) -> ChatStore:
        return cls(Path(home) / DB_NAME)

    def close(self) -> None:
        self._db.close()

    def _migrate(self) -> int:
        """Bring an older database to SCHEMA_VERSION; the version it had."""
        version = int(self._db.execute("PRAGMA user_version").fetchone()[0])
        for step in range(version, SCHEMA_VERSION):
            # executescript commits first; BEGIN..COMMIT makes each step all or nothing.
            self._db.executescript(f"BEGIN;\n{_MIGRATIONS[step]}\n"
                                   f"PRAGMA user_version = {step + 1};\nCOMMIT;")
        return version

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
    def all_messages(self, chat_id: int) -> list[Message]:
        """Every message of the chat, every branch, oldest first."""
        rows = self._db.execute("SELECT * FROM messages WHERE chat_id=? ORDER BY id",
                                (chat_id,))
        return [_message(r) for r in rows]

    def messages(self, chat_id: int) -> list[Message]:
        """The branch the chat shows: from its first message to its leaf."""
        everything = {m.id: m for m in self.all_messages(chat_id)}
        if not everything:
            return []
        row = self._db.execute("SELECT leaf_id FROM chats WHERE id=?", (chat_id,)).fetchone()
        leaf = row["leaf_id"] if row is not None else None
        node = everything.get(leaf) if leaf is not None else None
        if node is None:
            node = everything[max(everything)]
        path: list[Message] = []
        while node is not None and len(path) <= len(everything):  # a cycle cannot hang us
            path.append(node)
            node = everything.get(node.parent_id) if node.parent_id is not None else None
        return path[::-1]

    def siblings(self, message_id: int) -> list[Message]:
        """The message and its alternatives (same parent, same role), oldest first."""
        msg = self.message(message_id)
        if msg is None:
            return []
        rows = self._db.execute(
            "SELECT * FROM messages WHERE chat_id=? AND parent_id IS ? AND role=? ORDER BY id",
            (msg.chat_id, msg.parent_id, msg.role))
        return [_message(r) for r in rows]

    def set_leaf(self, chat_id: int, message_id: int) -> None:
        self._db.execute("UPDATE chats SET leaf_id=? WHERE id=?", (message_id, chat_id))

    def show_branch(self, message_id: int) -> None:
        """Show the branch through `message_id`: down its latest children to a leaf."""
        msg = self.message(message_id)
        if msg is None:
            return
        node = msg.id
        while True:
            row = self._db.execute("SELECT MAX(id) AS id FROM messages WHERE parent_id=?",
                                   (node,)).fetchone()
            if row is None or row["id"] is None:
                break
            node = int(row["id"])
        self.set_leaf(msg.chat_id, node)

    def message(self, message_id: int) -> Message | None:
        row = self._db.execute("SELECT * FROM messages WHERE id=?", (message_id,)).fetchone()
        return _message(row) if row else None

    def add_message(self, chat_id: int, role: str, content: str = "",
                    status: str = "complete", stats: dict[str, Any] | None = None,
                    parent_id: int | None = _LEAF, created: float | None = None) -> Message:
        """Append a message under `parent_id` (default: the end of the shown branch; None: a
        first message) and show the branch it ends."""
        now = time.time() if created is None else created
        if parent_id == _LEAF:
            path = self.messages(chat_id)
            parent_id = path[-1].id if path else None
        with self._transaction():
            cur = self._db.execute(
                "INSERT INTO messages (chat_id, role, content, status, stats, created, "
                "parent_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, status, json.dumps(stats or {}), now, parent_id))
            new_id = int(cur.lastrowid or 0)
            self._db.execute("UPDATE chats SET updated=?, leaf_id=? WHERE id=?",
                             (now, new_id, chat_id))
        msg = self.message(new_id)
        assert msg is not None
        return msg

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)

    # -- attachments -------------------------------------------------------------------
    def add_attachment(self, message_id: int, att: Attachment) -> Attachment:
        cur = self._db.execute(
            "INSERT INTO attachments (message_id, name, kind, text, pages, tokens, kv_bytes) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (message_id, att.name, att.kind, att.text, att.pages, att.tokens, att.kv_bytes))
        return Attachment(att.name, att.text, att.kind, att.pages, att.tokens, att.kv_bytes,
                          id=int(cur.lastrowid or 0), message_id=message_id)

    def attachments(self, chat_id: int) -> dict[int, list[Attachment]]:
        """The chat's attachments by message id, in the order they were added."""
        rows = self._db.execute(
            "SELECT a.* FROM attachments a JOIN messages m ON m.id = a.message_id "
            "WHERE m.chat_id=? ORDER BY a.id", (chat_id,))
        out: dict[int, list[Attachment]] = {}
        for r in rows:
            out.setdefault(int(r["message_id"]), []).append(Attachment(
                name=r["name"], text=r["text"], kind=r["kind"], pages=r["pages"],
                tokens=r["tokens"], kv_bytes=r["kv_bytes"], id=r["id"],
                message_id=r["message_id"]))
        return out

    # -- presets -----------------------------------------------------------------------
    def presets(self) -> list[Preset]:
        rows = self._db.execute("SELECT * FROM presets ORDER BY name COLLATE NOCASE")
        return [Preset(r["name"], r["system_prompt"], Sampling.from_json(r["sampling"]))
                for r in rows]

    def preset(self, name: str) -> Preset | None:
        return next((p for p in self.presets() if p.name == name), None)

    def save_preset(self, preset: Preset) -> None:
        self._db.execute(
            "INSERT INTO presets (name, system_prompt, sampling, updated) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET system_prompt=excluded.system_prompt, "
            "sampling=excluded.sampling, updated=excluded.updated",
            (preset.name, preset.system_prompt, preset.sampling.to_json(), time.time()))

    def delete_preset(self, name: str) -> None:
        self._db.execute("DELETE FROM presets WHERE name=?", (name,))

    # -- search ------------------------------------------------------------------------
    def search(self, query: str, limit: int = 200) -> list[SearchHit]:
        """Chats whose title or any message (any branch) holds `query`, case-insensitively
        (ASCII case, as SQLite's LIKE), newest chat first; one hit per message."""
        q = query.strip()
        if not q:
            return []
        escaped = q.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        pattern = f"%{escaped}%"
        hits: list[SearchHit] = []
        for r in self._db.execute(
                "SELECT id, title FROM chats WHERE title LIKE ? ESCAPE '\\' "
                "ORDER BY updated DESC, id DESC", (pattern,)):
            hits.append(SearchHit(r["id"], r["title"], None, r["title"]))
        for r in self._db.execute(
                "SELECT m.id, m.chat_id, m.content, c.title FROM messages m "
                "JOIN chats c ON c.id = m.chat_id WHERE m.content LIKE ? ESCAPE '\\' "
                "ORDER BY c.updated DESC, c.id DESC, m.id LIMIT ?", (pattern, limit)):
            hits.append(SearchHit(r["chat_id"], r["title"], r["id"],
                                  _snippet(r["content"], q)))
        return hits[:limit]

    # -- export and import -------------------------------------------------------------
    def export_chat(self, chat_id: int) -> dict[str, Any]:
        """The whole chat (every branch, attachments, which branch it shows) as JSON data."""
        chat = self.chat(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        messages = self.all_messages(chat_id)
        index = {m.id: i for i, m in enumerate(messages)}
        attachments = self.attachments(chat_id)
        shown = self.messages(chat_id)
        return {
            "format": EXPORT_FORMAT, "version": EXPORT_VERSION, "title": chat.title,
            "system_prompt": chat.system_prompt, "model": chat.model,
            "sampling": json.loads(chat.sampling.to_json()), "created": chat.created,
            "updated": chat.updated, "leaf": index[shown[-1].id] if shown else None,
            "messages": [{
                "parent": index.get(m.parent_id) if m.parent_id is not None else None,
                "role": m.role, "content": m.content, "status": m.status, "stats": m.stats,
                "created": m.created,
                "attachments": [a.as_dict() for a in attachments.get(m.id, [])],
            } for m in messages],
        }

    def import_chat(self, data: Any, source: str = "the chat file") -> Chat:
        """A new chat from `export_chat`'s data; ChatFileError naming `source` if it is not."""
        try:
            if not isinstance(data, dict) or data.get("format") != EXPORT_FORMAT:
                raise ChatFileError(f"{source}: is not a Strata chat export")
            if int(data.get("version", 0)) > EXPORT_VERSION:
                raise ChatFileError(f"{source}: was written by a newer Strata (chat format "
                                    f"{data['version']}, this one reads {EXPORT_VERSION})")
            raw = list(data.get("messages") or [])
            with self._transaction():
                now = time.time()
                cur = self._db.execute(
                    "INSERT INTO chats (title, system_prompt, model, sampling, created, "
                    "updated) VALUES (?, ?, ?, ?, ?, ?)",
                    (str(data.get("title") or DEFAULT_TITLE), str(data.get("system_prompt", "")),
                     str(data.get("model", "")),
                     Sampling.from_json(json.dumps(data.get("sampling") or {})).to_json(),
                     float(data.get("created", now)), float(data.get("updated", now))))
                chat_id = int(cur.lastrowid or 0)
                ids: list[int] = []
                for i, m in enumerate(raw):
                    parent = m.get("parent")
                    if parent is not None and not 0 <= int(parent) < i:
                        raise ChatFileError(f"{source}: message {i} has parent {parent}, "
                                            "not an earlier message")
                    role, status = str(m["role"]), str(m.get("status", "complete"))
                    if role not in ("system", "user", "assistant") or status not in STATUSES:
                        raise ChatFileError(f"{source}: message {i} has role {role!r}, "
                                            f"status {status!r}")
                    cur = self._db.execute(
                        "INSERT INTO messages (chat_id, role, content, status, stats, created, "
                        "parent_id) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (chat_id, role, str(m.get("content", "")),
                         "interrupted" if status == "streaming" else status,
                         json.dumps(m.get("stats") or {}), float(m.get("created", now)),
                         ids[int(parent)] if parent is not None else None))
                    ids.append(int(cur.lastrowid or 0))
                    for a in m.get("attachments") or []:
                        self.add_attachment(ids[-1], Attachment(
                            name=str(a["name"]), text=str(a["text"]),
                            kind=str(a.get("kind", "text")), pages=int(a.get("pages", 1)),
                            tokens=int(a.get("tokens", 0)), kv_bytes=int(a.get("kv_bytes", 0))))
                leaf = data.get("leaf")
                if ids:
                    self.set_leaf(chat_id, ids[int(leaf)] if leaf is not None
                                  and 0 <= int(leaf) < len(ids) else ids[-1])
        except ChatFileError:
            raise
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ChatFileError(f"{source}: is not a valid Strata chat export "
                                f"({type(exc).__name__}: {exc})") from exc
        chat = self.chat(chat_id)
        assert chat is not None
        return chat

    def chat_markdown(self, chat_id: int) -> str:
        """The branch the chat shows, as Markdown (attachments named, not inlined)."""
        chat = self.chat(chat_id)
        if chat is None:
            raise KeyError(chat_id)
        attachments = self.attachments(chat_id)
        s = chat.sampling
        out = [f"# {chat.title}", "",
               f"*Strata chat · model {chat.model or 'default'} · temperature {s.temperature:g}"
               f", top-p {s.top_p:g}, max tokens {s.max_tokens} · "
               f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(chat.created))}*", ""]
        if chat.system_prompt.strip():
            out += ["**System prompt:**", "", *("> " + line for line in
                                                 chat.system_prompt.splitlines()), ""]
        names = {"user": "You", "assistant": "Assistant", "system": "System"}
        for m in self.messages(chat_id):
            title = names.get(m.role, m.role)
            if m.role == "assistant" and m.stats.get("model"):
                title += f" ({m.stats['model']})"
            out += [f"## {title}", ""]
            for a in attachments.get(m.id, []):
                out.append(f"> Attached: **{a.name}** ({a.pages} page{'s' * (a.pages != 1)}, "
                           f"{a.tokens:,} tokens)")
                out.append("")
            out += [m.content.rstrip(), ""]
            if m.status == "interrupted":
                out += ["*(interrupted)*", ""]
        return "\n".join(out).rstrip() + "\n"

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


class _Transaction:
    """BEGIN .. COMMIT on an autocommit connection; ROLLBACK if the block raises."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, _exc: object, _tb: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")


def _snippet(text: str, query: str, width: int = 80) -> str:
    """The part of `text` around the first match of `query`, on one line."""
    at = text.lower().find(query.lower())
    start = max(0, at - width // 3) if at >= 0 else 0
    piece = " ".join(text[start:start + width].split())
    return ("…" if start else "") + piece + ("…" if start + width < len(text) else "")


def _chat(row: sqlite3.Row) -> Chat:
    return Chat(id=row["id"], title=row["title"], system_prompt=row["system_prompt"],
                model=row["model"], sampling=Sampling.from_json(row["sampling"]),
                created=row["created"], updated=row["updated"], leaf_id=row["leaf_id"])


def _message(row: sqlite3.Row) -> Message:
    try:
        stats = json.loads(row["stats"] or "{}")
    except ValueError:
        stats = {}
    return Message(id=row["id"], chat_id=row["chat_id"], role=row["role"],
                   content=row["content"], status=row["status"], stats=stats,
                   created=row["created"], parent_id=row["parent_id"])
