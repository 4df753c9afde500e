"""Render Strata's app icon from resources/strata.svg: a 1024 px PNG and a macOS .icns.

Contract: `python packaging/make_icons.py` rewrites resources/strata.png (1024x1024, used on
Linux and as the window icon) and resources/strata.icns (PNG entries from 16 to 1024 px),
both committed. It needs only PySide6 (QtSvg) and runs offscreen on any platform; the .icns
is written here rather than with `iconutil`, which exists only on macOS.
"""

from __future__ import annotations

import argparse
import os
import struct
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "resources" / "strata.svg"

# ICNS entry types that hold PNG data, and their pixel sizes (what iconutil writes).
ICNS_TYPES: tuple[tuple[bytes, int], ...] = (
    (b"icp4", 16), (b"icp5", 32), (b"ic11", 32), (b"ic12", 64), (b"ic07", 128),
    (b"ic13", 256), (b"ic08", 256), (b"ic14", 512), (b"ic09", 512), (b"ic10", 1024),
)


def render_png(svg: Path, size: int) -> bytes:
    """The SVG rendered to a size x size PNG with a transparent background."""
    from PySide6.QtCore import QBuffer, QByteArray, QIODevice, Qt
    from PySide6.QtGui import QGuiApplication, QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    if QGuiApplication.instance() is None:
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        render_png.app = QGuiApplication(sys.argv[:1])  # type: ignore[attr-defined]  # keep alive
    renderer = QSvgRenderer(str(svg))
    if not renderer.isValid():
        raise SystemExit(f"make_icons: {svg}: not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    painter.setRenderHint(QPainter.RenderHint.SmoothPixmapTransform)
    renderer.render(painter)
    painter.end()
    data = QByteArray()
    buf = QBuffer(data)
    buf.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buf, b"PNG")
    buf.close()
    return bytes(data.data())


def icns_bytes(pngs: dict[int, bytes]) -> bytes:
    """An .icns file: 'icns', total length, then (type, length, PNG) entries, big-endian."""
    body = b"".join(kind + struct.pack(">I", 8 + len(pngs[size])) + pngs[size]
                    for kind, size in ICNS_TYPES)
    return b"icns" + struct.pack(">I", 8 + len(body)) + body


def read_icns(data: bytes) -> dict[bytes, bytes]:
    """The entries of an .icns file by type (for tests and checks)."""
    if data[:4] != b"icns" or struct.unpack(">I", data[4:8])[0] != len(data):
        raise ValueError("not an icns file")
    entries, pos = {}, 8
    while pos < len(data):
        kind, length = data[pos:pos + 4], struct.unpack(">I", data[pos + 4:pos + 8])[0]
        if length < 8 or pos + length > len(data):
            raise ValueError(f"bad icns entry {kind!r} at {pos}")
        entries[kind] = data[pos + 8:pos + length]
        pos += length
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--svg", type=Path, default=SOURCE)
    parser.add_argument("--out", type=Path, default=REPO / "resources")
    args = parser.parse_args(argv)
    sizes = sorted({size for _, size in ICNS_TYPES})
    pngs = {size: render_png(args.svg, size) for size in sizes}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "strata.png").write_bytes(pngs[1024])
    (args.out / "strata.icns").write_bytes(icns_bytes(pngs))
    print(f"wrote {args.out / 'strata.png'} and {args.out / 'strata.icns'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
