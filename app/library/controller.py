"""The library screen's logic: list models, import (drop, menu, Dock), delete, set default.

Contract: the listing reads manifests (cheap file reads) on the GUI thread; imports and
deletes run on the engine thread. Each import gets an `ImportDialog`: the engine first
reports what the file is and what each recipe would weigh (a planning job), the user picks
one and the import job starts; both jobs map to the same dialog in `dialogs`. A refusal shows
the engine's one-line reason and leaves the library as it was (a model that would not fit in
memory is refused in the dialog, before the job, and again by the engine). The listing carries
each model's fit (app.worker.Engine.fits), refreshed when the engine has settled its compute
profile and after each load. `models_changed(names, default)` fires whenever either changes.

Found on this Mac: the listing also shows the models LM Studio, Ollama and the Hugging Face
cache keep (engine.library.found.scan, at the first refresh and on Rescan); `add_found` adds
one in one click: an MLX folder linked without a second copy (app.library.found.FoundLinker,
off the GUI thread), a GGUF (or float folder) converted by the engine's import as stored, its
manifest then marked with where it came from (`found_in`, `placement`, `external_path`).
`found_added(label, added, name or reason)` answers.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

from app.chat.store import ChatStore
from app.library.found import FoundLinker, FoundModel
from app.library.model import LibraryModel
from app.library.view import ImportDialog, LibraryView
from app.worker import Engine
from engine.library import Library
from engine.library.found import Found, Roots, scan

DEFAULT_KEY = "default_model"


class LibraryController(QObject):
    models_changed = Signal(list, str)  # names, default name
    import_planned = Signal(int)  # planning job: its dialog now offers the recipes
    import_done = Signal(int, bool, str)  # job, imported, model name or reason
    found_added = Signal(str, bool, str)  # found label, added, model name or reason

    def __init__(self, store: ChatStore, engine: Engine, parent: QObject | None = None,
                 roots: Roots | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.engine = engine
        self.roots = roots  # where Found on this Mac looks (None: Roots.from_env())
        self.model = LibraryModel(self)
        self.found_model = FoundModel(self)
        self.view = LibraryView(self.model, self.found_model)
        self.linker = FoundLinker(engine.home, self)
        self._found_jobs: dict[int, tuple[Found, Path | None]] = {}  # job: found, staging link
        self._link_jobs = itertools.count(1)
        self.dialogs: dict[int, ImportDialog] = {}
        self.last_error = ""
        self.view.import_requested.connect(self._on_import_requested)
        self.view.delete_requested.connect(self._on_delete_requested)
        self.view.default_requested.connect(self._on_default_requested)
        self.view.add_found_requested.connect(self._on_add_found_requested)
        self.view.rescan_requested.connect(self.rescan)
        self.linker.linked.connect(self._on_found_linked)
        self.linker.failed.connect(self._on_found_link_failed)
        w = self.engine
        w.import_planned.connect(self._on_import_planned)
        w.import_started.connect(self._on_import_started)
        w.import_progress.connect(self._on_import_progress)
        w.import_finished.connect(self._on_import_finished)
        w.model_removed.connect(self._on_model_removed)
        w.starter_ready.connect(self._on_starter_ready)
        w.error_occurred.connect(self._on_error_occurred)
        w.profile_chosen.connect(self._on_profile_chosen)
        w.model_loaded.connect(self._on_model_loaded)

    # -- public ----------------------------------------------------------------------------
    def manifests(self) -> list[dict[str, Any]]:
        return self.engine.manifests()

    def default_model(self, manifests: list[dict[str, Any]] | None = None) -> str:
        manifests = self.manifests() if manifests is None else manifests
        names = [m["name"] for m in manifests]
        chosen = self.store.setting(DEFAULT_KEY)
        if chosen in names:
            return str(chosen)
        for m in manifests:
            if "starter" in m.get("aliases", []):
                return str(m["name"])
        return names[0] if names else ""

    def refresh(self) -> None:
        manifests = self.manifests()
        default = self.default_model(manifests)
        selected = self.view.selected_name()
        self.model.set_manifests(manifests, default, self.engine.fits(manifests))
        if selected:
            self.view.select_name(selected)
        if self._found is None:
            self.rescan(manifests)
        else:
            self._show_found(manifests)
        self.models_changed.emit([m["name"] for m in manifests], default)

    # -- found on this Mac -----------------------------------------------------------------
    _found: list[Found] | None = None

    def rescan(self, manifests: list[dict[str, Any]] | None = None) -> list[Found]:
        """Look again in LM Studio's, Ollama's and the Hugging Face cache's folders
        (directory listings and small files: the GUI thread may)."""
        self._found = scan(self.roots)
        self._show_found(self.manifests() if manifests is None else manifests)
        return self._found

    def _show_found(self, manifests: list[dict[str, Any]]) -> None:
        selected = self.view.selected_found()
        label = self.found_model.labels()[selected] if selected >= 0 else ""
        self.found_model.set_found(self._found or [], manifests)
        if label:
            self.view.select_found(label)

    def add_found(self, found: Found) -> int:
        """Add a model another app keeps: an MLX folder linked (clone, hard link or
        reference: engine.library.found.place), a GGUF or float folder converted by the
        engine's import. `found_added` answers; returns the job."""
        name = self._free_name(found.name)
        self.view.found_status.setText(f"Adding {found.label} from {found.app}…")
        if found.linkable:
            job = -next(self._link_jobs)  # negative: never an engine job's number
            self._found_jobs[job] = (found, None)
            self.linker.link(job, found, name)
            return job
        # The engine's import names the model after the path it is given: a link named
        # as the model (an Ollama blob is sha256-<hex>, a cached snapshot its commit).
        staging = self.engine.home / "found-staging"
        staging.mkdir(parents=True, exist_ok=True)
        link = staging / (f"{name}.gguf" if found.kind == "gguf" else name)
        _remove(link)
        if found.kind == "gguf":
            link.symlink_to(found.path.resolve())
        else:  # a folder of links: the import resolves a folder's own name, not its files'
            link.mkdir()
            for f in found.path.iterdir():
                (link / f.name).symlink_to(f.resolve())
        job = self.engine.import_path(link)
        self._found_jobs[job] = (found, link)
        return job

    def _free_name(self, name: str) -> str:
        taken = {m["name"].lower() for m in self.manifests()}
        candidate, i = name, 2
        while candidate.lower() in taken:
            candidate, i = f"{name}-{i}", i + 1
        return candidate

    def _found_done(self, job: int, ok: bool, text: str) -> None:
        found, link = self._found_jobs.pop(job)
        if link is not None:
            _remove(link)
        if ok:
            self.view.found_status.setText(f"Added {found.label} from {found.app} as "
                                           f"<b>{text}</b>.")
        else:
            self.last_error = text
            self.view.found_status.setText(f"{found.label} could not be added: {text}")
        self.refresh()
        if ok:
            self.view.select_name(text)
        self.found_added.emit(found.label, ok, text)

    @Slot(int)
    def _on_add_found_requested(self, row: int) -> None:
        found = self.found_model.found(row)
        if found is not None:
            self.add_found(found)

    @Slot(int, dict)
    def _on_found_linked(self, job: int, manifest: dict[str, Any]) -> None:
        if job in self._found_jobs:
            self._found_done(job, True, str(manifest["name"]))

    @Slot(int, str)
    def _on_found_link_failed(self, job: int, message: str) -> None:
        if job in self._found_jobs:
            self._found_done(job, False, message)

    def refresh_fits(self) -> None:
        """The listed models' fits again (memory, the loaded model and the profile change)."""
        self.model.set_fits(self.engine.fits(self.model.manifests()))

    def set_default(self, name: str) -> None:
        self.store.set_setting(DEFAULT_KEY, name)
        self.refresh()

    def import_paths(self, paths: list[Path], parent: QWidget | None = None) -> list[int]:
        """Open one import dialog per path, each asking the engine for its options; return
        the planning jobs' ids. The import itself starts when the dialog is confirmed."""
        jobs = []
        for path in paths:
            job = self.engine.plan_import(path)
            dialog = ImportDialog(str(path), parent or self.view.window())
            dialog.import_confirmed.connect(
                lambda recipe, context, d=dialog, p=path: self._start_import(d, p, recipe,
                                                                             context))
            dialog.finished.connect(lambda _r, d=dialog: self._forget(d))
            self.dialogs[job] = dialog
            dialog.open()
            jobs.append(job)
        return jobs

    def _forget(self, dialog: ImportDialog) -> None:
        for job in [j for j, d in self.dialogs.items() if d is dialog]:
            del self.dialogs[job]

    def _start_import(self, dialog: ImportDialog, path: Path, recipe: str,
                      context: int = 0) -> int:
        job = self.engine.import_path(path, recipe or None, context or None)
        self.dialogs[job] = dialog
        dialog.cancel_requested.connect(lambda: self.engine.cancel(job))
        return job

    def delete(self, name: str) -> int:
        return self.engine.remove(name)

    # -- slots: view -----------------------------------------------------------------------
    @Slot()
    def _on_import_requested(self) -> None:
        parent = self.view.window()
        file, _ = QFileDialog.getOpenFileName(
            parent, "Import model", str(Path.home()), "GGUF files (*.gguf);;All files (*)")
        if file:
            self.import_paths([Path(file)])

    @Slot(str)
    def _on_delete_requested(self, name: str) -> None:
        answer = QMessageBox.question(
            self.view.window(), "Delete model",
            f"Delete {name} from the library? Its files are removed from disk.")
        if answer == QMessageBox.StandardButton.Yes:
            self.delete(name)

    @Slot(str)
    def _on_default_requested(self, name: str) -> None:
        self.set_default(name)

    # -- slots: engine ---------------------------------------------------------------------
    @Slot(int, dict)
    def _on_import_planned(self, job: int, info: dict[str, Any]) -> None:
        if job in self.dialogs:
            self.dialogs[job].show_options(info)
            self.import_planned.emit(job)

    @Slot(int, dict)
    def _on_import_started(self, job: int, info: dict[str, Any]) -> None:
        if job in self.dialogs:
            self.dialogs[job].show_started(str(info.get("kind", "")))

    @Slot(int, int, int)
    def _on_import_progress(self, job: int, done: int, total: int) -> None:
        if job in self.dialogs:
            self.dialogs[job].show_progress(done, total)

    @Slot(int, dict)
    def _on_import_finished(self, job: int, manifest: dict[str, Any]) -> None:
        if job in self._found_jobs:  # a found GGUF or float folder, converted
            found, _ = self._found_jobs[job]
            Library(self.engine.home).update(str(manifest["name"]), found_in=found.app,
                                             placement="converted",
                                             external_path=str(found.path.resolve()))
            self._found_done(job, True, str(manifest["name"]))
            self.import_done.emit(job, True, str(manifest["name"]))
            return
        if job in self.dialogs:
            self.dialogs[job].show_finished(manifest)
        self.refresh()
        self.view.select_name(str(manifest["name"]))
        self.import_done.emit(job, True, str(manifest["name"]))

    @Slot(int, str)
    def _on_model_removed(self, job: int, name: str) -> None:
        if self.store.setting(DEFAULT_KEY) == name:
            self.store.set_setting(DEFAULT_KEY, "")
        self.refresh()

    @Slot(dict)
    def _on_starter_ready(self, manifest: dict[str, Any]) -> None:
        self.refresh()

    @Slot(object)
    def _on_profile_chosen(self, _profile: object) -> None:
        self.refresh_fits()  # they can be reckoned now

    @Slot(dict)
    def _on_model_loaded(self, _info: dict[str, Any]) -> None:
        self.refresh_fits()  # the loaded model's weights are what a load frees first

    @Slot(int, str, str)
    def _on_error_occurred(self, job: int, what: str, message: str) -> None:
        if what not in ("import", "remove"):
            return
        self.last_error = message
        if what == "import" and job in self._found_jobs:
            self._found_done(job, False, message)
            self.import_done.emit(job, False, message)
            return
        if what == "import":
            dialog = self.dialogs.get(job)
            if dialog is not None:
                dialog.show_refused(message, cancelled=message.endswith("cancelled"))
            self.import_done.emit(job, False, message)
        else:
            QMessageBox.warning(self.view.window(), "Delete model", message)


def _remove(link: Path) -> None:
    """A staging link, or a folder of them (the files they point at stay)."""
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():
        shutil.rmtree(link, ignore_errors=True)
