"""The list of chats as a Qt item model over `ChatStore`: titles shown, edited in place.

Contract: rows are chats, newest activity first; `setData(EditRole)` renames through the
store; `refresh()` re-reads the store and keeps nothing else but the search filter:
`set_filter(snippets)` shows only the chats it names (chat id -> the matching text, shown as
the tooltip), `set_filter(None)` shows every chat again.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt

from app.chat.store import Chat, ChatStore

ChatIdRole = int(Qt.ItemDataRole.UserRole) + 1
Index = QModelIndex | QPersistentModelIndex


class ChatListModel(QAbstractListModel):
    def __init__(self, store: ChatStore, parent: Any = None) -> None:
        super().__init__(parent)
        self._store = store
        self._filter: dict[int, str] | None = None
        self._chats: list[Chat] = store.chats()

    def refresh(self) -> None:
        self.beginResetModel()
        chats = self._store.chats()
        if self._filter is not None:
            chats = [c for c in chats if c.id in self._filter]
        self._chats = chats
        self.endResetModel()

    def set_filter(self, snippets: dict[int, str] | None) -> None:
        self._filter = snippets
        self.refresh()

    @property
    def filtered(self) -> bool:
        return self._filter is not None

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self._chats)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self._chats):
            return None
        chat = self._chats[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return chat.title
        if role == Qt.ItemDataRole.ToolTipRole:
            found = self._filter.get(chat.id, "") if self._filter is not None else ""
            return f"{chat.title}\nmodel: {chat.model or 'default'}" + (
                f"\nfound: {found}" if found else "")
        if role == ChatIdRole:
            return chat.id
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        base = super().flags(index)
        return base | Qt.ItemFlag.ItemIsEditable if index.isValid() else base

    def setData(self, index: Index, value: Any, role: int = Qt.ItemDataRole.EditRole) -> bool:
        if role != Qt.ItemDataRole.EditRole or not index.isValid():
            return False
        title = str(value).strip()
        if not title:
            return False
        chat = self._chats[index.row()]
        self._store.update_chat(chat.id, title=title)
        self._chats[index.row()] = self._store.chat(chat.id) or chat
        self.dataChanged.emit(index, index)
        return True

    def row_of(self, chat_id: int) -> int:
        for row, chat in enumerate(self._chats):
            if chat.id == chat_id:
                return row
        return -1

    def chat_at(self, row: int) -> Chat | None:
        return self._chats[row] if 0 <= row < len(self._chats) else None
