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

Discover (the window's tab) uses the second half: `search_models(query, fmt, architecture,
min_params, max_params)` lists GGUF and MLX repositories through HfApi.list_models;
`list_variants(repo_id)` reads model_info(files_metadata=True) and gives each GGUF file (split
parts together) and the MLX folder as a `Variant` with its size, bits per weight and what
engine.runtime.fit's estimate needs (`Variant.fit(profile)`): the config and weight sizes from
a GGUF's header (fetched with HTTP Range into a sparse file and opened with open_source) or
from the MLX folder's config.json and safetensors headers. `start_download(home, variant)` /
`download(folder, progress, cancel)` fetch it under STRATA_HOME/downloads, file by file into
`.part` files resumed with HTTP Range (after a dropped connection, a pause, a restart:
`pending_downloads`), each checked against the Hub's LFS sha256 (or git blob id) before it is
renamed into place; a mismatch removes it and raises FetchFailed. HF_ENDPOINT is read on each
call. No Qt here: the window runs these on a thread of its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import Cancelled, FetchFailed, ImportFailed, StrataError
from engine.importers import import_path
from engine.importers.hf import INDEX_FILE, check_config, select_weight_files
from engine.importers.source import Source, open_source
from engine.library.store import Library, Manifest, check_name, clean_name
from engine.platform import ComputeProfile
from engine.runtime.fit import Fit, WeightSizes, estimate
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



# == Discover: search, variants, resumable downloads ========================================
# The window's Discover tab: what the Hub has (search_models), what each repository offers
# (list_variants: its GGUF files, or its MLX folder, each with size, bits per weight and what
# the fit estimate says), and a download that survives a dropped connection, a pause and a
# restart (download), checked against the Hub's checksums. Import is the caller's
# (import_path, or engine.library.found.install_linked for an MLX folder).
GGUF, MLX = "gguf", "mlx"
SEARCH_EXPAND = ["author", "downloads", "likes", "tags", "library_name", "gguf", "safetensors",
                 "config", "lastModified"]
STATE_FILE = "download.json"
PART = ".part"
CHUNK = 1 << 20
HEADER_FIRST = 2 << 20  # bytes of a GGUF asked for first; doubled until its header is whole
HEADER_MAX = 256 << 20
RETRIES = 3  # dropped connections in a row, with no byte between them, before giving up
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_FLOAT_NAMES = re.compile(r"(?i)(?:^|[-_.])(f32|f16|bf16|fp16|fp32)(?:[-_.]|$)")


def _endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it once, at its import)."""
    return (os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")


def _api() -> Any:
    from huggingface_hub import HfApi  # heavy: loads when the Hub is asked

    return HfApi(endpoint=_endpoint())


def _hub_call(what: str, call: Callable[[], Any]) -> Any:
    from huggingface_hub.errors import OfflineModeIsEnabled  # heavy: with the Hub client

    try:
        return call()
    except StrataError:
        raise
    except OfflineModeIsEnabled as exc:
        raise FetchFailed(f"{what}: HF_HUB_OFFLINE is set, so the Hub is not asked") from exc
    except _transport_errors() as exc:
        raise FetchFailed(f"{what}: cannot reach {_endpoint()} ({_one_line(exc)})") from exc
    except Exception as exc:  # huggingface_hub's own errors
        raise FetchFailed(f"{what}: {_reason(exc)}") from exc


@dataclass(frozen=True)
class HubModel:
    """One search result."""

    repo_id: str
    formats: tuple[str, ...]  # of GGUF, MLX
    architecture: str
    params: int  # 0: not known
    downloads: int
    likes: int


def _architecture(info: Any) -> str:
    gguf = getattr(info, "gguf", None) or {}
    config = getattr(info, "config", None) or {}
    arch = gguf.get("architecture") if isinstance(gguf, dict) else None
    if not arch and isinstance(config, dict):
        arch = config.get("model_type")
    return str(arch or "")


def _params(info: Any) -> int:
    gguf = getattr(info, "gguf", None)
    if isinstance(gguf, dict) and gguf.get("total"):
        return int(gguf["total"])
    st = getattr(info, "safetensors", None)
    return int(getattr(st, "total", 0) or 0)


def search_models(query: str = "", fmt: str = "all", architecture: str = "",
                  min_params: int = 0, max_params: int = 0, limit: int = 30) -> list[HubModel]:
    """Hub repositories in GGUF or MLX format (fmt 'gguf', 'mlx' or 'all') whose id contains
    `query`, of `architecture` (a Hub tag such as 'llama'; '' any) and within the parameter
    bounds (0: none), most downloaded first; FetchFailed with one line when the Hub fails."""
    formats = [GGUF, MLX] if fmt == "all" else [fmt]
    bounds = ",".join(x for x in (f"min:{min_params}" if min_params else "",
                                  f"max:{max_params}" if max_params else "") if x) or None
    found: dict[str, HubModel] = {}
    api = _api()
    for f in formats:
        filters = [f] + ([architecture] if architecture else [])

        def listing(filters: list[str] = filters) -> list[Any]:
            return list(api.list_models(search=query or None, filter=filters,
                                        num_parameters=bounds, sort="downloads", limit=limit,
                                        expand=SEARCH_EXPAND))

        for info in _hub_call(f"search for {query!r}", listing):
            tags = set(getattr(info, "tags", None) or [])
            kinds = tuple(k for k in (GGUF, MLX)
                          if k in tags or getattr(info, "library_name", None) == k or k == f)
            old = found.get(info.id)
            if old is not None:
                kinds = tuple(sorted(set(old.formats) | set(kinds)))
            found[info.id] = HubModel(info.id, kinds, _architecture(info), _params(info),
                                      int(getattr(info, "downloads", 0) or 0),
                                      int(getattr(info, "likes", 0) or 0))
    return sorted(found.values(), key=lambda m: -m.downloads)[:limit]


# -- variants -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteFile:
    """One file of a repository at a commit, with what the Hub says its bytes are."""

    path: str
    size: int
    sha256: str | None = None  # an LFS file's
    blob_id: str | None = None  # the git blob id (sha1 of "blob <size>\\0" + bytes)


@dataclass
class Variant:
    """One way to download a repository: a GGUF file (all parts of a split one) or the MLX
    folder. `config` and `weights` are what the fit estimate needs (None: not known);
    `exact` is False where the weights were scaled from another variant's header by size."""

    repo_id: str
    commit: str
    kind: str  # GGUF or MLX
    label: str  # the file name, or "MLX folder"
    files: list[RemoteFile]
    config: dict[str, Any] | None = None
    weights: WeightSizes | None = None
    exact: bool = True

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bits_per_weight(self) -> float | None:
        """Bits on disk per parameter: the weight files' bytes (the GGUF parts, or the MLX
        folder's safetensors) over the parameters (None: not known)."""
        if self.weights is None or not self.weights.params:
            return None
        files = [f for f in self.files if f.path.endswith((".gguf", ".safetensors"))]
        return sum(f.size for f in files) * 8 / self.weights.params

    @property
    def name(self) -> str:
        """The library name an import gives it."""
        if self.kind == GGUF:
            return clean_name(_SPLIT.sub("", self.label).removesuffix(".gguf"))
        return clean_name(self.repo_id.split("/")[-1])

    def fit(self, profile: ComputeProfile, context: int | None = None, **kv: Any) -> Fit | None:
        """engine.runtime.fit's estimate for this variant once imported (None: not known)."""
        if self.config is None or self.weights is None:
            return None
        return estimate(self.config, self.weights, profile, context, **kv)

    def to_json(self) -> dict[str, Any]:
        w = self.weights
        return {"repo_id": self.repo_id, "commit": self.commit, "kind": self.kind,
                "label": self.label, "files": [vars(f) for f in self.files],
                "config": self.config, "exact": self.exact,
                "weights": None if w is None else [w.quant_params, w.quant_bytes,
                                                   w.float_params, w.other_bytes]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Variant:
        w = data.get("weights")
        return cls(str(data["repo_id"]), str(data["commit"]), str(data["kind"]),
                   str(data["label"]), [RemoteFile(**f) for f in data["files"]],
                   data.get("config"), WeightSizes(*w) if w else None,
                   bool(data.get("exact", True)))


def _url(repo_id: str, commit: str, path: str) -> str:
    from huggingface_hub import hf_hub_url  # heavy: loads when the Hub is asked

    return str(hf_hub_url(repo_id, path, revision=commit, endpoint=_endpoint()))


def _get_range(repo_id: str, commit: str, path: str, start: int, end: int) -> bytes:
    """Bytes start..end (inclusive) of a repository file."""
    from huggingface_hub import get_session  # heavy: loads when the Hub is asked
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    def fetch() -> bytes:
        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end}"}
        r = get_session().get(_url(repo_id, commit, path), headers=headers, timeout=60)
        hf_raise_for_status(r)
        data = bytes(r.content)
        return data[start:end + 1] if r.status_code == 200 else data  # no Range support

    return bytes(_hub_call(f"{repo_id}/{path}", fetch))


def gguf_header_length(buf: bytes) -> int | None:
    """Where a GGUF's header (metadata and tensor index, before the alignment padding) ends
    in `buf`, its first bytes; None when `buf` holds only part of it."""
    try:
        off = 8
        order = "<" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF else ">"
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, off)
        off += 16
        sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

        def string(o: int) -> int:
            (n,) = struct.unpack_from(order + "Q", buf, o)
            return o + 8 + n

        def value(vtype: int, o: int) -> int:
            if vtype in sizes:
                return o + sizes[vtype]
            if vtype == 8:
                return string(o)
            if vtype == 9:
                itype, count = struct.unpack_from(order + "IQ", buf, o)
                o += 12
                if itype in sizes:
                    return o + count * sizes[itype]
                for _ in range(count):
                    o = value(itype, o)
                    if o > len(buf):
                        raise IndexError
                return o
            raise ValueError(f"value type {vtype}")

        for _ in range(n_kv):
            off = string(off)
            (vtype,) = struct.unpack_from(order + "I", buf, off)
            off = value(vtype, off + 4)
        for _ in range(n_tensors):
            off = string(off)
            (n_dims,) = struct.unpack_from(order + "I", buf, off)
            off += 4 + 8 * n_dims + 4 + 8
        return off if off <= len(buf) else None
    except (struct.error, IndexError):
        return None


def _gguf_source(repo_id: str, commit: str, parts: list[RemoteFile], tmp: Path,
                 cancel: CancelFlag) -> Source:
    """The variant's GGUF opened from its headers alone: each part's first bytes written into
    a sparse file of its full size (the tensors' bytes are holes), then open_source."""
    for part in parts:
        want = min(part.size, HEADER_FIRST)
        while True:
            if cancel():
                raise Cancelled(f"reading {repo_id}")
            head = _get_range(repo_id, commit, part.path, 0, want - 1)
            if head[:4] != b"GGUF":
                raise FetchFailed(f"{repo_id}/{part.path}: not a GGUF file")
            end = gguf_header_length(head)
            if end is not None or want >= min(part.size, HEADER_MAX):
                break
            want = min(part.size, want * 2)
        if end is None:
            raise FetchFailed(f"{repo_id}/{part.path}: GGUF header larger than "
                              f"{HEADER_MAX >> 20} MB")
        local = tmp / Path(part.path).name
        with open(local, "wb") as fh:
            fh.write(head)
            fh.truncate(part.size)
    return open_source(tmp / Path(parts[0].path).name)


def _gguf_groups(files: list[RemoteFile]) -> list[list[RemoteFile]]:
    """The model GGUFs of a listing, split parts together, smallest first; vision projectors
    left out."""
    groups: dict[str, list[RemoteFile]] = {}
    for f in files:
        base = Path(f.path).name.lower()
        if not base.endswith(".gguf") or base.startswith("mmproj") or "-mmproj" in base:
            continue
        key = _SPLIT.sub("", f.path)
        groups.setdefault(key, []).append(f)
    parts = [sorted(g, key=lambda f: f.path) for g in groups.values()]
    return sorted(parts, key=lambda g: (sum(f.size for f in g), g[0].path))  # smallest first


def _mlx_variant(repo_id: str, commit: str, files: list[RemoteFile]) -> Variant | None:
    from huggingface_hub import get_session  # heavy: loads when the Hub is asked
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    top = [f for f in files if "/" not in f.path]
    names = {f.path for f in top}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        return None

    def config() -> Any:
        r = get_session().get(_url(repo_id, commit, "config.json"), headers=build_hf_headers(),
                              timeout=60)
        hf_raise_for_status(r)
        return r.json()

    cfg = _hub_call(f"{repo_id}/config.json", config)
    if not isinstance(cfg, dict) or "quantization" not in cfg:
        return None  # float weights: not an MLX folder (strata pull quantizes those)
    api = _api()
    items: dict[str, tuple[int, int, str]] = {}
    wanted = [f for f in top if f.path.endswith(".safetensors")]
    for f in wanted:

        def header(path: str = f.path) -> Any:
            return api.parse_safetensors_file_metadata(repo_id, path, revision=commit)

        meta = _hub_call(f"{repo_id}/{f.path}", header)
        for key, t in meta.tensors.items():
            start, end = t.data_offsets
            items[key] = (int(t.parameter_count), int(end) - int(start), str(t.dtype))
    keep = [f for f in top if f.path.endswith((".safetensors", ".json", ".jinja", ".txt"))
            or f.path == "tokenizer.model"]
    return Variant(repo_id, commit, MLX, "MLX folder", keep, cfg,
                   WeightSizes.from_items(cfg, items))


def list_variants(repo_id: str, cancel: CancelFlag | None = None) -> list[Variant]:
    """The repository's GGUF files and its MLX folder, each a Variant (see there). One GGUF
    header is read (the smallest file's): its config serves every GGUF of the repository,
    whose weights are scaled from it by file size (exact only for the one read)."""
    parse_repo_id(repo_id)
    cancel = cancel or (lambda: False)
    info = _hub_call(repo_id, lambda: _api().model_info(repo_id, files_metadata=True))
    commit = str(info.sha or "main")
    files = [RemoteFile(s.rfilename, int(s.size or (s.lfs.size if s.lfs else 0) or 0),
                        s.lfs.sha256 if s.lfs else None, s.blob_id)
             for s in (info.siblings or [])]
    out: list[Variant] = []
    groups = _gguf_groups(files)
    if groups:
        rep = min(groups, key=lambda g: sum(f.size for f in g))
        with tempfile.TemporaryDirectory(prefix="strata-gguf-head-") as tmp:
            try:
                source: Source | None = _gguf_source(repo_id, commit, rep, Path(tmp), cancel)
            except ImportFailed:
                source = None  # an architecture Strata cannot run: listed, without a fit
            rep_sizes = source.weight_sizes() if source is not None else None
        rep_bytes = sum(f.size for f in rep)
        for g in groups:
            sizes = rep_sizes
            if sizes is not None and g is not rep:
                label = Path(g[0].path).name
                extra = sum(f.size for f in g) - rep_bytes
                if _FLOAT_NAMES.search(label):  # every weight a float
                    sizes = WeightSizes(0, 0, sizes.params, sizes.other_bytes)
                else:
                    sizes = WeightSizes(sizes.quant_params, max(0, sizes.quant_bytes + extra),
                                        sizes.float_params, sizes.other_bytes)
            out.append(Variant(repo_id, commit, GGUF, Path(g[0].path).name, g,
                               source.config if source is not None else None, sizes,
                               exact=g is rep))
    mlx = _mlx_variant(repo_id, commit, files)
    if mlx is not None:
        out.append(mlx)
    return out


# -- downloads ------------------------------------------------------------------------------
def downloads_dir(home: Path) -> Path:
    """Where partial and finished downloads live: STRATA_HOME/downloads."""
    return Path(home) / "downloads"


def start_download(home: Path, variant: Variant) -> Path:
    """The folder of a new (or the same unfinished) download of `variant`, its state written."""
    folder = downloads_dir(home) / clean_name(f"{variant.repo_id.replace('/', '--')}--"
                                              f"{variant.label}")
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / STATE_FILE
    tmp = state.with_suffix(".tmp")
    tmp.write_text(json.dumps(variant.to_json(), indent=1))
    tmp.replace(state)
    return folder


def pending_downloads(home: Path) -> list[tuple[Path, Variant, int]]:
    """Unfinished downloads (folder, variant, bytes already on disk), to resume after a
    restart; folders without a readable state are left alone."""
    out = []
    root = downloads_dir(home)
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        try:
            variant = Variant.from_json(json.loads((folder / STATE_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out.append((folder, variant, downloaded_bytes(folder, variant)))
    return out


def _files_root(folder: Path, variant: Variant) -> Path:
    """Where a download's files go: the folder (a GGUF), or a subfolder named as the model
    (an MLX folder, so that its import takes the repository's name)."""
    return folder / variant.name if variant.kind == MLX else folder


def downloaded_bytes(folder: Path, variant: Variant) -> int:
    done = 0
    folder = _files_root(folder, variant)
    for f in variant.files:
        final, part = folder / f.path, folder / (f.path + PART)
        if final.is_file():
            done += final.stat().st_size
        elif part.is_file():
            done += min(part.stat().st_size, f.size)
    return done


def discard_download(folder: Path) -> None:
    """Remove a download's folder, parts and all (cancel)."""
    shutil.rmtree(folder, ignore_errors=True)


def _hasher(f: RemoteFile) -> Any:
    if f.sha256:
        return hashlib.sha256()
    h = hashlib.sha1()  # noqa: S324  (git's blob id is SHA-1; a checksum, not a signature)
    h.update(b"blob %d\0" % f.size)
    return h


def _expected(f: RemoteFile) -> str | None:
    return f.sha256 or f.blob_id


def _transport_errors() -> tuple[type[BaseException], ...]:
    import httpx2  # heavy: huggingface_hub's HTTP client, loaded with it

    return (httpx2.TransportError, OSError)


def _fetch_file(repo_id: str, commit: str, f: RemoteFile, folder: Path, before: int,
                total: int, progress: Progress | None, cancel: CancelFlag) -> None:
    """Download one file into folder/<path>.part from where it stopped, check it, rename it."""
    from huggingface_hub import get_session  # heavy: loads when the Hub is asked
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    final, part = folder / f.path, folder / (f.path + PART)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > f.size:
        part.unlink()
        have = 0
    digest = _hasher(f)
    if have:  # the bytes already here count in the checksum: read them once
        with open(part, "rb") as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
    failures = 0
    errors = _transport_errors()
    while have < f.size or not part.is_file():
        if cancel():
            raise Cancelled(f"download of {repo_id}/{f.path}")
        headers = build_hf_headers()
        if have:
            headers["Range"] = f"bytes={have}-"
        start = have
        try:
            with get_session().stream("GET", _url(repo_id, commit, f.path), headers=headers,
                                      timeout=60) as r:
                if r.status_code >= 400:
                    r.read()
                    hf_raise_for_status(r)
                if have and r.status_code != 206:  # the server ignored the Range: start over
                    have, digest = 0, _hasher(f)
                    part.unlink(missing_ok=True)
                with open(part, "ab") as fh:
                    for chunk in r.iter_bytes(CHUNK):
                        fh.write(chunk)
                        digest.update(chunk)
                        have += len(chunk)
                        if progress is not None:
                            progress(before + min(have, f.size), total)
                        if cancel():
                            raise Cancelled(f"download of {repo_id}/{f.path}")
        except StrataError:
            raise
        except errors as exc:
            failures = 0 if have > start else failures + 1
            if failures >= RETRIES:
                raise FetchFailed(f"{repo_id}/{f.path}: connection lost after {have:,} of "
                                  f"{f.size:,} bytes ({_one_line(exc)}); the part is kept, "
                                  "resume to continue") from exc
            continue
        except Exception as exc:  # huggingface_hub's HTTP errors
            raise FetchFailed(f"{repo_id}/{f.path}: {_reason(exc)}") from exc
        if have == start and have < f.size:
            failures += 1  # an empty answer: count it like a dropped connection
            if failures >= RETRIES:
                raise FetchFailed(f"{repo_id}/{f.path}: the server sent nothing after "
                                  f"{have:,} of {f.size:,} bytes; the part is kept")
    got, want = digest.hexdigest(), _expected(f)
    if have != f.size or (want and got != want):
        part.unlink(missing_ok=True)
        what = (f"size {have:,} bytes, the Hub lists {f.size:,}" if have != f.size else
                f"{'sha256' if f.sha256 else 'git blob id'} {got[:16]}…, the Hub lists "
                f"{str(want)[:16]}…")
        raise FetchFailed(f"{repo_id}/{f.path}: checksum mismatch ({what}); the download "
                          "was removed and nothing was imported")
    with open(part, "rb+") as fh:
        os.fsync(fh.fileno())
    part.replace(final)


def download(folder: Path, progress: Progress | None = None,
             cancel: CancelFlag | None = None) -> Path:
    """Fetch (or go on fetching) the download in `folder` (start_download made it); return
    the .gguf (first part) or the MLX folder (folder/<model name>) once every file is whole
    and matches the Hub's checksum. Cancelled leaves the parts for a later call (pause); a
    dropped connection is retried from where it stopped (HTTP Range); a checksum mismatch
    removes that file and raises FetchFailed. `progress(done, total)` counts bytes, the
    parts already here included."""
    variant = Variant.from_json(json.loads((folder / STATE_FILE).read_text()))
    cancel = cancel or (lambda: False)
    total = variant.bytes
    root = _files_root(folder, variant)
    done = 0
    for f in variant.files:
        if Path(f.path).is_absolute() or ".." in Path(f.path).parts:
            raise FetchFailed(f"refusing file name {f.path!r} from {variant.repo_id}")
        if not (root / f.path).is_file():
            _fetch_file(variant.repo_id, variant.commit, f, root, done, total, progress,
                        cancel)
        done += f.size
        if progress is not None:
            progress(done, total)
    return root / variant.files[0].path if variant.kind == GGUF else root
