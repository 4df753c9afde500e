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

Branches: regenerate makes a new reply beside the old one, an edited message a new user
message beside the old one; both stay in the store and the "‹ 1/2 ›" switcher shows either.
Continue streams more of a reply cut short (Stop, an error, the token limit) into the same
row. Documents (attached or dropped) are read and measured on the engine thread, wait as
pending lines (tokens, KV bytes) until the next message, and are stored with it; their text
joins that message's context in every later turn (`context_text`). A send whose context would
not fit in the KV RAM budget (or past the in-memory cache's length guard) while the KV mode is
mlx-lm's in RAM switches the engine settings to the paged cache first, and says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QTimer, Signal, Slot
from PySide6.QtGui import QTextCursor

from app.chat.messages import cut_short
from app.chat.model import ChatListModel
from app.chat.store import (
    DEFAULT_TITLE,
    Attachment,
    Chat,
    ChatFileError,
    ChatStore,
    EngineSettings,
    Message,
    Preset,
    Sampling,
)
from app.chat.view import ChatView
from app.worker import Engine, ReplyRequest

REPAINT_MS = 50
DB_INTERVAL_MS = 250
EMPTY_NO_CHAT = ("No chat yet.\n\nPress New chat (Ctrl+N), type a message below and press "
                 "Ctrl+Enter.\nDrop a .gguf file or a model folder on the window to add a model.")
EMPTY_CHAT = ("Type a message below and press Ctrl+Enter to send.\n\n"
              "The model, system prompt and sampling settings on the right apply to this chat."
              "\n\nDrop a text, Markdown, source or PDF file here (or Attach, Ctrl+Shift+A) to "
              "put it in the context. Ctrl+R regenerates the last reply, Ctrl+Shift+E edits "
              "your last message, Alt+Left and Alt+Right switch between versions.")
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


def context_text(text: str, attachments: list[Attachment]) -> str:
    """A user message as the model reads it: its documents' text first, then the message."""
    if not attachments:
        return text
    docs = "\n\n".join(f"Document {a.name}:\n\n{a.text.strip()}\n\n(end of {a.name})"
                        for a in attachments)
    return f"{docs}\n\n{text}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n < 1e9 else f"{n / 1e9:,.2f} GB"


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
        v.search_edited.connect(self._on_search_edited)
        v.attach_requested.connect(self._on_attach_requested)
        v.attachments_cleared.connect(self._on_attachments_cleared)
        v.regenerate_requested.connect(self._on_regenerate_requested)
        v.edit_requested.connect(self._on_edit_requested)
        v.edit_cancelled.connect(self._on_edit_cancelled)
        v.continue_requested.connect(self._on_continue_requested)
        v.branch_requested.connect(self._on_branch_requested)
        v.export_requested.connect(self._on_export_requested)
        v.import_requested.connect(self._on_import_requested)
        v.preset_chosen.connect(self._on_preset_chosen)
        v.preset_saved.connect(self._on_preset_saved)
        v.preset_deleted.connect(self._on_preset_deleted)
        w = self.engine
        w.reply_delta.connect(self._on_reply_delta)
        w.reply_finished.connect(self._on_reply_finished)
        w.error_occurred.connect(self._on_error_occurred)
        w.model_loading.connect(self._on_model_loading)
        w.model_loaded.connect(self._on_model_loaded)
        w.prefix_cleared.connect(self._on_prefix_cleared)
        w.document_read.connect(self._on_document_read)
        self.editing: int | None = None  # the user message an edit replaces
        self.pending: dict[int, list[dict[str, Any]]] = {}  # chat id (0: none yet) -> docs
        self._doc_jobs: dict[int, int] = {}  # document job -> chat id it was attached to
        self._search = ""
        self._notice = ""  # a line the next reply keeps in the status (the switch to paged KV)
        self.view.set_presets([p.name for p in store.presets()])

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
        """Send `text` in the current chat (a new one if none); the reply's job id or None.
        While editing a message, `text` goes beside it as a new branch."""
        if self.streaming is not None or not text.strip():
            return None
        if not self.models:
            self.view.set_status("No model to answer with yet: wait for the starter model "
                                 "or drop a model file on the window.")
            return None
        docs = self.pending.pop(self.current.id if self.current else 0, [])
        chat = self.current or self.new_chat()
        path = self.store.messages(chat.id)
        edited = self.store.message(self.editing) if self.editing is not None else None
        if edited is not None and edited.chat_id == chat.id:
            cut = next((i for i, m in enumerate(path) if m.id == edited.id), len(path))
            before, parent = path[:cut], edited.parent_id
            carried = self.store.attachments(chat.id).get(edited.id, [])
        else:
            before, parent, carried = path, (path[-1].id if path else None), []
        self._set_editing(None)
        user = self.store.add_message(chat.id, "user", text, parent_id=parent)
        for att in carried:
            self.store.add_attachment(user.id, att)
        for d in docs:
            self.store.add_attachment(user.id, Attachment(
                name=d["name"], text=d["text"], kind=d["kind"], pages=d["pages"],
                tokens=d["tokens"], kv_bytes=d.get("kv_bytes", 0)))
        if chat.title == DEFAULT_TITLE and not before:
            line = text.strip().splitlines()[0]
            self.store.update_chat(chat.id, title=line[:48] + ("…" if len(line) > 48 else ""))
        self._show_pending()
        self._page_if_needed(chat, before, docs, text)
        return self._start_reply(chat, user, before)

    def regenerate(self, message_id: int = 0) -> int | None:
        """A new reply beside `message_id` (0: the last reply shown); the old one stays."""
        found = self._reply_on_path(message_id)
        if found is None:
            return None
        chat, path, reply = found
        user = self.store.message(reply.parent_id) if reply.parent_id is not None else None
        if user is None or user.role != "user":
            self.view.set_status("That reply answers no message: nothing to regenerate.")
            return None
        cut = next(i for i, m in enumerate(path) if m.id == user.id)
        return self._start_reply(chat, user, path[:cut])

    def continue_reply(self, message_id: int = 0) -> int | None:
        """More of a reply cut short (0: the last reply shown), streamed into it."""
        found = self._reply_on_path(message_id)
        if found is None:
            return None
        chat, path, reply = found
        if not cut_short(reply) or not reply.content:
            self.view.set_status("That reply ended on its own: nothing to continue.")
            return None
        user = self.store.message(reply.parent_id) if reply.parent_id is not None else None
        if user is None or user.role != "user":
            return None
        cut = next(i for i, m in enumerate(path) if m.id == user.id)
        return self._start_reply(chat, user, path[:cut], reply=reply)

    def edit(self, message_id: int = 0) -> bool:
        """Put a sent message (0: the last one shown) in the input; Send makes a branch."""
        chat = self.current
        if chat is None or self.streaming is not None:
            return False
        path = self.store.messages(chat.id)
        users = [m for m in path if m.role == "user"]
        target = (next((m for m in users if m.id == message_id), None) if message_id
                  else (users[-1] if users else None))
        if target is None:
            return False
        self._set_editing(target.id, target.content)
        return True

    def switch_branch(self, message_id: int, step: int) -> bool:
        """Show the previous (-1) or next (+1) alternative of `message_id` (0: the last
        message shown that has alternatives)."""
        chat = self.current
        if chat is None:
            return False
        if self.streaming is not None and self.streaming.chat_id == chat.id:
            self.view.set_status("Wait for the reply to finish (or Stop it) to switch.")
            return False
        if not message_id:
            branches = self._branches(chat.id)
            shown = [m.id for m in self.store.messages(chat.id)
                     if branches.get(m.id, (0, 1))[1] > 1]
            if not shown:
                return False
            message_id = shown[-1]
        siblings = self.store.siblings(message_id)
        ids = [m.id for m in siblings]
        if message_id not in ids:
            return False
        to = ids.index(message_id) + step
        if not 0 <= to < len(ids):
            return False
        self.store.show_branch(ids[to])
        self._show_current()
        return True

    # -- documents -------------------------------------------------------------------------
    def attach(self, paths: list[str | Path]) -> list[int]:
        """Read and measure documents for the next message of the current chat; the jobs."""
        if not self.models:
            self.view.set_status("No model yet to count a document's tokens with.")
            return []
        key = self.current.id if self.current else 0
        model = self._model_for(self.current)
        jobs = []
        for path in paths:
            job = self.engine.read_document(path, model)
            self._doc_jobs[job] = key
            jobs.append(job)
        names = ", ".join(Path(p).name for p in paths)
        self.view.set_status(f"Reading {names}…")
        return jobs

    def _show_pending(self) -> None:
        docs = self.pending.get(self.current.id if self.current else 0, [])
        lines = []
        for d in docs:
            pages = f"{d['pages']} page{'s' * (d['pages'] != 1)} · " if d["kind"] == "pdf" else ""
            lines.append(f"{d['name']}: {pages}{d['tokens']:,} tokens · "
                         f"{_mb(d.get('kv_bytes', 0))} of KV cache")
        if len(docs) > 1:
            lines.append(f"together {sum(d['tokens'] for d in docs):,} tokens · "
                         f"{_mb(sum(d.get('kv_bytes', 0) for d in docs))} of KV cache")
        self.view.set_attachments(lines)

    def _page_if_needed(self, chat: Chat, before: list[Message], docs: list[dict[str, Any]],
                        text: str) -> None:
        """Switch mlx-lm's in-RAM KV cache to the paged one when this turn's context needs it
        (see the module docstring)."""
        if not docs or self.engine_settings.kv_mode != "mlx":
            return
        figures = docs[-1]
        per_token = float(figures.get("bytes_per_token") or 0.0)
        if not per_token:
            return
        last = next((m for m in reversed(before) if m.role == "assistant" and m.stats), None)
        earlier = (int(last.stats.get("prompt_tokens", 0)) + int(last.stats.get(
            "generated_tokens", 0))) if last is not None else 0
        tokens = earlier + sum(int(d["tokens"]) for d in docs) + len(text) // 3 + \
            chat.sampling.max_tokens
        kv, ram = tokens * per_token, int(figures.get("kv_ram_bytes") or 0)
        context = int(figures.get("context_length") or 0)
        if (ram and kv > ram) or (context and tokens > 4 * context):
            self.set_engine_settings(replace(self.engine_settings, kv_mode="exact"))
            self._notice = (
                f"This chat's context (about {tokens:,} tokens, {_mb(kv)} of KV cache) is past "
                f"the KV RAM budget ({_mb(ram)}): the KV cache is now paged (exact), its "
                "pages spilling to the SSD.")

    # -- export, import, presets -----------------------------------------------------------
    def export_chat(self, path: str | Path, chat_id: int | None = None) -> bool:
        """Write a chat (default: the current one) to `path`: .json (every branch, imports
        again) or Markdown (the branch shown)."""
        chat_id = chat_id if chat_id is not None else (self.current.id if self.current else 0)
        if not chat_id:
            self.view.set_status("No chat to export.")
            return False
        p = Path(path)
        try:
            if p.suffix.lower() == ".json":
                text = json.dumps(self.store.export_chat(chat_id), ensure_ascii=False,
                                  indent=1) + "\n"
            else:
                text = self.store.chat_markdown(chat_id)
            p.write_text(text, encoding="utf-8")
        except OSError as exc:
            self.view.set_status(f"{p.name}: could not be written ({exc.strerror or exc}).")
            return False
        self.view.set_status(f"Exported to {p}.")
        return True

    def import_chat(self, path: str | Path) -> Chat | None:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
            chat = self.store.import_chat(data, source=p.name)
        except OSError as exc:
            self.view.set_status(f"{p.name}: could not be read ({exc.strerror or exc}).")
            return None
        except UnicodeDecodeError:
            self.view.set_status(f"{p.name}: is not a Strata chat export (not text).")
            return None
        except json.JSONDecodeError as exc:
            self.view.set_status(f"{p.name}: is not JSON (line {exc.lineno}: {exc.msg}).")
            return None
        except ChatFileError as exc:
            self.view.set_status(str(exc))
            return None
        self.chats.refresh()
        self.select(chat.id)
        self.view.set_status(f"Imported “{chat.title}” from {p.name}.")
        return chat

    def apply_preset(self, name: str) -> bool:
        preset = self.store.preset(name)
        if preset is None or self.current is None:
            return False
        self.store.update_chat(self.current.id, system_prompt=preset.system_prompt,
                               sampling=preset.sampling)
        self.current = self.store.chat(self.current.id)
        self._show_current()
        self.view.set_presets([p.name for p in self.store.presets()], name)
        self.prewarm_current()
        return True

    def save_preset(self, name: str) -> bool:
        chat = self.current
        if chat is None or not name.strip():
            return False
        self.store.save_preset(Preset(name.strip(), chat.system_prompt, chat.sampling))
        self.view.set_presets([p.name for p in self.store.presets()], name.strip())
        self.view.set_status(f"Preset “{name.strip()}” saved.")
        return True

    def delete_preset(self, name: str) -> None:
        self.store.delete_preset(name)
        self.view.set_presets([p.name for p in self.store.presets()])

    def search(self, query: str) -> int:
        """Show only the chats holding `query` (title or any message); how many."""
        self._search = query.strip()
        if not self._search:
            self.chats.set_filter(None)
            self._reselect()
            self.view.set_status("")
            return len(self.store.chats())
        snippets: dict[int, str] = {}
        for hit in self.store.search(self._search):
            snippets.setdefault(hit.chat_id, hit.snippet)
        self.chats.set_filter(snippets)
        self._reselect()
        self.view.set_status(f"{len(snippets)} chat{'s' * (len(snippets) != 1)} "
                             f"match “{self._search}”." if snippets else
                             f"No chat holds “{self._search}”.")
        return len(snippets)

    def _reselect(self) -> None:
        if self.current is not None and self.chats.row_of(self.current.id) >= 0:
            self.view.select_chat(self.current.id)
            self._show_current()

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
    def _start_reply(self, chat: Chat, user: Message, before: list[Message],
                     reply: Message | None = None) -> int:
        """Stream a reply to `user` after the turns `before`: a new row under `user`, or more
        of `reply` (continue)."""
        attachments = self.store.attachments(chat.id)
        history = [{"role": m.role,
                    "content": context_text(m.content, attachments.get(m.id, []))}
                   for m in before if m.role in ("user", "assistant") and m.content]
        model = self._model_for(chat)
        if reply is None:
            reply = self.store.add_message(chat.id, "assistant", "", status="streaming",
                                           stats={"model": model}, parent_id=user.id)
            prefix = ""
        else:
            prefix = reply.content
            self.store.update_message(reply.id, prefix, status="streaming")
        s = chat.sampling
        job = self.engine.reply(ReplyRequest(
            chat_id=chat.id, model=model,
            text=context_text(user.content, attachments.get(user.id, [])), history=history,
            system=chat.system_prompt, temperature=s.temperature, top_p=s.top_p,
            max_tokens=s.max_tokens, assistant_prefix=prefix))
        self.streaming = _Streaming(job, chat.id, reply.id, text=prefix,
                                    last_db_write=time.monotonic())
        self.view.input.clear()
        self.view.set_busy(True)
        self.view.set_status(self._notice)
        self.chats.refresh()
        self.view.select_chat(chat.id)
        self.current = self.store.chat(chat.id)
        self._show_current()
        self.streaming_changed.emit(True)
        return job

    def _reply_on_path(self, message_id: int) -> tuple[Chat, list[Message], Message] | None:
        chat = self.current
        if chat is None or self.streaming is not None:
            return None
        if not self.models:
            self.view.set_status("No model to answer with yet.")
            return None
        path = self.store.messages(chat.id)
        replies = [m for m in path if m.role == "assistant"]
        reply = (next((m for m in replies if m.id == message_id), None) if message_id
                 else (replies[-1] if replies else None))
        if reply is None:
            self.view.set_status("No reply to act on in this chat.")
            return None
        return chat, path, reply

    def _set_editing(self, message_id: int | None, text: str = "") -> None:
        self.editing = message_id
        self.view.set_editing(message_id is not None, text)
        if message_id is None and self.view.status_label.text().startswith("Editing"):
            self.view.set_status("")

    def _branches(self, chat_id: int) -> dict[int, tuple[int, int]]:
        """Each message's (index, count) among its alternatives (same parent and role)."""
        groups: dict[tuple[int | None, str], list[int]] = {}
        for m in self.store.all_messages(chat_id):
            groups.setdefault((m.parent_id, m.role), []).append(m.id)
        return {mid: (i, len(ids)) for ids in groups.values() for i, mid in enumerate(ids)}

    def _model_for(self, chat: Chat | None) -> str:
        if chat is not None and chat.model in self.models:
            return chat.model
        return self.default_model

    def _show_current(self) -> None:
        v = self.view
        chat = self.current
        self._show_pending()
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
        v.messages.set_messages(messages, streaming_id, self.store.attachments(chat.id),
                                self._branches(chat.id))
        if s is not None and streaming_id is not None:
            v.messages.update_stream(s.text)
        if self._search:  # the first match of the search in view
            v.messages.moveCursor(QTextCursor.MoveOperation.Start)
            v.messages.find(self._search)

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
            self._set_editing(None)
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

    @Slot(str)
    def _on_search_edited(self, text: str) -> None:
        self.search(text)

    @Slot(list)
    def _on_attach_requested(self, paths: list[str]) -> None:
        self.attach(list(paths))

    @Slot()
    def _on_attachments_cleared(self) -> None:
        self.pending.pop(self.current.id if self.current else 0, None)
        self._show_pending()

    @Slot(int)
    def _on_regenerate_requested(self, message_id: int) -> None:
        self.regenerate(message_id)

    @Slot(int)
    def _on_edit_requested(self, message_id: int) -> None:
        self.edit(message_id)

    @Slot()
    def _on_edit_cancelled(self) -> None:
        self._set_editing(None)
        self.view.input.clear()

    @Slot(int)
    def _on_continue_requested(self, message_id: int) -> None:
        self.continue_reply(message_id)

    @Slot(int, int)
    def _on_branch_requested(self, message_id: int, step: int) -> None:
        self.switch_branch(message_id, step)

    @Slot(str)
    def _on_export_requested(self, path: str) -> None:
        self.export_chat(path)

    @Slot(str)
    def _on_import_requested(self, path: str) -> None:
        self.import_chat(path)

    @Slot(str)
    def _on_preset_chosen(self, name: str) -> None:
        self.apply_preset(name)

    @Slot(str)
    def _on_preset_saved(self, name: str) -> None:
        self.save_preset(name)

    @Slot(str)
    def _on_preset_deleted(self, name: str) -> None:
        self.delete_preset(name)

    # -- slots: engine ---------------------------------------------------------------------
    @Slot(int, dict)
    def _on_document_read(self, job: int, info: dict[str, Any]) -> None:
        key = self._doc_jobs.pop(job, None)
        if key is None:
            return
        self.pending.setdefault(key, []).append(dict(info))
        self._show_pending()
        self.view.set_status(f"{info['name']} attached: its text joins the next message.")
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
        self.view.set_status("Stopped." if cancelled else self._notice)
        self._notice = ""
        self.reply_recorded.emit(message_id, stats)

    @Slot(int, str, str)
    def _on_error_occurred(self, job: int, what: str, message: str) -> None:
        if self._doc_jobs.pop(job, None) is not None:
            self.view.set_status(message)  # one line: the file and the reason
            return
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
