"""Info.plist pieces and the icon files, checked without building the app."""

from __future__ import annotations

import importlib.util
import plistlib
import tomllib
from types import ModuleType

from tests.helpers import REPO


def _load(name: str) -> ModuleType:
    # By path: a `packaging` package would shadow the PyPI library of that name.
    path = REPO / "packaging" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"strata_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_info_plist_opens_gguf_files_and_model_folders() -> None:
    plist = _load("plist")
    info = plist.info_plist()
    doc_types = {t["CFBundleTypeName"]: t for t in info["CFBundleDocumentTypes"]}
    assert doc_types["GGUF model"]["LSItemContentTypes"] == [plist.GGUF_UTI]
    assert doc_types["Model folder"]["LSItemContentTypes"] == ["public.folder"]
    for t in doc_types.values():
        assert t["CFBundleTypeRole"] == "Viewer" and t["LSHandlerRank"] == "Alternate"
    (gguf,) = info["UTImportedTypeDeclarations"]
    assert gguf["UTTypeIdentifier"] == plist.GGUF_UTI
    assert gguf["UTTypeTagSpecification"]["public.filename-extension"] == ["gguf"]
    assert "public.data" in gguf["UTTypeConformsTo"]
    assert info["LSMinimumSystemVersion"] == "14.0"
    assert info["NSHighResolutionCapable"] is True
    plistlib.dumps(info)  # every value is one a plist can hold


def test_version_comes_from_pyproject() -> None:
    plist = _load("plist")
    with open(REPO / "pyproject.toml", "rb") as fh:
        version = tomllib.load(fh)["project"]["version"]
    info = plist.info_plist()
    assert info["CFBundleShortVersionString"] == info["CFBundleVersion"] == version


def test_icons_are_rendered_from_the_source() -> None:
    icons = _load("make_icons")
    png = (REPO / "resources" / "strata.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert int.from_bytes(png[16:20], "big") == int.from_bytes(png[20:24], "big") == 1024
    entries = icons.read_icns((REPO / "resources" / "strata.icns").read_bytes())
    assert set(entries) == {kind for kind, _ in icons.ICNS_TYPES}
    for kind, size in icons.ICNS_TYPES:
        assert entries[kind][:8] == b"\x89PNG\r\n\x1a\n"
        assert int.from_bytes(entries[kind][16:20], "big") == size, kind
