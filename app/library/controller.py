"""The library screen's logic: list models, import (drop, menu, Dock), delete, set default.

Contract: the listing reads manifests (cheap file reads) on the GUI thread; imports and
deletes run on the engine thread. Each import gets an `ImportDialog`: the engine first
reports what the file is and what each recipe would weigh (a planning job), the user picks
one and the import job starts; both jobs map to the same dialog in `dialogs`. A refusal shows
the engine's one-line reason and leaves the library as it was (a model that would not fit in
memory is refused in the dialog, before the job, and again by the engine). The listing carries
each model's fit (app.worker.Engine.fits), refreshed when the engine has settled its compute
profile and after each load. `models_changed(names, default)` fires whenever either changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, Signal, Slot
from PySide6.QtWidgets import QFileDialog, QMessageBox, QWidget

from app.chat.store import ChatStore
from app.library.model import LibraryModel
from app.library.view import ImportDialog, LibraryView
from app.worker import Engine

DEFAULT_KEY = "default_model"


class LibraryController(QObject):
    models_changed = Signal(list, str)  # names, default name
    import_planned = Signal(int)  # planning job: its dialog now offers the recipes
    import_done = Signal(int, bool, str)  # job, imported, model name or reason

    def __init__(self, store: ChatStore, engine: Engine, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.engine = engine
        self.model = LibraryModel(self)
        self.view = LibraryView(self.model)
        self.dialogs: dict[int, ImportDialog] = {}
        self.last_error = ""
        self.view.import_requested.connect(self._on_import_requested)
        self.view.delete_requested.connect(self._on_delete_requested)
        self.view.default_requested.connect(self._on_default_requested)
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
        self.models_changed.emit([m["name"] for m in manifests], default)

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
        if what == "import":
            dialog = self.dialogs.get(job)
            if dialog is not None:
                dialog.show_refused(message, cancelled=message.endswith("cancelled"))
            self.import_done.emit(job, False, message)
        else:
            QMessageBox.warning(self.view.window(), "Delete model", message)
