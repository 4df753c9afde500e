"""KV bits in the app's engine settings: offered for the paged modes, stored, applied to the
engine, and the memory panel's KV figure is the quantized pages' size."""

from __future__ import annotations

from typing import Any

from app.chat.store import EngineSettings, Sampling
from tests.app.conftest import LOAD_TIMEOUT_MS, REPLY_TIMEOUT_MS, WindowFactory

SYSTEM = "You answer geography questions in one short sentence. " * 12


def _choose(view: Any, combo: Any, data: Any) -> None:
    combo.setCurrentIndex(combo.findData(data))
    combo.activated.emit(combo.currentIndex())


def test_kv_bits_are_offered_stored_and_applied(make_window: WindowFactory, qtbot: Any
                                                ) -> None:
    window = make_window()
    qtbot.waitUntil(lambda: window.is_ready, timeout=LOAD_TIMEOUT_MS)
    view = window.chat.view
    assert view.kv_bits.accessibleName() == "KV precision"
    assert view.kv_bits.isEnabled()  # the default KV mode (exact) pages: bits apply
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS):
        _choose(view, view.kv_mode, "mlx")
    assert not view.kv_bits.isEnabled()  # mlx-lm's cache: 16-bit only
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS):
        _choose(view, view.kv_mode, "exact")
    assert view.kv_bits.isEnabled()
    with qtbot.waitSignal(window.engine.settings_applied, timeout=LOAD_TIMEOUT_MS) as applied:
        _choose(view, view.kv_bits, 8)
    assert applied.args[0]["kv_bits"] == 8
    assert EngineSettings.load(window.store).kv_bits == 8
    chat = window.chat.new_chat()
    window.store.update_chat(chat.id, system_prompt=SYSTEM,
                             sampling=Sampling(temperature=0.0, max_tokens=8))
    window.chat.select(chat.id)
    with qtbot.waitSignal(window.engine.reply_finished, timeout=REPLY_TIMEOUT_MS) as done:
        window.chat.send("What is the capital of France?")
    assert done.args[1]["generated_tokens"] > 0
    worker = window.engine.worker
    lm = worker.pool.lm
    assert lm is not None and (lm.kv_settings.mode, lm.kv_settings.bits) == ("exact", 8)
    # The chat's pages are stored at 8 bits, and RAM is counted at that size.
    session = worker.pool.sessions[chat.id]
    cache = session.cache
    store = cache.cache[0].store
    assert store.codec.bits == 8 and store.tables[0].n_pages >= 1
    assert store.page_bytes == 2 * store.kv_heads * store.P * (store.head_dim + 8)
    tails = sum(2 * int(c.tail_k.nbytes) for c in cache.cache if c.tail_k is not None)
    assert cache.nbytes == store.stats()["pages_ram"] * store.page_bytes + tails
    # A restart reads the stored precision back into the view.
    again = make_window(db=window.store.path, preload=False, fetch_starter=False)
    assert again.chat.view.engine_settings().kv_bits == 8
    assert again.chat.view.kv_bits.currentData() == 8
