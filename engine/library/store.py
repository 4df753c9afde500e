"""Models on disk: STRATA_HOME/models/<name>/ holds MLX weights, tokenizer files, manifest.json.

Contract: installs are atomic. A builder writes into a temporary folder next to the library;
only a complete folder (manifest written last and fsynced) is renamed into place, so a failed,
cancelled or killed import leaves the library exactly as it was. Names and aliases resolve
case-insensitively; names are plain (letters, digits, '.', '_', '-'). The final check and
rename hold an advisory lock (flock on the models folder), so two running Strata processes
never both install one name; a replaced model moves aside first and comes back if the
process dies before its replacement is in place. A full disk is an ImportFailed that says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine import __version__
from engine.errors import ImportFailed, ModelNotFound
from engine.platform import default_home, pid_alive

Manifest = dict[str, Any]
MANIFEST = "manifest.json"
_REPLACED = "+replaced"  # '+' is never in a model name, so no import's temp folder matches
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def clean_name(text: str) -> str:
    """A library name made from free text (a file stem, a repo id)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._").lower()
    return name[:128] or "model"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name) or ".." in name:
        raise ImportFailed(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    return name


def fingerprint(folder: Path) -> str:
    """SHA-256 over the weight files, in name order: identifies the weights for caches."""
    digest = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        digest.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


class Library:
    """The models folder. Cheap to construct; reads manifests on demand."""

    def __init__(self, home: Path | None = None) -> None:
        self.home = Path(home) if home is not None else default_home()
        self.models_dir = self.home / "models"
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self._sweep_stale()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Exclusive advisory lock over installs and sweeps, across processes."""
        fd = os.open(self.models_dir, os.O_RDONLY)  # the folder itself: no lock file
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _sweep_stale(self) -> None:
        """Remove temporary folders left by imports whose process died; a model that was
        moved aside for a replacement that never arrived goes back in place."""
        with contextlib.suppress(OSError), self._locked():
            for tmp in self.models_dir.glob(".tmp-*"):
                try:
                    pid = int(tmp.name.split("-")[1])
                except (IndexError, ValueError):
                    pid = -1
                if pid == os.getpid() or pid_alive(pid):
                    continue
                if tmp.name.startswith(f".tmp-{pid}-{_REPLACED}"):
                    with contextlib.suppress(OSError, ValueError, KeyError, ImportFailed):
                        final = self.models_dir / check_name(self._read_manifest(tmp)["name"])
                        if not final.exists():
                            os.rename(tmp, final)
                            continue
                shutil.rmtree(tmp, ignore_errors=True)

    # -- reading ---------------------------------------------------------------------------
    def manifests(self) -> list[Manifest]:
        out = []
        for folder in sorted(self.models_dir.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            try:
                out.append(self._read_manifest(folder))
            except (OSError, ValueError):
                continue  # not a complete model folder; never used
        return out

    def _read_manifest(self, folder: Path) -> Manifest:
        data: Manifest = json.loads((folder / MANIFEST).read_text())
        data["path"] = str(folder)
        return data

    def find(self, name: str) -> Manifest | None:
        key = name.lower()
        for m in self.manifests():
            if m["name"].lower() == key or key in (a.lower() for a in m.get("aliases", [])):
                return m
        return None

    def get(self, name: str) -> Manifest:
        m = self.find(name)
        if m is None:
            known = ", ".join(x["name"] for x in self.manifests()) or "none"
            raise ModelNotFound(f"model {name!r} is not in the library (have: {known})")
        return m

    def path(self, name: str) -> Path:
        return Path(self.get(name)["path"])

    # -- writing ---------------------------------------------------------------------------
    def install(
        self,
        name: str,
        build: Callable[[Path], Manifest],
        aliases: list[str] | None = None,
        replace: bool = False,
    ) -> Manifest:
        """Run `build(tmp)` and move the result into place atomically; return its manifest."""
        name = check_name(name)
        final = self.models_dir / name
        existing = self.find(name)
        if existing is not None and not replace:
            raise ImportFailed(f"a model named {name!r} is already in the library")
        tmp = self.models_dir / f".tmp-{os.getpid()}-{name}-{time.monotonic_ns()}"
        try:
            tmp.mkdir()
        except OSError as exc:
            raise ImportFailed(_write_failure(name, self.models_dir, exc)) from exc
        try:
            try:
                manifest = self._build_and_place(name, final, tmp, build, aliases, replace)
            except OSError as exc:
                raise ImportFailed(_write_failure(name, self.models_dir, exc)) from exc
            except RuntimeError as exc:  # MLX's writers report a full disk this way
                if "write" not in str(exc).lower():
                    raise
                raise ImportFailed(_write_failure(name, self.models_dir, exc)) from exc
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        manifest["path"] = str(final)
        return manifest

    def _build_and_place(self, name: str, final: Path, tmp: Path,
                         build: Callable[[Path], Manifest], aliases: list[str] | None,
                         replace: bool) -> Manifest:
        manifest = build(tmp)
        manifest.update(
            name=name,
            aliases=sorted(set(aliases or []) | set(manifest.get("aliases", []))),
            bytes=folder_bytes(tmp),
            fingerprint=fingerprint(tmp),
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        manifest["strata_version"] = __version__
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))
        with self._locked():
            # Checked again under the lock: another process may have installed it since.
            if not replace and self.find(name) is not None:
                raise ImportFailed(f"a model named {name!r} is already in the library")
            for alias in manifest["aliases"]:
                self._drop_alias(alias, keep=name)
            if final.exists():
                old = self.models_dir / f".tmp-{os.getpid()}-{_REPLACED}-{time.monotonic_ns()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_dir(self.models_dir)
        return manifest

    def _drop_alias(self, alias: str, keep: str) -> None:
        for m in self.manifests():
            if m["name"] != keep and alias in m.get("aliases", []):
                m["aliases"] = [a for a in m["aliases"] if a != alias]
                folder = Path(m.pop("path"))
                _write_synced(folder / MANIFEST, json.dumps(m, indent=2, sort_keys=True))

    def update(self, name: str, **fields: Any) -> Manifest:
        """Set manifest fields of an installed model (its chosen context, say), atomically."""
        with self._locked():
            m = self.get(name)
            m.update(fields)
            folder = Path(m.pop("path"))
            _write_synced(folder / MANIFEST, json.dumps(m, indent=2, sort_keys=True))
            m["path"] = str(folder)
        return m

    def remove(self, name: str) -> Manifest:
        m = self.get(name)
        folder = Path(m["path"])
        trash = self.models_dir / f".tmp-{os.getpid()}-rm-{time.monotonic_ns()}"
        os.rename(folder, trash)  # atomic disappearance, then the slow delete
        shutil.rmtree(trash, ignore_errors=True)
        return m


def _write_failure(name: str, folder: Path, exc: Exception) -> str:
    why = " ".join(str(getattr(exc, "strerror", None) or exc).split())
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "write" in str(exc).lower():
        return f"cannot import {name!r}: the disk holding {folder} is full ({why})"
    return f"cannot import {name!r} into {folder}: {why}"


def _write_synced(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".part")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
