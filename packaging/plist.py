"""Info.plist pieces for Strata.app, kept apart from the spec so they are testable unbuilt.

Contract: `info_plist(version)` is the dict PyInstaller's BUNDLE merges into Info.plist:
document types so that .gguf files and model folders can be opened with Strata or dropped on
its Dock icon (role Viewer, rank Alternate: Strata never claims to be their default app), an
imported type for GGUF (Strata does not own the format), macOS 14 as the minimum, Retina on.
`project_version()` reads the version from pyproject.toml. Standard library only.

This file is loaded by path (importlib), never as `packaging.plist`: a top-level package
named `packaging` would shadow the PyPI `packaging` library that pip and pytest import.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUNDLE_ID = "org.strata.Strata"
MIN_MACOS = "14.0"  # MLX's Metal wheels start at macOS 14 (see packaging/README.md)
GGUF_UTI = "org.ggml.gguf"

IMPORTED_TYPES: list[dict[str, Any]] = [
    {
        "UTTypeIdentifier": GGUF_UTI,
        "UTTypeDescription": "GGUF model",
        "UTTypeConformsTo": ["public.data"],
        "UTTypeTagSpecification": {"public.filename-extension": ["gguf"]},
    },
]

DOCUMENT_TYPES: list[dict[str, Any]] = [
    {
        "CFBundleTypeName": "GGUF model",
        "CFBundleTypeRole": "Viewer",
        "LSHandlerRank": "Alternate",
        "LSItemContentTypes": [GGUF_UTI],
    },
    {
        # MLX and Hugging Face models are folders (config.json + safetensors).
        "CFBundleTypeName": "Model folder",
        "CFBundleTypeRole": "Viewer",
        "LSHandlerRank": "Alternate",
        "LSItemContentTypes": ["public.folder"],
    },
]


def project_version(pyproject: Path = REPO / "pyproject.toml") -> str:
    """[project].version from pyproject.toml."""
    with open(pyproject, "rb") as fh:
        version: str = tomllib.load(fh)["project"]["version"]
    return version


def info_plist(version: str | None = None) -> dict[str, Any]:
    """The Info.plist keys Strata sets (PyInstaller adds CFBundleExecutable and the like)."""
    version = version or project_version()
    return {
        "CFBundleName": "Strata",
        "CFBundleDisplayName": "Strata",
        "CFBundleIdentifier": BUNDLE_ID,
        "CFBundleShortVersionString": version,
        "CFBundleVersion": version,
        "CFBundlePackageType": "APPL",
        "CFBundleDocumentTypes": DOCUMENT_TYPES,
        "UTImportedTypeDeclarations": IMPORTED_TYPES,
        "LSMinimumSystemVersion": MIN_MACOS,
        "LSArchitecturePriority": ["arm64"],
        "LSApplicationCategoryType": "public.app-category.developer-tools",
        "NSHighResolutionCapable": True,
        "NSRequiresAquaSystemAppearance": False,  # follow the system's dark mode
        "NSHumanReadableCopyright": "Apache-2.0",
    }
