"""`strata --screenshot FILE --view V` renders the window offscreen to a PNG and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from PySide6.QtGui import QImage

from tests.conftest import REPO


def test_screenshot_of_the_library_view(starter: dict[str, Any], strata_home: Path,
                                        tmp_path: Path) -> None:
    out = tmp_path / "library.png"
    env = dict(os.environ, STRATA_HOME=str(strata_home), QT_QPA_PLATFORM="offscreen")
    proc = subprocess.run([sys.executable, "-m", "app", "--screenshot", str(out),
                           "--view", "library"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    image = QImage(str(out))
    assert not image.isNull()
    assert (image.width(), image.height()) == (1100, 720)


def test_screenshot_of_a_chat_with_a_document(starter: dict[str, Any], strata_home: Path,
                                              tmp_path: Path) -> None:
    """--demo with STRATA_DEMO_DOCUMENT: the document is attached, asked about, answered."""
    doc = tmp_path / "keeper.md"
    doc.write_text("# The keeper\n\nThe lighthouse keeper's cat is named Marmalade.\n",
                   encoding="utf-8")
    out = tmp_path / "chat-document.png"
    env = dict(os.environ, STRATA_HOME=str(strata_home), QT_QPA_PLATFORM="offscreen",
               STRATA_DEMO_DOCUMENT=str(doc))
    proc = subprocess.run([sys.executable, "-m", "app", "--screenshot", str(out),
                           "--view", "chat", "--demo", "--theme", "dark"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    image = QImage(str(out))
    assert (image.width(), image.height()) == (1100, 720)
    # Dark: the message area's background (the palette's base) is dark.
    assert image.pixelColor(500, 300).lightness() < 80
