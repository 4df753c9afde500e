"""Hugging Face Hub repositories into the library: download with huggingface_hub, then import.

Contract: `pull_hub(library, "OWNER/NAME", ...)` fetches only what a model needs (config and
tokenizer files, chat templates, and the weight files the loaders read: the shards named by
model.safetensors.index.json, else model*.safetensors) through huggingface_hub's
snapshot_download, so its cache (HF_HOME, HF_HUB_CACHE), HF_ENDPOINT, HF_TOKEN and offline mode
(HF_HUB_OFFLINE) apply unchanged; then it imports the snapshot with engine.importers.import_path
(MLX folders as they are, float folders converted and quantized with the default recipe). The
model's source is "hub:OWNER/NAME@<commit>" and its default name clean_name(NAME).
A download problem raises FetchFailed, an import problem ImportFailed, each with one line that
names the repository and the reason; the library is unchanged on any failure. `progress(done,
total)` covers the whole pull on one scale of 1000 (download by bytes, then the import), rising
only; during the download it is called from huggingface_hub's download threads. `cancel` is
checked as bytes arrive and between steps. The config is checked before any weights are
fetched (architecture known to mlx-lm, not a pre-quantized float checkpoint). Nothing is printed.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, FetchFailed, ImportFailed, StrataError
from engine.importers import import_path
from engine.importers.hf import INDEX_FILE, check_config, select_weight_files
from engine.library.store import Library, Manifest, check_name, clean_name
from engine.telemetry import CancelFlag, Progress

SCALE = 1000  # progress units for the whole pull
DOWNLOAD_SHARE = 500  # of which the download takes the first half
# Everything but the weights; top level only (ignore "*/*": onnx/, original/, ... stay remote).
META_PATTERNS = ["*.json", "*.jinja", "tokenizer.model"]
TOP_LEVEL_ONLY = ["*/*"]
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO_ID_RE = re.compile(rf"^{_PART}/{_PART}$")


def parse_repo_id(text: str) -> tuple[str, str]:
    """(owner, name) of a Hub model id, or FetchFailed saying what a valid one looks like."""
    repo_id = text.strip()
    if (not _REPO_ID_RE.match(repo_id) or "--" in repo_id or ".." in repo_id
            or repo_id.endswith(".git")):
        shown = repr(text if len(text) <= 80 else text[:77] + "...")
        raise FetchFailed(f"{shown} is not a Hugging Face repository id (expected OWNER/NAME, "
                          "for example mlx-community/SmolLM2-135M-Instruct-8bit)")
    owner, name = repo_id.split("/")
    return owner, name


# -- progress and cancel through huggingface_hub's progress bars --------------------------
class _Reporter:
    """Turns the byte counts of huggingface_hub's bars into `progress` on the pull's scale."""

    def __init__(self, progress: Progress | None, cancel: CancelFlag, repo_id: str) -> None:
        self.progress = progress
        self.cancel = cancel
        self.repo_id = repo_id
        self.expected_bytes: int | None = None  # weight bytes to fetch, when the tree is known
        self.bars: list[Any] = []
        self.tracking = False  # count bytes (the weights) or not (the small files first)
        self.last = -1
        self.lock = threading.Lock()  # bars update from several download threads

    def check(self) -> None:
        if self.cancel():
            raise Cancelled(f"download of {self.repo_id}")

    def start(self, tracking: bool) -> None:
        """A new snapshot_download call: new bars."""
        with self.lock:
            self.bars = []
            self.tracking = tracking

    def report(self, value: int) -> None:
        value = max(0, min(SCALE, value))
        with self.lock:
            if self.progress is None or value <= self.last:
                return
            self.last = value
            self.progress(value, SCALE)

    def on_bytes(self) -> None:
        with self.lock:
            bars = [b for b in self.bars if b.unit == "B"] if self.tracking else []
        if not bars:
            return
        # The bars that count bytes (network, disk) see the same bytes over plain HTTP.
        done = max(b.n for b in bars)
        total = self.expected_bytes or min((b.total for b in bars if b.total), default=0)
        if total > 0:
            self.report(DOWNLOAD_SHARE * min(done, total) // total)

    def bar_class(self) -> type:
        """A tqdm stand-in for snapshot_download(tqdm_class=...): silent, and it reports."""
        reporter = self

        class SilentBar:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                self.total = kwargs.get("total") or 0
                self.n = kwargs.get("initial") or 0
                self.unit = kwargs.get("unit", "it")
                self.desc = kwargs.get("desc", "")
                self.disable = True
                self.format_dict: dict[str, Any] = {"rate": None}
                with reporter.lock:
                    reporter.bars.append(self)

            def __enter__(self) -> SilentBar:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

            def update(self, n: float | None = 1) -> None:
                reporter.check()
                self.n += int(n or 0)
                if self.unit == "B":
                    reporter.on_bytes()

            def __getattr__(self, name: str) -> Callable[..., None]:
                # close, refresh, set_description, set_postfix_str, ...: nothing to show.
                return lambda *args, **kwargs: None

        return SilentBar


# -- errors ---------------------------------------------------------------------------------
def _one_line(exc: BaseException, limit: int = 160) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _root(exc: BaseException) -> BaseException:
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__ or exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def _reason(exc: BaseException) -> str:
    """One line for a huggingface_hub (or HTTP client) error."""
    # heavy (HTTP client stack): huggingface_hub loads only when a pull fails or runs
    from huggingface_hub import constants
    from huggingface_hub import errors as hf_errors
    from huggingface_hub import utils as hf

    incomplete = getattr(hf_errors, "IncompleteSnapshotError", ())  # huggingface_hub >= 1.x
    endpoint = constants.ENDPOINT
    offline = bool(constants.HF_HUB_OFFLINE) or isinstance(_root(exc), hf.OfflineModeIsEnabled)
    if isinstance(exc, hf.GatedRepoError):
        return "gated repository: accept its conditions on the Hub, then log in (hf auth login)"
    if isinstance(exc, hf.RepositoryNotFoundError):
        return (f"repository not found on {endpoint} "
                "(a private repository needs a login: hf auth login)")
    if isinstance(exc, hf.RevisionNotFoundError):
        return "revision not found in the repository"
    if isinstance(exc, hf.DisabledRepoError):
        return "the repository is disabled on the Hub"
    if incomplete and isinstance(exc, incomplete):
        where = "HF_HUB_OFFLINE is set" if offline else f"{endpoint} cannot be reached"
        return f"the cached copy is incomplete and {where}"
    if isinstance(exc, hf.LocalEntryNotFoundError):
        if offline:
            return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
        return (f"cannot reach {endpoint} ({_one_line(_root(exc))}) "
                "and the repository is not in the local cache")
    if isinstance(exc, hf.OfflineModeIsEnabled):
        return "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set"
    if isinstance(exc, hf.EntryNotFoundError):
        return f"a file the Hub listed is missing ({_one_line(exc)})"
    if isinstance(exc, hf.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        return f"the Hub answered HTTP {status} ({_one_line(exc)})"
    return f"download failed ({type(exc).__name__}: {_one_line(exc)})"


def _no_match_warning(record: logging.LogRecord) -> bool:
    """Drop huggingface_hub's 'No files matched' warning: pull_hub reports that case itself."""
    return not str(record.msg).startswith("No files matched")


def _snapshot(repo_id: str, reporter: _Reporter, tracking: bool, **kwargs: Any) -> Path:
    from huggingface_hub import snapshot_download  # heavy: loads only when a pull runs

    reporter.check()
    reporter.start(tracking)
    log = logging.getLogger("huggingface_hub._snapshot_download")
    log.addFilter(_no_match_warning)
    try:
        folder = snapshot_download(repo_id, repo_type="model", tqdm_class=reporter.bar_class(),
                                   **kwargs)
    except StrataError:
        raise
    except Exception as exc:
        # huggingface_hub raises its own errors and those of its HTTP client (httpx here,
        # requests in older releases), OSError and ValueError: all are failed downloads.
        raise FetchFailed(f"{repo_id}: {_reason(exc)}") from exc
    finally:
        log.removeFilter(_no_match_warning)
    return Path(folder)


def _tree(repo_id: str, commit: str) -> dict[str, int] | None:
    """{path: size} of the repository at `commit` from the cached listing; None if unknown."""
    try:
        from huggingface_hub import get_cached_repo_tree  # heavy: only when a pull runs
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:  # huggingface_hub before 1.x keeps no listing
        return None
    try:
        files = get_cached_repo_tree(repo_id, revision=commit)
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return None  # no cached listing: decide from the files instead
    return {f.path: int(f.size or 0) for f in files}


def _stage(snapshot: Path, names: list[str], dest: Path) -> None:
    """Link the chosen files of a snapshot into a folder of their own for the importer."""
    dest.mkdir()
    for rel in names:
        # Only plain top-level file names: a shard index naming "../x" or "a/b" must not
        # place a link outside the staging folder (the importer refuses it later anyway).
        if Path(rel).name != rel or rel in (".", ".."):
            raise FetchFailed(f"refusing file name {rel!r} from the repository (not a plain "
                              "file name)")
        src = snapshot / rel
        try:
            (dest / rel).symlink_to(src.resolve())
        except OSError:  # no symlinks here (some Windows setups)
            shutil.copy2(src, dest / rel)


# -- the pull -------------------------------------------------------------------------------
def pull_hub(
    library: Library,
    repo_id: str,
    name: str | None = None,
    progress: Progress | None = None,
    cancel: CancelFlag | None = None,
) -> Manifest:
    """Download a Hub model repository and import it; see the module docstring."""
    _, repo_name = parse_repo_id(repo_id)
    repo_id = repo_id.strip()
    name = check_name(name or clean_name(repo_name))
    if library.find(name) is not None:
        raise ImportFailed(f"a model named {name!r} is already in the library; pick another name")
    reporter = _Reporter(progress, cancel or (lambda: False), repo_id)

    snapshot = _snapshot(repo_id, reporter, False, allow_patterns=META_PATTERNS,
                         ignore_patterns=TOP_LEVEL_ONLY)
    commit = snapshot.name
    tree = _tree(repo_id, commit)
    ggufs = tree is not None and any(p.endswith(".gguf") for p in tree)
    hint = " (it holds GGUF files: download one and use strata import)" if ggufs else ""
    try:
        config = json.loads((snapshot / "config.json").read_text())
    except FileNotFoundError:
        raise FetchFailed(f"{repo_id}: no config.json in the repository{hint}") from None
    except (OSError, ValueError) as exc:
        raise FetchFailed(f"{repo_id}: unreadable config.json ({_one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise FetchFailed(f"{repo_id}: config.json is not a JSON object")
    check_config(config, repo_id)  # before fetching gigabytes that cannot be imported
    index = snapshot / INDEX_FILE
    index_text = index.read_text() if index.is_file() else None
    if tree is not None:
        weights = select_weight_files(tree, index_text)
        missing = [w for w in weights if w not in tree]
        if missing:
            raise FetchFailed(f"{repo_id}: {INDEX_FILE} names files the repository lacks "
                              f"({', '.join(missing[:3])})")
        reporter.expected_bytes = sum(tree[w] for w in weights) or None
        patterns = weights
    else:  # no listing: the index's shards, else whatever safetensors there are
        weights = []
        patterns = select_weight_files([], index_text) or ["*.safetensors"]
    if not patterns:
        raise FetchFailed(f"{repo_id}: no safetensors weights in the repository{hint}")

    snapshot = _snapshot(repo_id, reporter, True, revision=commit, allow_patterns=patterns,
                         ignore_patterns=TOP_LEVEL_ONLY)
    top = sorted(p.name for p in snapshot.iterdir() if p.is_file())
    if not weights:  # no cached listing: choose among what arrived
        weights = select_weight_files(top, index_text)
    meta = [n for n in top if n.endswith((".json", ".jinja")) or n == "tokenizer.model"]
    reporter.report(DOWNLOAD_SHARE)
    reporter.check()

    def import_progress(done: int, total: int) -> None:
        reporter.report(DOWNLOAD_SHARE + (SCALE - DOWNLOAD_SHARE) * done // max(total, 1))

    with tempfile.TemporaryDirectory(prefix="strata-hub-") as tmp:
        stage = Path(tmp) / clean_name(repo_name)
        _stage(snapshot, sorted(set(meta) | set(weights)), stage)
        try:
            manifest = import_path(library, stage, name=name, source=f"hub:{repo_id}@{commit}",
                                   progress=import_progress, cancel=cancel)
        except ImportFailed as exc:
            raise ImportFailed(str(exc).replace(str(stage), repo_id)) from exc
    reporter.report(SCALE)
    return manifest

