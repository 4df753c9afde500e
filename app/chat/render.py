"""A reply's Markdown into a QTextDocument: reasoning folded, code highlighted by Pygments.

Contract: `split_reasoning(text)` separates a `<think>...</think>` block (closed or still
open while streaming; a reply that only closes one had its opening tag in the prompt) from the
answer. `split_fences(text)` cuts the answer into Markdown and fenced code (an unclosed fence
runs to the end, as it does while a reply streams). `RichWriter.write(cursor, text, key)`
inserts the answer at the cursor: Qt's own Markdown for headings, lists, tables, links and
emphasis; each code block in a frame shaded in its Pygments style's background, the language
and a "Copy" link (href `copycode:N`) above it, tokens coloured from that style. The writer
keeps each block's code by N for the view's clipboard. Light or dark styles follow the palette.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pygments.lexer import Lexer
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.style import StyleMeta
from pygments.styles import get_style_by_name
from pygments.token import Token
from pygments.util import ClassNotFound
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QFontDatabase,
    QPalette,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFrameFormat,
    QTextLength,
)

LIGHT_STYLE = "default"
DARK_STYLE = "github-dark"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})[ \t]*([^\s`]*)[^\n`]*$")


@dataclass(frozen=True)
class Reasoning:
    """A reply split at its reasoning: `thought` ('' if none), whether the think block is
    still open (streaming), and the answer after it."""

    thought: str
    answer: str
    open: bool = False

    @property
    def words(self) -> int:
        return len(self.thought.split())


def split_reasoning(text: str) -> Reasoning:
    start = text.find(THINK_OPEN)
    end = text.find(THINK_CLOSE)
    if start < 0 and end >= 0:  # the template opened the block in the prompt
        return Reasoning(text[:end].strip(), text[end + len(THINK_CLOSE):].lstrip())
    if start < 0 or text[:start].strip():
        return Reasoning("", text)
    body = text[start + len(THINK_OPEN):]
    end = body.find(THINK_CLOSE)
    if end < 0:
        return Reasoning(body.strip(), "", open=True)
    return Reasoning(body[:end].strip(), body[end + len(THINK_CLOSE):].lstrip())


@dataclass(frozen=True)
class Segment:
    """Markdown text (language None) or a fenced code block's code and language ('' if
    unnamed); `closed` is False for a fence still streaming."""

    text: str
    language: str | None = None
    closed: bool = True

    @property
    def is_code(self) -> bool:
        return self.language is not None


def split_fences(text: str) -> list[Segment]:
    out: list[Segment] = []
    lines = text.split("\n")
    prose: list[str] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            prose.append(lines[i])
            i += 1
            continue
        fence, language = m.group(1), m.group(2)
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        code: list[str] = []
        i += 1
        closed = False
        while i < len(lines):
            if closing.match(lines[i]):
                closed = True
                i += 1
                break
            code.append(lines[i])
            i += 1
        if prose and "".join(prose).strip():
            out.append(Segment("\n".join(prose).strip("\n")))
        prose = []
        out.append(Segment("\n".join(code), language, closed))
    if "".join(prose).strip():
        out.append(Segment("\n".join(prose).strip("\n")))
    return out


def is_dark(palette: QPalette) -> bool:
    return palette.color(QPalette.ColorRole.Base).lightness() < 128


def _lexer(language: str) -> Lexer:
    if language:
        try:
            return get_lexer_by_name(language.lower(), stripnl=False, ensurenl=False)
        except ClassNotFound:
            pass
    return TextLexer(stripnl=False, ensurenl=False)


class RichWriter:
    """Writes replies into one document (see the module docstring); `codes[N]` is block N."""

    def __init__(self, palette: QPalette, base_point_size: float) -> None:
        self.palette = palette
        self.style: StyleMeta = get_style_by_name(DARK_STYLE if is_dark(palette)
                                                  else LIGHT_STYLE)
        self.point_size = base_point_size
        self.codes: list[str] = []
        self._formats: dict[object, QTextCharFormat] = {}
        self.mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)

    def reset(self) -> None:
        self.codes.clear()

    def truncate(self, count: int) -> None:
        """Forget code blocks from index `count` on (a streaming reply is drawn again)."""
        del self.codes[count:]

    # -- formats -------------------------------------------------------------------------
    def _code_format(self, ttype: object) -> QTextCharFormat:
        fmt = self._formats.get(ttype)
        if fmt is None:
            fmt = QTextCharFormat()
            fmt.setFont(self.mono)
            fmt.setFontPointSize(max(self.point_size - 0.5, 7.0))
            st = self.style.style_for_token(ttype)  # type: ignore[arg-type]
            colour = st.get("color") or _default_text(self.style)
            fmt.setForeground(QColor(f"#{colour}"))
            if st.get("bold"):
                fmt.setFontWeight(QFont.Weight.Bold)
            if st.get("italic"):
                fmt.setFontItalic(True)
            self._formats[ttype] = fmt
        return fmt

    def muted(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setForeground(self.palette.color(QPalette.ColorRole.PlaceholderText))
        fmt.setFontPointSize(max(self.point_size - 1.5, 7.0))
        return fmt

    def link(self, href: str, size_delta: float = -1.5) -> QTextCharFormat:
        fmt = QTextCharFormat()
        fmt.setAnchor(True)
        fmt.setAnchorHref(href)
        fmt.setForeground(self.palette.color(QPalette.ColorRole.Link))
        fmt.setFontPointSize(max(self.point_size + size_delta, 7.0))
        return fmt

    # -- writing -------------------------------------------------------------------------
    def write(self, cursor: QTextCursor, text: str) -> None:
        """The answer's Markdown at the cursor (which ends after it)."""
        for seg in split_fences(text) or [Segment(" ")]:
            if seg.is_code:
                self._write_code(cursor, seg)
            else:
                _ensure_block(cursor)
                cursor.insertMarkdown(seg.text)
                # Qt's Markdown leaves its last block's format on the cursor: reset it.
                cursor.setCharFormat(QTextCharFormat())

    def _write_code(self, cursor: QTextCursor, seg: Segment) -> None:
        index = len(self.codes)
        self.codes.append(seg.text)
        _ensure_block(cursor)
        # A frame goes after the cursor's block, which stays empty: make it a hairline.
        spacer = QTextBlockFormat()
        spacer.setLineHeight(1, QTextBlockFormat.LineHeightTypes.FixedHeight.value)
        cursor.setBlockFormat(spacer)
        small = QTextCharFormat()
        small.setFontPointSize(1)
        cursor.setBlockCharFormat(small)
        frame_fmt = QTextFrameFormat()
        frame_fmt.setBackground(QBrush(QColor(self.style.background_color)))
        frame_fmt.setPadding(8)
        frame_fmt.setTopMargin(2)
        frame_fmt.setBottomMargin(6)
        frame_fmt.setBorder(0)
        frame_fmt.setWidth(QTextLength(QTextLength.Type.PercentageLength, 100))
        frame = cursor.insertFrame(frame_fmt)
        head = QTextBlockFormat()
        head.setBottomMargin(4)
        cursor.setBlockFormat(head)
        label = self.muted()
        label.setForeground(QColor(f"#{_default_text(self.style)}"))
        label.setFontItalic(True)
        cursor.insertText((seg.language or "code") + ("  (streaming…)" if not seg.closed
                                                      else "") + "   ", label)
        cursor.insertText("Copy", self.link(f"copycode:{index}"))
        code_block = QTextBlockFormat()
        code_block.setNonBreakableLines(True)
        code_block.setLineHeight(115, QTextBlockFormat.LineHeightTypes.ProportionalHeight.value)
        cursor.insertBlock(code_block, QTextCharFormat())
        code = seg.text.rstrip("\n")
        for ttype, value in _lexer(seg.language or "").get_tokens(code):
            cursor.insertText(value, self._code_format(ttype))
        cursor.setPosition(frame.lastPosition())
        cursor.movePosition(QTextCursor.MoveOperation.NextCharacter)  # out of the frame
        cursor.setBlockFormat(QTextBlockFormat())
        cursor.setCharFormat(QTextCharFormat())


def _default_text(style: StyleMeta) -> str:
    """The style's plain text colour as hex digits (its Token colour, else by background)."""
    colour = style.style_for_token(Token).get("color")
    if colour:
        return str(colour)
    return "e6edf3" if QColor(style.background_color).lightness() < 128 else "1f2328"


def _ensure_block(cursor: QTextCursor) -> None:
    """Start a new block unless the cursor sits at the start of an empty one."""
    if cursor.block().length() > 1 or cursor.positionInBlock() > 0:
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
