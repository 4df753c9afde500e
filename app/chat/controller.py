"""The chat screen's logic: store, engine and view joined; streaming replies coalesced.

Contract: one reply streams at a time. Its assistant row is written 'streaming' before the
first token and updated at most every DB_INTERVAL_MS; the view repaints at most every
REPAINT_MS however fast deltas arrive. The reply ends 'complete', or 'interrupted' on Stop
or an engine error, with the text produced so far kept.

Warm system prompts: when a model loads, and when a chat is opened while its model is
loaded, the chat's system prompt is prefilled on the engine thread (`Engine.prewarm`; a cheap
restore when the SSD prefix cache holds it), so its first message prefills only itself.
Engine settings (KV mode and budgets, prefix cache) live in the settings table; they are
sent to the engine at start-up and whenever they are edited.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot

from app.chat.model import ChatListModel
from app.chat.store import DEFAULT_TITLE, Chat, ChatStore, EngineSettings, Sampling
from app.chat.view import ChatView
from app.worker import Engine, ReplyRequest

REPAINT_MS = 50
DB_INTERVAL_MS = 250
EMPTY_NO_CHAT = ("No chat yet.\n\nPress New chat (Ctrl+N), type a message below and press "
                 "Ctrl+Enter.\nDrop a .gguf file or a model folder on the window to add a model.")
EMPTY_CHAT = ("Type a message below and press Ctrl+Enter to send.\n\n"
              "The model, system prompt and sampling settings on the right apply to this chat.")
EMPTY_NO_MODEL = ("No model in the library yet.\n\nThe starter model is being fetched; "
                  "you can also drop a .gguf file or a model folder on the window.")


@dataclass
class _Streaming:
    job: int
    chat_id: int
    message_id: int
    text: str = ""
    last_db_write: float = 0.0
    stopping: bool = False


class ChatController(QObject):
    """Runs the chat screen. `models` and `default_model` come from the library screen."""

    reply_recorded = Signal(int, dict)  # message id, stats
    streaming_changed = Signal(bool)

    def __init__(self, store: ChatStore, engine: Engine, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.engine = engine
        self.chats = ChatListModel(store, self)
        self.view = ChatView(self.chats)
        self.models: list[str] = []
        self.default_model = ""
        self.loaded_model = ""  # the model the engine holds, as its last model_loaded said
        self.current: Chat | None = None
        self.streaming: _Streaming | None = None
        self.repaints = 0  # how many times the streaming reply was redrawn (tests read it)
        self._flush_timer = QTimer(self)
        self._flush_timer.setSingleShot(True)
        self._flush_timer.setInterval(REPAINT_MS)
        self._flush_timer.timeout.connect(self._on_flush_timer_timeout)

        v = self.view
        v.send_requested.connect(self._on_send_requested)
        v.stop_requested.connect(self._on_stop_requested)
        v.new_chat_requested.connect(self._on_new_chat_requested)
        v.chat_selected.connect(self._on_chat_selected)
        v.delete_requested.connect(self._on_delete_requested)
        v.model_chosen.connect(self._on_model_chosen)
        v.system_prompt_edited.connect(self._on_system_prompt_edited)
        v.sampling_edited.connect(self._on_sampling_edited)
        v.engine_settings_edited.connect(self._on_engine_settings_edited)
        v.prefix_clear_requested.connect(self._on_prefix_clear_requested)
        w = self.engine
        w.reply_delta.connect(self._on_reply_delta)
        w.reply_finished.connect(self._on_reply_finished)
        w.error_occurred.connect(self._on_error_occurred)
        w.model_loading.connect(self._on_model_loading)
        w.model_loaded.connect(self._on_model_loaded)
        w.prefix_cleared.connect(self._on_prefix_cleared)

        self.engine_settings = EngineSettings.load(store)
        self.view.show_engine_settings(self.engine_settings)
        self.engine.apply_settings(self.engine_settings.as_dict())  # before the first load

        chats = store.chats()
        if chats:
            self.select(chats[0].id)
        else:
            self._show_current()

    # -- public ----------------------------------------------------------------------------
    def set_models(self, names: list[str], default: str) -> None:
        self.models, self.default_model = names, default
        self.view.set_models(names, self._model_for(self.current))
        self._show_current()

    def select(self, chat_id: int) -> None:
        self.current = self.store.chat(chat_id)
        self.view.select_chat(chat_id)
        self._show_current()
        self.prewarm_current()

    def prewarm_current(self) -> int | None:
        """Prefill the current chat's system prompt if its model is the loaded one; the job."""
        chat = self.current
        if chat is None or not chat.system_prompt.strip() or not self.loaded_model:
            return None
        if self._model_for(chat) != self.loaded_model:
            return None
        return self.engine.prewarm(chat.id, self.loaded_model, chat.system_prompt)

    def set_engine_settings(self, settings: EngineSettings) -> None:
        """Store app-wide engine settings and send them to the engine."""
        self.engine_settings = settings
        settings.save(self.store)
        self.view.show_engine_settings(settings)
        self.engine.apply_settings(settings.as_dict())

    def new_chat(self) -> Chat:
        chat = self.store.create_chat(model=self.default_model)
        self.chats.refresh()
        self.select(chat.id)
        self.view.input.setFocus()
        return chat

    def send(self, text: str) -> int | None:
        """Send `text` in the current chat (a new one if none); the reply's job id or None."""
        if self.streaming is not None or not text.strip():
            return None
        if not self.models:
            self.view.set_status("No model to answer with yet: wait for the starter model "
                                 "or drop a model file on the window.")
            return None
        chat = self.current or self.new_chat()
        history = [{"role": m.role, "content": m.content} for m in self.store.messages(chat.id)
                   if m.role in ("user", "assistant") and m.content]
        self.store.add_message(chat.id, "user", text)
        if chat.title == DEFAULT_TITLE and not history:
            line = text.strip().splitlines()[0]
            self.store.update_chat(chat.id, title=line[:48] + ("…" if len(line) > 48 else ""))
        model = self._model_for(chat)
        reply = self.store.add_message(chat.id, "assistant", "", status="streaming",
                                       stats={"model": model})
        s = chat.sampling
        job = self.engine.reply(ReplyRequest(
            chat_id=chat.id, model=model, text=text, history=history,
            system=chat.system_prompt, temperature=s.temperature, top_p=s.top_p,
            max_tokens=s.max_tokens))
        self.streaming = _Streaming(job, chat.id, reply.id, last_db_write=time.monotonic())
        self.view.input.clear()
        self.view.set_busy(True)
        self.view.set_status("")
        self.chats.refresh()
        self.view.select_chat(chat.id)
        self._show_current()
        self.streaming_changed.emit(True)
        return job

    def stop(self) -> None:
        if self.streaming is not None and not self.streaming.stopping:
            self.streaming.stopping = True
            self.engine.cancel(self.streaming.job)
            self.view.set_status("Stopping…")

    def delete_chat(self, chat_id: int) -> None:
        if self.streaming is not None and self.streaming.chat_id == chat_id:
            self.stop()
        self.store.delete_chat(chat_id)
        self.engine.forget_chat(chat_id)
        self.chats.refresh()
        if self.current is not None and self.current.id == chat_id:
            self.current = None
            first = self.chats.chat_at(0)
            if first is not None:
                self.select(first.id)
                return
        self._show_current()

    def shutdown(self) -> None:
        """The window is closing: keep the unfinished reply, marked interrupted."""
        s = self.streaming
        if s is not None:
            self._flush_timer.stop()
            self.store.update_message(s.message_id, s.text, status="interrupted")
            self.streaming = None

    # -- helpers ---------------------------------------------------------------------------
    def _model_for(self, chat: Chat | None) -> str:
        if chat is not None and chat.model in self.models:
            return chat.model
        return self.default_model

    def _show_current(self) -> None:
        v = self.view
        chat = self.current
        if chat is None:
            v.set_empty_text(EMPTY_NO_CHAT if self.models else EMPTY_NO_MODEL)
            v.show_settings("", Sampling())
            v.settings_panel.setEnabled(False)
            return
        v.settings_panel.setEnabled(True)
        v.show_settings(chat.system_prompt, chat.sampling)
        v.set_models(self.models, self._model_for(chat))
        messages = self.store.messages(chat.id)
        if not messages:
            v.set_empty_text(EMPTY_CHAT if self.models else EMPTY_NO_MODEL)
            return
        v.set_empty_text("")
        s = self.streaming
        streaming_id = s.message_id if s is not None and s.chat_id == chat.id else None
        v.messages.set_messages(messages, streaming_id)
        if s is not None and streaming_id is not None:
            v.messages.update_stream(s.text)

    def _end_stream(self, status: str, stats: dict[str, Any]) -> None:
        s = self.streaming
        assert s is not None
        self._flush_timer.stop()
        self.store.update_message(s.message_id, s.text, status=status, stats=stats)
        self.streaming = None
        self.view.set_busy(False)
        if self.current is not None and self.current.id == s.chat_id:
            self._show_current()
        self.streaming_changed.emit(False)

    # -- slots: view -----------------------------------------------------------------------
    @Slot(str)
    def _on_send_requested(self, text: str) -> None:
        self.send(text)

    @Slot()
    def _on_stop_requested(self) -> None:
        self.stop()

    @Slot()
    def _on_new_chat_requested(self) -> None:
        self.new_chat()

    @Slot(int)
    def _on_chat_selected(self, chat_id: int) -> None:
        if self.current is None or self.current.id != chat_id:
            self.current = self.store.chat(chat_id)
            self._show_current()
            self.prewarm_current()

    @Slot()
    def _on_prefix_clear_requested(self) -> None:
        self.view.set_status("Clearing the prefix cache…")
        self.engine.clear_prefix_cache()

    @Slot(int, dict)
    def _on_prefix_cleared(self, _job: int, info: dict[str, Any]) -> None:
        self.view.set_status(f"Prefix cache cleared: {info['runs']} stored prefixes, "
                             f"{info['bytes'] / 2**20:.1f} MB freed on the disk.")

    @Slot(object)
    def _on_engine_settings_edited(self, settings: EngineSettings) -> None:
        if settings != self.engine_settings:
            self.set_engine_settings(settings)

    @Slot(int)
    def _on_delete_requested(self, chat_id: int) -> None:
        self.delete_chat(chat_id)

    @Slot(str)
    def _on_model_chosen(self, name: str) -> None:
        if self.current is not None:
            self.store.update_chat(self.current.id, model=name)
            self.current = self.store.chat(self.current.id)
        self.engine.load(name)  # warm it now rather than on the first message

    @Slot(str)
    def _on_system_prompt_edited(self, text: str) -> None:
        if self.current is not None:
            self.store.update_chat(self.current.id, system_prompt=text)
            self.current = self.store.chat(self.current.id)

    @Slot(object)
    def _on_sampling_edited(self, sampling: Sampling) -> None:
        if self.current is not None:
            self.store.update_chat(self.current.id, sampling=sampling)
            self.current = self.store.chat(self.current.id)

    # -- slots: engine ---------------------------------------------------------------------
    @Slot(int, str)
    def _on_reply_delta(self, job: int, text: str) -> None:
        s = self.streaming
        if s is None or s.job != job:
            return
        s.text += text
        if not self._flush_timer.isActive():
            self._flush_timer.start()

    @Slot()
    def _on_flush_timer_timeout(self) -> None:
        s = self.streaming
        if s is None:
            return
        if self.current is not None and self.current.id == s.chat_id:
            self.view.messages.update_stream(s.text)
            self.repaints += 1
        now = time.monotonic()
        if now - s.last_db_write >= DB_INTERVAL_MS / 1000:
            self.store.update_message(s.message_id, s.text)
            s.last_db_write = now

    @Slot(int, dict)
    def _on_reply_finished(self, job: int, stats: dict[str, Any]) -> None:
        s = self.streaming
        if s is None or s.job != job:
            return
        cancelled = stats.get("finish_reason") == "cancelled"
        message_id = s.message_id
        self._end_stream("interrupted" if cancelled else "complete", stats)
        self.view.set_status("Stopped." if cancelled else "")
        self.reply_recorded.emit(message_id, stats)

    @Slot(int, str, str)
    def _on_error_occurred(self, job: int, what: str, message: str) -> None:
        s = self.streaming
        if s is None or s.job != job:
            return
        self._end_stream("interrupted", {"model": self._model_for(self.current),
                                         "error": message})
        self.view.set_status(f"The reply stopped: {message}")

    @Slot(str)
    def _on_model_loading(self, name: str) -> None:
        self.loaded_model = ""
        if self.streaming is not None:
            self.view.messages.update_stream(self.streaming.text, f"loading {name}…")

    @Slot(dict)
    def _on_model_loaded(self, info: dict[str, Any]) -> None:
        self.loaded_model = str(info["name"])
        if self.streaming is not None:
            self.view.messages.update_stream(self.streaming.text, "generating…")
        else:
            self.prewarm_current()
