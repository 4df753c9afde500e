"""Documents for a chat's context: text and PDFs read, and one line for what cannot be read.

The PDFs are written here by hand (`write_pdf`: Helvetica text, one content stream a page, an
exact xref), so the tests use no PDF producer; the encrypted one is that file encrypted by pypdf.
"""

from __future__ import annotations

from pathlib import Path

import pypdf
import pytest

from engine.errors import ImportFailed, StrataError
from engine.importers.documents import PAGE_BREAK, DocumentUnreadable, read_document


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")


def write_pdf(path: Path, pages: list[list[str]], image_only: bool = False) -> Path:
    """A PDF of `pages` (lines of text each); `image_only`: each page is a small image and
    no text at all, as a scanner makes them."""
    objects: list[bytes] = [b"", b""]  # 1: catalog, 2: page tree (filled in below)
    kids = []
    font = len(objects) + 1
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    image = len(objects) + 1
    pixels = bytes([0, 255, 255, 0]) * 64  # 16 x 16 grey
    objects.append(b"<< /Type /XObject /Subtype /Image /Width 16 /Height 16 /ColorSpace "
                   b"/DeviceGray /BitsPerComponent 8 /Length %d >>\nstream\n" % len(pixels)
                   + pixels + b"\nendstream")
    for lines in pages:
        if image_only:
            ops = "q 400 0 0 600 100 100 cm /Im1 Do Q"
        else:
            ops = "BT /F1 11 Tf 14 TL 60 750 Td " + " ".join(
                f"({_escape(line)}) Tj T*" for line in lines) + " ET"
        stream = ops.encode("latin-1")
        content = len(objects) + 1
        objects.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
        page = len(objects) + 1
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 %d 0 R >> /XObject << /Im1 %d 0 R >> >> >>"
                       % (content, font, image))
        kids.append(page)
    objects[0] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[1] = (b"<< /Type /Pages /Kids [" + b" ".join(b"%d 0 R" % k for k in kids)
                  + b"] /Count %d >>" % len(kids))
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += (b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n"
            % (len(objects) + 1, xref))
    path.write_bytes(bytes(out))
    return path


def encrypt_pdf(source: Path, path: Path, password: str = "secret") -> Path:
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(source))
    writer.encrypt(user_password=password, owner_password=password + "-owner",
                   algorithm="RC4-128")
    with path.open("wb") as f:
        writer.write(f)
    return path


def test_text_markdown_and_source_files(tmp_path: Path) -> None:
    md = tmp_path / "notes.md"
    md.write_text("# Notes\n\n- one\n- two ünïcode\n", encoding="utf-8")
    doc = read_document(md)
    assert (doc.name, doc.kind, doc.pages) == ("notes.md", "text", 1)
    assert doc.text == md.read_text(encoding="utf-8") and doc.bytes == md.stat().st_size
    src = tmp_path / "Makefile"  # no extension: sniffed as text
    src.write_text("all:\n\techo hi\n")
    assert read_document(src).text.startswith("all:")
    bom = tmp_path / "windows.txt"
    bom.write_bytes("hello from UTF-16".encode("utf-16"))  # with its BOM
    assert read_document(bom).text == "hello from UTF-16"


def test_a_pdf_gives_its_pages_text(tmp_path: Path) -> None:
    pdf = write_pdf(tmp_path / "report.pdf",
                    [[f"Page {i + 1} says the word PELICAN.", "(brackets) and \\ too"]
                     for i in range(4)])
    doc = read_document(pdf)
    assert (doc.kind, doc.pages) == ("pdf", 4)
    parts = doc.text.split(PAGE_BREAK)
    assert len(parts) == 4
    assert "Page 3 says the word PELICAN." in parts[2]
    assert "(brackets)" in parts[0]


@pytest.mark.parametrize("case", ["scanned", "encrypted", "binary", "empty", "missing",
                                  "folder", "latin1", "damaged"])
def test_unreadable_files_get_one_line(tmp_path: Path, case: str) -> None:
    text_pdf = write_pdf(tmp_path / "text.pdf", [["hello"]])
    path = {
        "scanned": lambda: write_pdf(tmp_path / "scan.pdf", [[], [], []], image_only=True),
        "encrypted": lambda: encrypt_pdf(text_pdf, tmp_path / "locked.pdf"),
        "binary": lambda: _write(tmp_path / "model.bin", bytes(range(256)) * 4),
        "empty": lambda: _write(tmp_path / "empty.txt", b" \n"),
        "missing": lambda: tmp_path / "absent.txt",
        "folder": lambda: tmp_path,
        "latin1": lambda: _write(tmp_path / "old.txt", "caf\xe9 cr\xe8me".encode("latin-1")),
        "damaged": lambda: _write(tmp_path / "cut.pdf", text_pdf.read_bytes()[:60]),
    }[case]()
    with pytest.raises(DocumentUnreadable) as info:
        read_document(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path.name}: ")
    assert isinstance(info.value, ImportFailed) and isinstance(info.value, StrataError)
    expected = {"scanned": "no text layer (3 pages", "encrypted": "encrypted PDF",
                "binary": "binary file", "empty": "is empty", "missing": "cannot be read",
                "folder": "is a folder", "latin1": "not UTF-8", "damaged": "not a readable PDF"}
    assert expected[case] in message, message


def test_an_owner_password_alone_does_not_lock_the_text(tmp_path: Path) -> None:
    text_pdf = write_pdf(tmp_path / "text.pdf", [["open to read"]])
    locked = encrypt_pdf(text_pdf, tmp_path / "owner.pdf", password="")
    assert "open to read" in read_document(locked).text


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
