"""Documents in: a text, Markdown, source or PDF file read as plain text for a chat's context.

Contract: `read_document(path)` returns a `Document` (name, kind, text, pages, bytes) or raises
DocumentUnreadable with one line naming the file and the reason: missing or unreadable, empty,
too large, binary (not text in any encoding we read), an encrypted PDF, a PDF without a text
layer (scanned pages), a damaged PDF. Text files are read as UTF-8 (a BOM picks UTF-16 or
UTF-8-sig); a PDF's text comes from its text layer through pypdf, page by page, joined with
form feeds so a reader can tell pages apart. Nothing here tokenizes: the caller counts tokens
with its model's tokenizer.
"""

from __future__ import annotations

import codecs
import io
import logging
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ImportFailed

MAX_BYTES = 64 << 20  # bigger than any context: a file past this is a mistake, not a document
PAGE_BREAK = "\f"
SNIFF_BYTES = 8192

# The file kinds a picker offers (plus .pdf). Whatever the name, a file's bytes decide: text
# decodes, anything else (an unlisted source language, no extension at all) is sniffed too.
TEXT_SUFFIXES = frozenset("""
.txt .text .md .markdown .mdown .rst .org .adoc .tex .csv .tsv .json .jsonl .yaml .yml .toml
.ini .cfg .conf .xml .html .htm .css .log .py .pyi .c .h .cc .cpp .hpp .cxx .m .mm .swift .rs
.go .java .kt .kts .scala .js .jsx .ts .tsx .mjs .rb .php .pl .lua .r .jl .sh .bash .zsh .fish
.sql .proto .cmake .mk .dockerfile .gradle .hs .ml .ex .exs .erl .clj .dart .vue .svelte
""".split())


class DocumentUnreadable(ImportFailed):
    """A file given to a chat has no text we can read (one line: the file and the reason)."""


@dataclass(frozen=True)
class Document:
    """A file's text. kind: 'pdf' or 'text'; pages: a PDF's page count (1 for text files);
    bytes: the file's size on disk."""

    name: str
    path: str
    kind: str
    text: str
    pages: int = 1
    bytes: int = 0


def read_document(path: Path | str) -> Document:
    """The text of the file at `path` (see the module docstring); DocumentUnreadable if none."""
    p = Path(path)
    name = p.name
    if p.is_dir():
        raise DocumentUnreadable(f"{name}: is a folder, not a document")
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise DocumentUnreadable(f"{name}: cannot be read ({exc.strerror or exc})") from exc
    if size > MAX_BYTES:
        raise DocumentUnreadable(f"{name}: is {size / 2**20:.0f} MB, more than the "
                                 f"{MAX_BYTES >> 20} MB a document may be")
    try:
        with p.open("rb") as f:
            head = f.read(SNIFF_BYTES)
            if head.startswith(b"%PDF-") or p.suffix.lower() == ".pdf":
                f.seek(0)
                return _read_pdf(p, f.read(), size)
            data = head + f.read()
    except OSError as exc:
        raise DocumentUnreadable(f"{name}: cannot be read ({exc.strerror or exc})") from exc
    text = _decode_text(name, data)
    if not text.strip():
        raise DocumentUnreadable(f"{name}: is empty")
    return Document(name=name, path=str(p), kind="text", text=text, bytes=size)


def _decode_text(name: str, data: bytes) -> str:
    """`data` as text, or DocumentUnreadable when it is binary."""
    for bom, encoding in ((codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
                          (codecs.BOM_UTF16_BE, "utf-16")):
        if data.startswith(bom):
            try:
                return data.decode(encoding)
            except UnicodeDecodeError:
                break
    if b"\x00" in data[:SNIFF_BYTES]:
        raise DocumentUnreadable(f"{name}: is a binary file, not text (give a text, "
                                 "Markdown, source or PDF file)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentUnreadable(f"{name}: is not UTF-8 text (byte {exc.start} is not "
                                 "valid): a binary file, or text in another encoding") from exc


def _read_pdf(p: Path, data: bytes, size: int) -> Document:
    import pypdf  # third-party, loaded only when a PDF is read
    from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

    name = p.name
    # pypdf logs every recoverable oddity of a damaged file; the one line below says enough.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            # An owner password alone still lets anyone read: an empty user password opens it.
            try:
                opened = bool(reader.decrypt(""))
            except (DependencyError, NotImplementedError, PdfReadError):
                opened = False
            if not opened:
                raise DocumentUnreadable(f"{name}: is an encrypted PDF (password protected): "
                                         "save a copy without the password and attach that")
        pages = [page.extract_text() or "" for page in reader.pages]
    except DocumentUnreadable:
        raise
    except FileNotDecryptedError as exc:
        raise DocumentUnreadable(f"{name}: is an encrypted PDF (password protected): save a "
                                 "copy without the password and attach that") from exc
    except Exception as exc:  # pypdf raises many types for a damaged file; all mean the same
        raise DocumentUnreadable(f"{name}: is not a readable PDF ({exc})") from exc
    if not pages:
        raise DocumentUnreadable(f"{name}: is a PDF with no pages")
    text = PAGE_BREAK.join(t.strip() for t in pages)
    if not text.replace(PAGE_BREAK, "").strip():
        raise DocumentUnreadable(f"{name}: has no text layer ({len(pages)} page"
                                 f"{'s' if len(pages) != 1 else ''} of images, a scanned PDF?): "
                                 "run it through OCR first")
    return Document(name=name, path=str(p), kind="pdf", text=text, pages=len(pages), bytes=size)
