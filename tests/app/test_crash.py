"""A kill during a reply keeps the text already written, marked interrupted (real process)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from app.chat.store import ChatStore
from tests.conftest import REPO


def test_sigkill_mid_reply_leaves_an_interrupted_partial_message(
        starter: dict[str, Any], strata_home: Path, tmp_path: Path) -> None:
    db = tmp_path / "chats.sqlite3"
    env = dict(os.environ, STRATA_HOME=str(strata_home), QT_QPA_PLATFORM="offscreen")
    child = subprocess.Popen([sys.executable, "-m", "tests.app.crash_child", str(db)],
                             cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child reports (or dies)
        assert line.startswith("STREAMING "), f"child said {line!r}, rc={child.poll()}"
        message_id = int(line.split()[1])
        before_kill = sqlite_content(db, message_id)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()

    store = ChatStore(db)
    assert store.recovered == 1
    message = store.message(message_id)
    assert message is not None
    assert message.status == "interrupted"
    assert message.content.startswith(before_kill)
    assert len(message.content) > 20
    user = store.messages(message.chat_id)[0]
    assert user.role == "user" and "lighthouse" in user.content
    store.close()


def sqlite_content(db: Path, message_id: int) -> str:
    import sqlite3

    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT content, status FROM messages WHERE id=?",
                           (message_id,)).fetchone()
    assert row[1] == "streaming"
    return str(row[0])
