"""The page table of the page store: metadata only, every stored full page by its chain hash.

Contract: `PageTable(folder)` is an SQLite index (`pages.db` in the store folder, WAL, shared
by every process that opens the folder) over the run files: one row per full page on disk
(chain hash, model key, parent hash, depth, the run file and index that hold it, bytes, last
use), one per run file (inode and size: how the table sees a file change under it), the
stored prompts' chain ends, live processes' holds on mapped pages, and the store's counters
(pages asked for, pages found). No tensor goes through it. The files are the truth: `sync`
indexes run files the table does not know (format-4 runs from before the table, runs another
process wrote, runs cut or truncated since) from their headers and drops the rows of files
that are gone, so a kill -9 between a write and its rows costs nothing.

Pages are shared: a prompt whose prefix is stored adds rows for its new pages only (the run
file holds only those). Eviction (`evict`) removes leaf pages (no stored child) least
recently used first, so the stored chains stay prefix-closed, never a page a live process
holds (`hold`: refcount by pid and store, dropped at the store's close or the process's
death), and removes a page by truncating its run file before it (or unlinking the run when it
was its first page). Tails and window files (engine.kv.tail, `.kvw`) compete by their mtime.
The folder functions below (`folder_summary`, `clear_folder`, ...) serve `strata cache` and
the memory panel without a model.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from engine.kv.prefix_format import (
    _CRC,
    _NOFOLLOW,
    _RUN,
    PREFIX_VERSION,
    RUN_MAGIC,
    read_run_head,
)
from engine.kv.settings import SESSION_NAME, SESSIONS_DIR
from engine.kv.tail import SUFFIX as TAIL_SUFFIX
from engine.platform import pid_alive

TABLE_NAME = "pages.db"
LABELS = "labels.json"  # model key (hex) -> the model's name, written by `label`
_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs(name TEXT PRIMARY KEY, key BLOB, ino INTEGER, size INTEGER,
    first INTEGER, n INTEGER, head INTEGER, pbytes INTEGER);
CREATE TABLE IF NOT EXISTS pages(run TEXT, idx INTEGER, hash BLOB, key BLOB, parent BLOB,
    depth INTEGER, bytes INTEGER, used INTEGER, PRIMARY KEY(run, idx));
CREATE INDEX IF NOT EXISTS pages_hash ON pages(hash);
CREATE INDEX IF NOT EXISTS pages_parent ON pages(parent);
CREATE INDEX IF NOT EXISTS pages_used ON pages(used);
CREATE TABLE IF NOT EXISTS prompts(tip BLOB PRIMARY KEY, key BLOB, used INTEGER);
CREATE TABLE IF NOT EXISTS holds(pid INTEGER, token TEXT, run TEXT, ino INTEGER,
    pages INTEGER);
CREATE TABLE IF NOT EXISTS counters(name TEXT PRIMARY KEY, value INTEGER);
"""


def _scan(folder: Path) -> list[tuple[int, int, Path]]:
    """(mtime_ns, size, path) of every stored file: runs, windows, tails."""
    out = []
    with contextlib.suppress(OSError):
        for e in os.scandir(folder):
            if e.name.endswith((".kvp", ".kvw", TAIL_SUFFIX)):
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    out.append((st.st_mtime_ns, st.st_size, Path(e.path)))
    return out


@contextlib.contextmanager
def files_locked(folder: Path) -> Iterator[None]:
    """Hold the folder's advisory lock (every process that opens it): a run file changes and
    its rows follow under it, as one step. Without it a run replaced by another process
    between eviction's inode check and its row update kept a file the rows no longer listed.
    A folder that cannot be opened goes on unlocked (the next `sync` mends the rows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)  # the folder itself: no lock file to leave behind
    except OSError:
        fd = -1
    try:
        if fd >= 0:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # closing drops the lock


def run_header(path: Path) -> tuple[int, int, int, int, bytes, bytes, list[bytes]] | None:
    """A run file's header if it is one of this format that verifies: (inode, size, first
    depth, bytes per page record, parent hash, model key, the hashes of the pages wholly in
    the file); None for anything else (a link is never followed)."""
    h = read_run_head(path)
    if h is None:
        return None
    present = min(h.n, max(0, h.size - h.head) // h.pbytes)
    return h.ino, h.size, h.first, h.pbytes, h.parent, h.key, h.hashes[:present]


def _ino(path: Path) -> int | None:
    try:
        return os.stat(path, follow_symlinks=False).st_ino
    except OSError:
        return None


class PageTable:
    """The folder's page table (one SQLite connection per process, used from any thread)."""

    def __init__(self, folder: Path, lazy: bool = False) -> None:
        """lazy: a table that cannot be opened now (a full disk, a read-only folder) is
        opened again by the next call that needs it; each call raises sqlite3.Error till
        then, which the callers take as "no figures" (storing goes on without them)."""
        self.folder = folder
        self._lock = threading.RLock()
        self._closed = False
        self._conn: sqlite3.Connection | None = None
        try:
            self._open()
        except sqlite3.Error:
            if not lazy:
                raise

    def _open(self) -> sqlite3.Connection:
        if self._conn is not None:
            return self._conn
        if self._closed:
            raise sqlite3.ProgrammingError("the page table is closed")
        db = sqlite3.connect(self.folder / TABLE_NAME, timeout=30, isolation_level=None,
                             check_same_thread=False)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # a lost row is rebuilt by `sync`
            db.executescript(_SCHEMA)
        except sqlite3.Error:
            db.close()
            raise
        self._conn = db
        return db

    @property
    def db(self) -> sqlite3.Connection:
        with self._lock:
            return self._open()

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._closed = True
            if self._conn is not None:
                self._conn.close()

    @contextlib.contextmanager
    def _tx(self) -> Any:
        with self._lock:
            db = self._open()
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    # -- indexing -----------------------------------------------------------------------
    def sync(self, names: Iterable[str] | None = None, used_ns: int | None = None) -> None:
        """Make the rows match the run files (all of them, or `names`): index new or changed
        files from their headers (a page keeps its last use if it had one, else the file's
        mtime, deeper pages slightly older), drop the rows of files that are gone."""
        if names is None:
            files = {p.name: (mt, size) for mt, size, p in _scan(self.folder)
                     if p.suffix == ".kvp"}
        else:
            files = {}
            for name in names:
                with contextlib.suppress(OSError):
                    st = os.stat(self.folder / name, follow_symlinks=False)
                    files[name] = (st.st_mtime_ns, st.st_size)
        with self._tx() as db:
            known = {r[0]: (r[1], r[2]) for r in db.execute("SELECT name, ino, size FROM runs")}
            gone = set(known) - set(files) if names is None else {
                n for n in names if n not in files and n in known}
            for name in gone:
                db.execute("DELETE FROM runs WHERE name=?", (name,))
                db.execute("DELETE FROM pages WHERE run=?", (name,))
            for name, (mtime, size) in files.items():
                old = known.get(name)
                if old is not None and old[1] == size and used_ns is None \
                        and old[0] == _ino(self.folder / name):
                    continue  # unchanged: same size, same file
                head = run_header(self.folder / name)
                if head is not None and old is not None and old == (head[0], head[1]) \
                        and used_ns is None:
                    continue
                uses = {bytes(h): u for h, u in db.execute(
                    "SELECT hash, used FROM pages WHERE run=?", (name,))}
                db.execute("DELETE FROM pages WHERE run=?", (name,))
                if head is None:  # not a run of this format: listed so eviction takes it first
                    db.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                               (name, None, 0, size, 0, 0, 0, 0))
                    continue
                ino, fsize, first, pbytes, parent, key, hashes = head
                hsize = _RUN.size + 32 * len(hashes) + _CRC.size
                db.execute("INSERT OR REPLACE INTO runs VALUES (?,?,?,?,?,?,?,?)",
                           (name, key, ino, fsize, first, len(hashes), hsize, pbytes))
                t = used_ns if used_ns is not None else mtime
                rows = []
                for i, h in enumerate(hashes):
                    rows.append((name, i, h, key, hashes[i - 1] if i else parent, first + i,
                                 pbytes, uses.get(h, t - 1000 * i)))
                db.executemany("INSERT INTO pages VALUES (?,?,?,?,?,?,?,?)", rows)

    def touch(self, hashes: list[bytes], now: int | None = None) -> None:
        """Mark a chain's pages used now; deeper ones look slightly older (ties go to leaves)."""
        if not hashes:
            return
        t = time.time_ns() if now is None else now
        with self._tx() as db:
            db.executemany("UPDATE pages SET used=? WHERE hash=?",
                           [(t - 1000 * i, h) for i, h in enumerate(hashes)])

    def note_prompt(self, key: bytes, tip: bytes) -> None:
        """A stored prompt's chain ends at page `tip` (what `shared` counts references by)."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO prompts VALUES (?,?,?)",
                       (tip, key, time.time_ns()))

    def count(self, asked: int, found: int) -> None:
        """Add to the store's counters: pages prompts asked for, pages found stored."""
        if not asked and not found:
            return
        with self._tx() as db:
            for name, v in (("asked", asked), ("found", found)):
                db.execute("INSERT INTO counters VALUES (?, ?) ON CONFLICT(name) DO UPDATE "
                           "SET value = value + excluded.value", (name, v))

    # -- holds (reference counts of live sessions) --------------------------------------
    def hold(self, token: str, run: str, ino: int, pages: int) -> None:
        """A live store maps the first `pages` pages of `run`: eviction leaves them alone
        until `release(token)` or this process's death."""
        with self._tx() as db:
            db.execute("INSERT INTO holds VALUES (?,?,?,?,?)",
                       (os.getpid(), token, run, ino, pages))

    def release(self, token: str) -> None:
        """Drop a store's holds (from any thread; after `close` through a connection of its
        own: a session may outlive its model's cache)."""
        with contextlib.suppress(sqlite3.Error):
            if self._closed:
                t = PageTable(self.folder)
                try:
                    t.release(token)
                finally:
                    t.close()
                return
            with self._tx() as db:
                db.execute("DELETE FROM holds WHERE pid=? AND token=?", (os.getpid(), token))

    def held(self) -> dict[str, int]:
        """Run name -> pages held from its start by live processes (dead ones' rows go)."""
        with self._lock:
            rows = list(self.db.execute("SELECT DISTINCT pid FROM holds"))
            dead = [pid for (pid,) in rows if pid != os.getpid() and not pid_alive(pid)]
            if dead:
                with self._tx() as db:
                    db.executemany("DELETE FROM holds WHERE pid=?", [(p,) for p in dead])
            out: dict[str, int] = {}
            for run, pages in self.db.execute("SELECT run, MAX(pages) FROM holds GROUP BY run"):
                out[run] = int(pages)
            return out

    # -- eviction -----------------------------------------------------------------------
    def evict(self, budget: int, on_page: Callable[[str], None] | None = None
              ) -> tuple[int, int]:
        """Bring the stored files down to `budget` bytes: files of no known format first,
        then the least recently used of leaf pages (never a held one), tails and window
        files; returns (pages, runs) removed. A window file whose page is gone goes too."""
        self.sync()
        entries = _scan(self.folder)
        total = sum(size for _, size, _ in entries)
        if total <= budget:
            return 0, 0
        pages = runs = 0
        with self._lock:
            for (name,) in list(self.db.execute("SELECT name FROM runs WHERE key IS NULL")):
                if total <= budget:
                    break
                path = self.folder / name
                with contextlib.suppress(OSError):
                    total -= path.stat().st_size
                    path.unlink()
                self.sync([name])
        held = self.held()
        # Tails and windows by mtime, oldest first; pages by the table's LRU.
        others = sorted((mt, size, p) for mt, size, p in entries if p.suffix != ".kvp")
        skip: set[tuple[str, int]] = set()
        garbage: list[Any] = []
        while total > budget or garbage:
            if not garbage:
                self._drop_orphan_windows()
                garbage = [x for x in self._garbage() if (x[0], x[1]) not in skip
                           and x[1] >= held.get(x[0], 0)]
            if garbage:  # pages no lookup can use: before any page that one could
                run, idx, _used, pbytes, ino, head = garbage.pop(0)
                if self._drop(run, idx, ino, head, pbytes):
                    total -= pbytes + (head if idx == 0 else 0)
                    pages += 1
                    runs += idx == 0
                else:
                    skip.add((run, idx))
                if not garbage:
                    garbage = [x for x in self._garbage() if (x[0], x[1]) not in skip
                               and x[1] >= held.get(x[0], 0)]
                continue
            if total <= budget:
                break
            with self._lock:
                leaf = self.db.execute(
                    "SELECT p.run, p.idx, p.used, p.bytes, r.ino, r.head FROM pages p "
                    "JOIN runs r ON r.name = p.run WHERE NOT EXISTS (SELECT 1 FROM pages c "
                    "WHERE c.parent = p.hash) AND p.idx = r.n - 1 AND p.idx >= "
                    "COALESCE((SELECT MAX(h.pages) FROM holds h WHERE h.run = p.run), 0) "
                    "ORDER BY p.used LIMIT 64").fetchall()
            leaf = [x for x in leaf if (x[0], x[1]) not in skip
                    and x[1] >= held.get(x[0], 0)]
            if others and (not leaf or others[0][0] <= leaf[0][2]):
                _mt, size, path = others.pop(0)
                with contextlib.suppress(OSError):
                    path.unlink()
                total -= size
                continue
            if not leaf:
                break  # everything left is held by a live session
            run, idx, _used, pbytes, ino, head = leaf[0]
            if not self._drop(run, idx, ino, head, pbytes):
                skip.add((run, idx))
                continue
            total -= pbytes + (head if idx == 0 else 0)
            pages += 1
            runs += idx == 0
            if on_page is not None:
                on_page(run)
        self._drop_orphan_windows()
        return pages, runs

    def _garbage(self) -> list[Any]:
        """Leaf pages of a sliding-window model (a key with window files) that have no
        window file: a lookup ends at the deepest page with its window, so these pages can
        never be restored (a chain's window left with its last page)."""
        windows = set()
        for _, _, p in _scan(self.folder):
            if p.suffix == ".kvw":
                with contextlib.suppress(ValueError):
                    windows.add(bytes.fromhex(p.stem))
        with self._lock:
            rows = self.db.execute(
                "SELECT p.run, p.idx, p.used, p.bytes, r.ino, r.head, p.hash, p.key "
                "FROM pages p JOIN runs r ON r.name = p.run WHERE NOT EXISTS (SELECT 1 "
                "FROM pages c WHERE c.parent = p.hash) AND p.idx = r.n - 1 "
                "ORDER BY p.used").fetchall()
            keys = {bytes(k) for (h, k) in self.db.execute("SELECT hash, key FROM pages")
                    if bytes(h) in windows}
        return [x[:6] for x in rows if bytes(x[7]) in keys and bytes(x[6]) not in windows]

    def _drop(self, run: str, idx: int, ino: int, head: int, pbytes: int) -> bool:
        """Remove page `idx` (the last) of `run`: truncate the file before it, or unlink it
        when it is the first. Only the file the table indexed (same inode) is touched."""
        with files_locked(self.folder):
            return self._drop_locked(run, idx, ino, head, pbytes)

    def _drop_locked(self, run: str, idx: int, ino: int, head: int, pbytes: int) -> bool:
        path = self.folder / run
        try:
            fd = os.open(path, os.O_WRONLY | _NOFOLLOW)
        except OSError:
            self.sync([run])
            return False
        try:
            h = read_run_head(path)
            # ext4 gives a freed inode to the next new file, so a run replaced since the
            # caller's query can carry its inode: the file's own layout must be the one the
            # table listed (the same header, `idx` its last whole page), or it is left alone.
            if os.fstat(fd).st_ino != ino or h is None or h.ino != ino or h.head != head \
                    or h.pbytes != pbytes or (h.size - head) // pbytes != idx + 1:
                self.sync([run])
                return False
            if idx == 0:
                path.unlink()
            else:
                os.ftruncate(fd, head + idx * pbytes)
        except OSError:
            return False
        finally:
            os.close(fd)
        with self._tx() as db:
            db.execute("DELETE FROM pages WHERE run=? AND idx>=?", (run, idx))
            if idx == 0:
                db.execute("DELETE FROM runs WHERE name=?", (run,))
            else:
                db.execute("UPDATE runs SET n=?, size=? WHERE name=?",
                           (idx, head + idx * pbytes, run))
        return True

    def _drop_orphan_windows(self) -> None:
        """Window files whose page is no longer stored: no lookup can reach them."""
        with self._lock:
            stored = {bytes(h) for (h,) in self.db.execute("SELECT hash FROM pages")}
        for _, _, p in _scan(self.folder):
            if p.suffix != ".kvw":
                continue
            try:
                h = bytes.fromhex(p.stem)
            except ValueError:
                h = b""
            if h not in stored:
                with contextlib.suppress(OSError):
                    p.unlink()

    def clear(self) -> None:
        """Forget every page, prompt and counter (the files are removed by the caller)."""
        with self._tx() as db:
            for t in ("runs", "pages", "prompts", "counters"):
                db.execute(f"DELETE FROM {t}")

    # -- views --------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Pages, distinct pages, shared pages (on the chains of more than one stored
        prompt), bytes per model key, the counters."""
        self.sync()
        with self._lock:
            rows = list(self.db.execute("SELECT hash, parent, key, bytes FROM pages"))
            tips = [(bytes(t), bytes(k)) for t, k in self.db.execute(
                "SELECT tip, key FROM prompts")]
            counters = dict(self.db.execute("SELECT name, value FROM counters"))
            held = sum(self.held().values())
        parent = {bytes(h): bytes(p) for h, p, _, _ in rows}
        children: set[bytes] = set(parent.values())
        # A chain's end is a stored prompt's tip or a leaf page: each counts as one prompt.
        ends = {t for t, _ in tips if t in parent} | {h for h in parent if h not in children}
        refs: dict[bytes, int] = {}
        for end in ends:
            h: bytes | None = end
            seen = 0
            while h is not None and h in parent and seen <= len(parent):
                refs[h] = refs.get(h, 0) + 1
                h = parent[h]
                seen += 1
        per_key: dict[bytes, dict[str, int]] = {}
        for h, _p, k, b in rows:
            m = per_key.setdefault(bytes(k), {"pages": 0, "shared": 0, "page_bytes": 0})
            m["pages"] += 1
            m["page_bytes"] += int(b)
            m["shared"] += refs.get(bytes(h), 0) > 1
        return {"pages": len(rows), "shared_pages": sum(1 for v in refs.values() if v > 1),
                "prompts": len(ends), "held_pages": held,
                "asked_pages": int(counters.get("asked", 0)),
                "found_pages": int(counters.get("found", 0)), "per_key": per_key}


def sessions_bytes(folder: Path) -> tuple[int, int]:
    """Live sessions' SSD tiers inside a store folder (engine.kv.store): (sessions, bytes).
    A dead process's tier (swept by the next store that opens) does not count."""
    n = total = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(folder / SESSIONS_DIR):
            m = SESSION_NAME.match(e.name)
            if not e.is_dir(follow_symlinks=False) or (m and not pid_alive(int(m.group(1)))):
                continue
            n += 1
            with contextlib.suppress(OSError):
                for f in os.scandir(e.path):
                    with contextlib.suppress(OSError):
                        total += f.stat(follow_symlinks=False).st_size
    return n, total


def session_ram(folder: Path) -> tuple[int, int]:
    """Pages in RAM and bytes of them over live sessions of this folder, as each session's
    store last reported them (`ram.json` in its tier folder; 0 when none says)."""
    pages = nbytes = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(folder / SESSIONS_DIR):
            m = SESSION_NAME.match(e.name)
            if not e.is_dir(follow_symlinks=False) or (m and not pid_alive(int(m.group(1)))):
                continue
            with contextlib.suppress(OSError, ValueError, TypeError):
                doc = json.loads((Path(e.path) / "ram.json").read_text())
                pages += int(doc["pages_ram"])
                nbytes += int(doc["bytes_ram"])
    return pages, nbytes


def folder_summary(folder: Path) -> dict[str, Any]:
    """What a page store folder holds, for `strata cache` and the memory panel: runs, full
    pages, shared pages, tails, window files and bytes, in all and per model (keyed by the
    runs' model key, named from the labels file), the hit rate's counters (pages asked for
    and found since the store was made or cleared), and the live sessions' tiers
    (`sessions`, `session_bytes`, not in `bytes`; `ram_pages`, `ram_bytes` as they last
    reported); files of another format count as `stale`."""
    try:
        labels = json.loads((folder / LABELS).read_text())
    except (OSError, ValueError):
        labels = {}
    total: dict[str, Any] = {"runs": 0, "pages": 0, "tails": 0, "windows": 0, "bytes": 0,
                             "stale_files": 0, "stale_bytes": 0}
    models: dict[str, dict[str, Any]] = {}
    heads: dict[str, bytes] = {}
    for _, size, path in _scan(folder):
        total["bytes"] += size
        if path.suffix == TAIL_SUFFIX:
            total["tails"] += 1
            continue
        if path.suffix == ".kvw":
            total["windows"] += 1
            continue
        head = b""
        with contextlib.suppress(OSError), open(path, "rb") as f:
            head = f.read(_RUN.size)
        if len(head) < _RUN.size or head[:8] != RUN_MAGIC or struct.unpack_from(
                "<H", head, 8)[0] != PREFIX_VERSION:
            total["stale_files"] += 1
            total["stale_bytes"] += size
            continue
        *_, n, pbytes, _parent, key = _RUN.unpack(head)
        pages = min(n, max(0, size - _RUN.size - 32 * n - _CRC.size) // max(1, pbytes))
        m = models.setdefault(key.hex(), {"name": labels.get(key.hex()), "runs": 0,
                                          "pages": 0, "shared_pages": 0, "bytes": 0})
        heads[path.name] = key
        m["runs"] += 1
        m["pages"] += pages
        m["bytes"] += size
        total["runs"] += 1
        total["pages"] += pages
    table: dict[str, Any] = {"shared_pages": 0, "prompts": 0, "held_pages": 0,
                             "asked_pages": 0, "found_pages": 0, "per_key": {}}
    if folder.is_dir() and (total["runs"] or (folder / TABLE_NAME).is_file()):
        with contextlib.suppress(sqlite3.Error, OSError):
            t = PageTable(folder)
            try:
                table = t.summary()
            finally:
                t.close()
    for key, row in table["per_key"].items():
        if key.hex() in models:
            models[key.hex()]["shared_pages"] = row["shared"]
    asked, found = table["asked_pages"], table["found_pages"]
    total.update({"shared_pages": table["shared_pages"], "prompts": table["prompts"],
                  "held_pages": table["held_pages"], "asked_pages": asked,
                  "found_pages": found, "hit_rate": found / asked if asked else None})
    total["models"] = sorted(models.values(), key=lambda m: -m["bytes"])
    total["sessions"], total["session_bytes"] = sessions_bytes(folder)
    total["ram_pages"], total["ram_bytes"] = session_ram(folder)
    return total


def folder_runs(folder: Path) -> tuple[int, int]:
    """How many run files a prefix folder holds and the bytes of everything stored (window
    files included); (0, 0) if it does not exist."""
    entries = _scan(folder)
    return (sum(1 for _, _, p in entries if p.suffix == ".kvp"),
            sum(size for _, size, _ in entries))


def clear_folder(folder: Path) -> tuple[int, int]:
    """Remove every stored file in a page store folder and empty its table (live sessions'
    tiers stay); (files, bytes). A process restoring from a run still reads it through its
    open descriptor."""
    files = removed = 0
    for _, size, path in _scan(folder):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            files += 1
            removed += size
    if (folder / TABLE_NAME).is_file():
        with contextlib.suppress(sqlite3.Error, OSError):
            t = PageTable(folder)
            try:
                t.clear()
            finally:
                t.close()
    return files, removed
