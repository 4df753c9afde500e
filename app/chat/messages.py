"""The message view: a chat's messages as one read-only rich-text document.

Contract: `MessageView.set_messages(messages, streaming_id, attachments, branches)` renders
finished messages once and leaves the streaming one open; `update_stream(text)` redraws only
that reply. Replies are Markdown through app.chat.render. Each message ends in action links
(Copy, Edit, Regenerate, Continue: href `action:id`) and one with alternatives shows a
"‹ 1/2 ›" switcher (href `branch:step:id`); links are reachable with Tab and Enter, and each
click becomes a request signal (`regenerate_requested`, ...) or a clipboard copy here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PySide6.QtCore import QEvent, QUrl, Signal, Slot
from PySide6.QtGui import (
    QDesktopServices,
    QFont,
    QGuiApplication,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
)
from PySide6.QtWidgets import QFrame, QTextBrowser, QWidget

from app.chat.render import RichWriter, split_reasoning
from app.chat.store import Attachment, Message
from app.format import reply_stats_line

ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System"}


def draft_stats(stats: Mapping[str, Any]) -> str:
    """'12/20 drafted tokens kept' for a reply that drafted (speculative decoding), else ''."""
    drafted = int(stats.get("drafted_tokens") or 0)
    if drafted <= 0:
        return ""
    accepted = int(stats.get("accepted_tokens") or 0)
    return f"{accepted}/{drafted} drafted tokens kept"


def cut_short(message: Message) -> bool:
    """A reply that stopped before its end: Stop, an error, or the token limit."""
    return message.role == "assistant" and (
        message.status == "interrupted" or message.stats.get("finish_reason") == "length")


class MessageView(QTextBrowser):
    """A read-only document of messages; the last one may be streaming.

    Replies are Markdown (app.chat.render: tables, highlighted code with a Copy link per block,
    reasoning folded). Each message ends in action links (Copy, Edit, Regenerate, Continue) and
    one with alternatives shows a "‹ 1/2 ›" switcher; links are reachable with Tab and Enter.
    """

    regenerate_requested = Signal(int)  # assistant message id
    edit_requested = Signal(int)  # user message id
    continue_requested = Signal(int)  # assistant message id
    branch_requested = Signal(int, int)  # message id, step (-1: previous, +1: next)
    copied = Signal(str)  # what was copied, for the status line

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setAccessibleName("Messages")
        self.setOpenLinks(False)  # ours: actions and copy links; web links go to the browser
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.document().setDocumentMargin(16)
        self.writer = RichWriter(self.palette(), self.font().pointSizeF())
        self._stream_pos: int | None = None
        self._stream_codes = 0
        self._stream_status = ""
        self._stream_text = ""
        self._messages: list[Message] = []
        self._attachments: dict[int, list[Attachment]] = {}
        self._branches: dict[int, tuple[int, int]] = {}
        self._streaming_id: int | None = None
        self._expanded: set[int] = set()  # messages whose reasoning is unfolded
        self.anchorClicked.connect(self._on_anchor_clicked)

    def changeEvent(self, event: QEvent) -> None:
        super().changeEvent(event)
        if event.type() == QEvent.Type.PaletteChange:  # light and dark code styles
            self.writer = RichWriter(self.palette(), self.font().pointSizeF())
            if self._messages:
                self._render()

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_bottom(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _new_block(self, cursor: QTextCursor, top: float = 0.0) -> None:
        block = QTextBlockFormat()
        block.setTopMargin(top)
        if cursor.block().length() <= 1 and cursor.positionInBlock() == 0:
            cursor.setBlockFormat(block)  # the empty block after a frame, or the first one
            cursor.setCharFormat(QTextCharFormat())
        else:
            cursor.insertBlock(block, QTextCharFormat())

    def _insert_header(self, cursor: QTextCursor, message: Message, model: str) -> None:
        self._new_block(cursor, top=14.0)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        cursor.insertText(ROLE_NAMES.get(message.role, message.role), fmt)
        if message.role == "assistant" and model:
            cursor.insertText(f"  {model}", self.writer.muted())
        index, count = self._branches.get(message.id, (0, 1))
        if count > 1:
            muted = self.writer.muted()
            cursor.insertText("    ", muted)
            cursor.insertText("‹", self.writer.link(f"branch:-1:{message.id}", 0.0))
            cursor.insertText(f" {index + 1}/{count} ", muted)
            cursor.insertText("›", self.writer.link(f"branch:1:{message.id}", 0.0))

    def _insert_reply(self, cursor: QTextCursor, message_id: int, text: str,
                      streaming: bool) -> None:
        """A reply's reasoning (folded unless opened) and its answer as rich Markdown."""
        parts = split_reasoning(text)
        if parts.thought or parts.open:
            self._new_block(cursor, top=2.0)
            opened = message_id in self._expanded
            label = ("Thinking…" if parts.open and streaming else "Reasoning")
            cursor.insertText(f"{'▾' if opened else '▸'} {label} ({parts.words} words)",
                              self.writer.link(f"think:{message_id}", -0.5))
            if opened:
                block = QTextBlockFormat()
                block.setLeftMargin(14)
                block.setTopMargin(2)
                for line in parts.thought.splitlines() or [""]:
                    cursor.insertBlock(block, QTextCharFormat())
                    cursor.insertText(line, self.writer.muted())
        if parts.answer or not (parts.thought or parts.open):
            self._new_block(cursor, top=4.0)
            self.writer.write(cursor, parts.answer)

    def _insert_body(self, cursor: QTextCursor, message: Message) -> None:
        self._new_block(cursor, top=4.0)
        for att in self._attachments.get(message.id, []):
            pages = (f"{att.pages} page{'s' * (att.pages != 1)} · " if att.kind == "pdf"
                     else "")
            kv = f" · {att.kv_bytes / 1e6:,.1f} MB of KV cache" if att.kv_bytes else ""
            cursor.insertText(f"Attached: {att.name} · {pages}{att.tokens:,} tokens{kv}",
                              self.writer.muted())
            cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        if message.role == "assistant":
            self._insert_reply(cursor, message.id, message.content, streaming=False)
        else:
            cursor.insertText(message.content)

    def _insert_footer(self, cursor: QTextCursor, message: Message | None, text: str) -> None:
        actions: list[tuple[str, str]] = []
        if message is not None:
            actions.append(("Copy", f"copy:{message.id}"))
            if message.role == "user":
                actions.append(("Edit", f"edit:{message.id}"))
            elif message.role == "assistant":
                actions.append(("Regenerate", f"regenerate:{message.id}"))
                if cut_short(message):
                    actions.append(("Continue", f"continue:{message.id}"))
        if not text and not actions:
            return
        self._new_block(cursor, top=2.0)
        muted = self.writer.muted()
        if text:
            cursor.insertText(text + ("   " if actions else ""), muted)
        for i, (label, href) in enumerate(actions):
            if i:
                cursor.insertText(" · ", muted)
            cursor.insertText(label, self.writer.link(href))

    def set_messages(self, messages: list[Message], streaming_id: int | None = None,
                     attachments: dict[int, list[Attachment]] | None = None,
                     branches: dict[int, tuple[int, int]] | None = None) -> None:
        """Render `messages`; the one with id `streaming_id` is left open for `update_stream`.
        `branches`: (index, count) of a message among its alternatives."""
        self._messages = list(messages)
        self._streaming_id = streaming_id
        self._attachments = attachments or {}
        self._branches = branches or {}
        self._stream_text = next((m.content for m in messages if m.id == streaming_id), "")
        self._stream_status = "generating…"
        self._render()
        self._scroll_to_bottom()

    def _render(self) -> None:
        bar = self.verticalScrollBar()
        keep = bar.value()
        self.clear()
        self.writer.reset()
        self._stream_pos = None
        cursor = QTextCursor(self.document())
        for msg in self._messages:
            model = str(msg.stats.get("model", ""))
            self._insert_header(cursor, msg, model)
            if msg.id == self._streaming_id:
                self._new_block(cursor, top=4.0)
                self._stream_pos = cursor.position()
                self._stream_codes = len(self.writer.codes)
                self._fill_stream(cursor, self._stream_text)
                break
            self._insert_body(cursor, msg)
            footer = ""
            if msg.role == "assistant":
                footer = reply_stats_line(msg.stats, msg.status)
                drafts = draft_stats(msg.stats)
                if drafts:
                    footer = f"{footer} · {drafts}" if footer else drafts
                if msg.status == "interrupted" and not footer:
                    footer = "interrupted"
            self._insert_footer(cursor, msg, footer)
        bar.setValue(keep)

    def _fill_stream(self, cursor: QTextCursor, text: str) -> None:
        assert self._streaming_id is not None
        self._insert_reply(cursor, self._streaming_id, text, streaming=True)
        self._insert_footer(cursor, None, self._stream_status)

    def update_stream(self, text: str, status: str | None = None) -> None:
        """Replace the streaming reply's text (Markdown) in place."""
        if self._stream_pos is None:
            return
        if status is not None:
            self._stream_status = status
        self._stream_text = text
        follow = self._at_bottom()
        cursor = QTextCursor(self.document())
        cursor.setPosition(min(self._stream_pos, self.document().characterCount() - 1))
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        cursor.setBlockFormat(QTextBlockFormat())
        cursor.setCharFormat(QTextCharFormat())
        self.writer.truncate(self._stream_codes)
        self._fill_stream(cursor, text)
        if follow:
            self._scroll_to_bottom()

    @property
    def streaming(self) -> bool:
        return self._stream_pos is not None

    def code_blocks(self) -> list[str]:
        """The code of every block shown, in order (what each Copy link copies)."""
        return list(self.writer.codes)

    def copy_code(self, index: int) -> bool:
        codes = self.writer.codes
        if not -len(codes) <= index < len(codes):
            return False
        QGuiApplication.clipboard().setText(codes[index])
        self.copied.emit("code block")
        return True

    # -- links ---------------------------------------------------------------------------
    @Slot(QUrl)
    def _on_anchor_clicked(self, url: QUrl) -> None:
        scheme, arg = url.scheme(), url.path()
        if scheme in ("http", "https", "mailto", "ftp"):
            QDesktopServices.openUrl(url)
            return
        try:
            if scheme == "branch":
                step, message_id = (int(x) for x in arg.split(":", 1))
                self.branch_requested.emit(message_id, step)
                return
            number = int(arg)
        except ValueError:
            return
        if scheme == "copycode":
            self.copy_code(number)
        elif scheme == "copy":
            msg = next((m for m in self._messages if m.id == number), None)
            if msg is not None:
                QGuiApplication.clipboard().setText(msg.content)
                self.copied.emit("message")
        elif scheme == "think":
            self._expanded ^= {number}
            self._render()
        elif scheme == "regenerate":
            self.regenerate_requested.emit(number)
        elif scheme == "edit":
            self.edit_requested.emit(number)
        elif scheme == "continue":
            self.continue_requested.emit(number)
