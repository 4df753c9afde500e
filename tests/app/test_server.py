"""Server > Local server: the OpenAI API over the app's own engine thread and caches."""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from app.chat.store import ChatStore, Sampling
from tests.app.conftest import LOAD_TIMEOUT_MS, WindowFactory

SYSTEM = ("You answer questions about harbours for a test of Strata's shared caches. "
          + " ".join(f"Note {i}: keep answers short and mention pier {i} only if asked."
                     for i in range(24)))


def test_the_local_server_shares_the_apps_engine(
        make_window: WindowFactory, starter: dict[str, Any], tmp_path: Any, qtbot: Any) -> None:
    db = tmp_path / "chats.sqlite3"
    store = ChatStore(db)
    store.create_chat(model=starter["name"], system_prompt=SYSTEM,
                      sampling=Sampling(temperature=0.0, max_tokens=8))
    store.set_setting("server_port", "0")  # any free port
    store.close()
    window = make_window(db=db)
    with qtbot.waitSignal(window.engine.prefix_warmed, timeout=LOAD_TIMEOUT_MS):
        pass  # the chat's system prompt went to the SSD prefix cache
    lm = window.engine.worker.pool.lm
    assert lm is not None and lm.prefix_cache is not None
    assert lm.prefix_cache.flush(30)

    assert not window.server_label.isVisible()
    with qtbot.waitSignal(window.server.started, timeout=10_000) as started:
        window.server_action.setChecked(True)
    address = started.args[0]
    assert address.startswith("http://127.0.0.1:") and address.endswith("/v1")
    assert window.server_label.isVisible() and address in window.server_label.text()

    with openai.OpenAI(base_url=address, api_key="none", max_retries=0, timeout=120) as client:
        models = [m.id for m in client.models.list().data]
        assert starter["name"] in models
        reply = client.chat.completions.create(
            model=starter["name"], temperature=0, max_tokens=8,
            messages=[{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # The app's chat warmed this system prompt; the server's first request restores it.
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 128
    host = window.server.host
    assert host is not None
    # The reply reaches the client before the engine thread books the job as finished.
    qtbot.waitUntil(lambda: host.status()["completed"] == 1, timeout=10_000)
    qtbot.waitUntil(lambda: "queue 0" in window.server_label.text(), timeout=10_000)

    with qtbot.waitSignal(window.server.stopped, timeout=10_000):
        window.server_action.setChecked(False)
    assert not window.server_label.isVisible()
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(address + "/models", timeout=5)
