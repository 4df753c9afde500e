"""`strata pull OWNER/NAME` through huggingface_hub against a fake Hub on loopback.

Contract: a small http.server speaks the endpoints huggingface_hub 2.x's snapshot_download uses
(GET /api/models/{repo}/revision/{rev}, GET /api/models/{repo}/tree/{rev}, HEAD and GET
/{repo}/resolve/{rev}/{file} with X-Repo-Commit, ETag and Content-Length; LFS files answer 302
to a CDN host, here `localhost`, with X-Linked-Etag and X-Linked-Size; no Xet headers, so plain
HTTP), reached through HF_ENDPOINT with HF_HOME in a temporary folder. The real command
line pulls an MLX repository (used as is) and a sharded float repository (quantized), fetches
only what a model needs, lists, loads and generates from both; bad ids and missing repositories
fail in one line and leave the library alone; offline mode re-imports from the cache.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from tests.engine.hf_factory import write_hf_llama
from tests.helpers import REPO, run_strata

HF_REPO = "tiny-org/Tiny-Llama-HF"
MLX_REPO = "tiny-org/tiny-llama-4bit-mlx"
GGUF_REPO = "tiny-org/tiny-llama-gguf"
BERT_REPO = "tiny-org/tiny-bert"
# Files a pull must never fetch: docs, other formats, a stray checkpoint, subfolders.
JUNK = ("README.md", ".gitattributes", "pytorch_model.bin", "consolidated.safetensors",
        "onnx/model.onnx", "original/params.json")


# -- the fake Hub ---------------------------------------------------------------------------
def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".onnx", ".gguf"))


class FakeHub:
    """Model repositories served over HTTP the way huggingface.co serves them."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: dict[str, str] = {}
        self.meta: dict[str, dict[str, Any]] = {}  # repo: tags, params, architecture, downloads
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str]] = []  # (file name, Range header) of ranged answers
        self.drops: dict[str, int] = {}  # file name: close the connection after N bytes, once
        self.corrupt: set[str] = set()  # file names served with their last byte flipped
        self.pace = 0.0  # seconds per MiB sent (a slower network), 0: as fast as it goes
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # quiet

            def do_GET(self) -> None:  # noqa: N802
                hub.handle(self, body=True)

            def do_HEAD(self) -> None:  # noqa: N802
                hub.handle(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo_id: str, files: dict[str, bytes], **meta: Any) -> str:
        """A repository; `meta`: tags, params, architecture, downloads (search results)."""
        self.repos[repo_id] = files
        self.meta[repo_id] = meta
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + hashlib.sha256(files[name]).digest())
        self.commits[repo_id] = digest.hexdigest()
        return self.commits[repo_id]

    def start(self) -> FakeHub:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def fetched(self, repo_id: str) -> set[str]:
        """Files of a repository whose content was requested (GET on resolve or the CDN)."""
        by_sha = {hashlib.sha256(d).hexdigest(): n for n, d in self.repos[repo_id].items()}
        out = set()
        for method, path in self.requests:
            if method != "GET":
                continue
            if path.startswith(f"/{repo_id}/resolve/"):
                out.add(path.split("/resolve/", 1)[1].split("/", 1)[1])
            elif path.startswith("/cdn-lfs/") and path[9:] in by_sha:
                out.add(by_sha[path[9:]])
        return out

    # -- answering -------------------------------------------------------------------------
    def handle(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        query = parse_qs(urlsplit(req.path).query)
        self.requests.append((req.command, path))
        parts = path.strip("/").split("/")
        if parts == ["api", "models"]:
            return self.search(req, query, body)
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo_id = "/".join(parts[2:4])
            rest = parts[4:]
            if repo_id not in self.repos:
                return self.error(req, 404, "RepoNotFound", "Repository not found", body)
            if not rest or rest[0] == "revision":
                return self.info(req, repo_id, rest[1] if len(rest) > 1 else "main", body,
                                 blobs="blobs" in query)
            if rest[0] == "tree" and len(rest) >= 2:
                return self.tree(req, repo_id, rest[1], body)
        elif parts[0] == "cdn-lfs" and len(parts) == 2:
            return self.cdn(req, parts[1], body)
        elif len(parts) >= 5 and parts[2] == "resolve":
            repo_id = "/".join(parts[:2])
            if repo_id not in self.repos:
                return self.error(req, 404, "RepoNotFound", "Repository not found", body)
            return self.resolve(req, repo_id, parts[3], "/".join(parts[4:]), body)
        self.error(req, 404, None, "Not found", body)

    def check_rev(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool) -> bool:
        if rev in ("main", self.commits[repo_id]):
            return True
        self.error(req, 404, "RevisionNotFound", "Invalid rev id", body)
        return False

    def search(self, req: BaseHTTPRequestHandler, query: dict[str, list[str]],
               body: bool) -> None:
        """GET /api/models?search=&filter=&num_parameters=min:N,max:M&limit=&expand=..."""
        text = (query.get("search") or [""])[0].lower()
        filters = query.get("filter", [])
        bounds = dict(b.split(":") for b in (query.get("num_parameters") or [""])[0].split(",")
                      if ":" in b)
        out = []
        for repo_id in self.repos:
            meta = self.meta.get(repo_id, {})
            tags = list(meta.get("tags", []))
            params = int(meta.get("params", 0))
            if text not in repo_id.lower() or not all(f in tags for f in filters):
                continue
            if "min" in bounds and params < int(bounds["min"]):
                continue
            if "max" in bounds and params > int(bounds["max"]):
                continue
            item: dict[str, Any] = {"_id": "0" * 24, "id": repo_id, "tags": tags,
                                    "downloads": int(meta.get("downloads", 0)), "likes": 0,
                                    "library_name": "mlx" if "mlx" in tags else None}
            arch = meta.get("architecture", "")
            if "gguf" in tags:
                item["gguf"] = {"total": params, "architecture": arch}
            else:
                item["config"] = {"model_type": arch}
                item["safetensors"] = {"parameters": {"F16": params}, "total": params}
            out.append(item)
        out.sort(key=lambda m: -m["downloads"])
        limit = int((query.get("limit") or ["1000"])[0])
        self.send_json(req, out[:limit], body)

    def info(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool,
             blobs: bool = False) -> None:
        if not self.check_rev(req, repo_id, rev, body):
            return
        siblings: list[dict[str, Any]] = []
        for f, data in sorted(self.repos[repo_id].items()):
            entry: dict[str, Any] = {"rfilename": f}
            if blobs:  # files_metadata=True: size, git blob id, LFS sha256
                entry["size"] = len(data)
                entry["blobId"] = git_blob_id(data)
                if is_lfs(f):
                    entry["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(),
                                    "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        self.send_json(req, {
            "_id": "0" * 24, "id": repo_id, "modelId": repo_id, "private": False,
            "sha": self.commits[repo_id], "lastModified": "2025-01-01T00:00:00.000Z",
            "tags": list(self.meta.get(repo_id, {}).get("tags", ["mlx"])),
            "siblings": siblings,
        }, body)

    def tree(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, body: bool) -> None:
        if not self.check_rev(req, repo_id, rev, body):
            return
        entries: list[dict[str, Any]] = []
        folders = sorted({f.rsplit("/", 1)[0] for f in self.repos[repo_id] if "/" in f})
        for folder in folders:
            entries.append({"type": "directory", "oid": "d" * 40, "size": 0, "path": folder})
        for name, data in sorted(self.repos[repo_id].items()):
            entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                                     "oid": hashlib.sha1(data).hexdigest()}
            if is_lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                "pointerSize": 134}
            entries.append(entry)
        self.send_json(req, entries, body)

    def resolve(self, req: BaseHTTPRequestHandler, repo_id: str, rev: str, name: str,
                body: bool) -> None:
        if not self.check_rev(req, repo_id, rev, body):
            return
        data = self.repos[repo_id].get(name)
        if data is None:
            return self.error(req, 404, "EntryNotFound", "Entry not found", body,
                              {"X-Repo-Commit": self.commits[repo_id]})
        sha = hashlib.sha256(data).hexdigest()
        if is_lfs(name):  # the Hub redirects to its CDN, another host
            port = self.server.server_address[1]
            req.send_response(302)
            req.send_header("Location", f"http://localhost:{port}/cdn-lfs/{sha}")
            req.send_header("X-Linked-Etag", f'"{sha}"')
            req.send_header("X-Linked-Size", str(len(data)))
            req.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            req.send_header("X-Repo-Commit", self.commits[repo_id])
            req.send_header("Content-Length", "0")
            req.end_headers()
            return
        self.send_bytes(req, data, f'"{sha}"', body, {"X-Repo-Commit": self.commits[repo_id]},
                        name=name)

    def cdn(self, req: BaseHTTPRequestHandler, sha: str, body: bool) -> None:
        for files in self.repos.values():
            for name, data in files.items():
                if hashlib.sha256(data).hexdigest() == sha:
                    return self.send_bytes(req, data, f'"{sha}"', body, name=name)
        self.error(req, 404, None, "Not found", body)

    def send_bytes(self, req: BaseHTTPRequestHandler, data: bytes, etag: str, body: bool,
                   extra: dict[str, str] | None = None, name: str = "") -> None:
        """The file, or the part a `Range: bytes=A-B` asks for (206); a name in `drops` has
        its connection closed after that many bytes once, one in `corrupt` a byte flipped."""
        if name in self.corrupt:  # the last byte: a header read still works
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        start, end = 0, len(data) - 1
        ranged = str(req.headers.get("Range") or "")
        if ranged:
            self.ranges.append((name, ranged))
        if ranged.startswith("bytes="):
            a, _, b = ranged[6:].partition("-")
            start = int(a) if a else len(data) - int(b)
            end = min(int(b), len(data) - 1) if a and b else len(data) - 1
        req.send_response(206 if ranged else 200)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Content-Length", str(end - start + 1))
        if ranged:
            req.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        req.send_header("ETag", etag)
        req.send_header("Accept-Ranges", "bytes")
        for k, v in (extra or {}).items():
            req.send_header(k, v)
        req.end_headers()
        if not body:
            return
        cut = self.drops.pop(name, None) if name else None
        if cut is not None and cut < end - start + 1:
            req.wfile.write(data[start:start + cut])
            req.wfile.flush()
            req.close_connection = True  # mid-file: the client sees the body end early
            req.connection.shutdown(socket.SHUT_RDWR)
            return
        try:
            if not self.pace:
                req.wfile.write(data[start:end + 1])
            for at in range(start, end + 1, 1 << 20) if self.pace else ():
                req.wfile.write(data[at:min(at + (1 << 20), end + 1)])
                time.sleep(self.pace)  # the network's pace, not a test waiting
        except (ConnectionResetError, BrokenPipeError):
            pass  # the client stopped reading (a pause, a cancel)

    def send_json(self, req: BaseHTTPRequestHandler, obj: Any, body: bool) -> None:
        data = json.dumps(obj).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)

    def error(self, req: BaseHTTPRequestHandler, status: int, code: str | None, message: str,
              body: bool, extra: dict[str, str] | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        if code:
            req.send_header("X-Error-Code", code)
        req.send_header("X-Error-Message", message)
        for k, v in (extra or {}).items():
            req.send_header(k, v)
        req.end_headers()
        if body:
            req.wfile.write(data)


# -- repositories ---------------------------------------------------------------------------
def _read_folder(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def _junk(scratch: Path) -> dict[str, bytes]:
    """Files real repositories carry next to the weights; a valid but foreign checkpoint too."""
    import mlx.core as mx

    out = {name: f"not for Strata: {name}\n".encode() for name in JUNK}
    mx.save_safetensors(str(scratch / "decoy.safetensors"),
                        {"layers.0.attention.wq.weight": mx.zeros((4, 4))})
    out["consolidated.safetensors"] = (scratch / "decoy.safetensors").read_bytes()
    return out


@pytest.fixture(scope="module")
def repos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, bytes]]:
    """{repo id: files}: a sharded float llama, and an MLX folder made by importing one."""
    from engine.importers import import_path
    from engine.library import Library

    root = tmp_path_factory.mktemp("hub-repos")
    write_hf_llama(root / "hf", shards=2)
    write_hf_llama(root / "for-mlx", tie=True, seed=1)
    lib = Library(root / "lib")
    made = import_path(lib, root / "for-mlx", name="made")
    mlx_files = {k: v for k, v in _read_folder(Path(made["path"])).items()
                 if k != "manifest.json"}
    junk = _junk(root)
    bert = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2}
    return {HF_REPO: {**_read_folder(root / "hf"), **junk},
            MLX_REPO: {**mlx_files, "README.md": junk["README.md"]},
            GGUF_REPO: {"README.md": junk["README.md"], "tiny.Q4_0.gguf": b"GGUF" + bytes(64)},
            BERT_REPO: {"config.json": json.dumps(bert).encode(),
                        "model.safetensors": junk["consolidated.safetensors"],
                        "tokenizer.json": _read_folder(root / "hf")["tokenizer.json"]}}


def _start_hub(repos: dict[str, dict[str, bytes]]) -> FakeHub:
    hub = FakeHub()
    for repo_id, files in repos.items():
        hub.add(repo_id, files)
    return hub.start()


def _env(hub_url: str, hf_home: Path, offline: bool = False) -> dict[str, str | None]:
    return {"HF_ENDPOINT": hub_url, "HF_HOME": str(hf_home), "HF_HUB_CACHE": None,
            "HF_HUB_OFFLINE": "1" if offline else None, "HF_TOKEN": None,
            "HUGGING_FACE_HUB_TOKEN": None, "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture(scope="module")
def hub(repos: dict[str, dict[str, bytes]]) -> Iterator[FakeHub]:
    server = _start_hub(repos)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hub-strata-home")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hub-hf-home")


@pytest.fixture(scope="module")
def pulled(hub: FakeHub, home: Path, hf_home: Path) -> dict[str, dict[str, Any]]:
    """Both repositories pulled once through the real command line: {repo: manifest}."""
    out = {}
    for repo_id in (MLX_REPO, HF_REPO):
        proc = run_strata("pull", repo_id, "--json", home=home, env=_env(hub.url, hf_home),
                          timeout=120)
        assert proc.returncode == 0, proc.stderr
        out[repo_id] = json.loads(proc.stdout)
    return out


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("strata: error: ")
    return lines[0]


def _library_state(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


# -- tests ----------------------------------------------------------------------------------
def test_pull_mlx_repo_is_used_as_is(pulled: dict[str, dict[str, Any]], hub: FakeHub,
                                     repos: dict[str, dict[str, bytes]]) -> None:
    m = pulled[MLX_REPO]
    assert m["name"] == "tiny-llama-4bit-mlx"
    assert m["source"] == f"hub:{MLX_REPO}@{hub.commits[MLX_REPO]}"
    assert m["source_format"] == "mlx"
    assert m["quantization"]["embedding"] == ["affine 8-bit g64"]
    assert m["quantization"]["mlp"] == ["affine 4-bit g64"]
    folder = Path(m["path"])
    for name, data in repos[MLX_REPO].items():
        if name != "README.md":
            assert (folder / name).read_bytes() == data, name
    assert not (folder / "README.md").exists()


def test_pull_hf_repo_is_quantized_and_fetches_only_the_model(
        pulled: dict[str, dict[str, Any]], hub: FakeHub) -> None:
    m = pulled[HF_REPO]
    assert m["name"] == "tiny-llama-hf"
    assert m["source"] == f"hub:{HF_REPO}@{hub.commits[HF_REPO]}"
    assert m["source_format"] == "hf"
    assert m["architecture"] == "llama"
    assert m["quantization"]["embedding"] == ["affine 8-bit g64"]
    assert m["quantization"]["output"] == ["affine 8-bit g64"]
    assert m["quantization"]["attention"] == ["affine 4-bit g64"]
    assert 4.0 < m["bits_per_weight"] < 9.0
    config = json.loads((Path(m["path"]) / "config.json").read_text())
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8
    fetched = hub.fetched(HF_REPO)
    assert {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "config.json", "tokenizer.json", "tokenizer_config.json"} <= fetched
    assert not fetched & set(JUNK), fetched & set(JUNK)
    assert any(p.startswith("/cdn-lfs/") for _, p in hub.requests)  # weights came by the CDN


def test_models_lists_pulled_models(pulled: dict[str, dict[str, Any]], home: Path) -> None:
    proc = run_strata("models", "--json", home=home, timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = {m["name"]: m for m in json.loads(proc.stdout)}
    for repo_id, fmt in ((MLX_REPO, "mlx"), (HF_REPO, "hf")):
        m = listed[pulled[repo_id]["name"]]
        assert m["source_format"] == fmt
        assert m["source"].startswith(f"hub:{repo_id}@")
        assert m["fingerprint"].startswith("sha256:") and m["bytes"] > 0
        assert (Path(m["path"]) / "manifest.json").is_file()


@pytest.mark.parametrize("repo_id", [MLX_REPO, HF_REPO])
def test_pulled_model_loads_and_generates(pulled: dict[str, dict[str, Any]], repo_id: str) -> None:
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(pulled[repo_id]["path"])
    prompt = lm.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])
    events = list(generate(lm, prompt, SamplingParams(temperature=0.0), max_tokens=4))
    tokens = [e.token for e in events if e.token is not None]
    assert 1 <= len(tokens) <= 4
    assert events[-1].generated_tokens == len(tokens) + (events[-1].finish_reason == "stop")
    assert events[-1].finish_reason in ("length", "stop")


def test_missing_repo_fails_in_one_line(pulled: dict[str, dict[str, Any]], hub: FakeHub,
                                        home: Path, hf_home: Path) -> None:
    before = _library_state(home)
    proc = run_strata("pull", "tiny-org/does-not-exist", home=home, env=_env(hub.url, hf_home),
                      timeout=60)
    line = _one_error_line(proc)
    assert "tiny-org/does-not-exist" in line and "not found" in line
    assert _library_state(home) == before


@pytest.mark.parametrize(("repo_id", "words"), [
    (GGUF_REPO, ("no config.json", "GGUF", "strata import")),
    (BERT_REPO, ("'bert'", "not supported")),
])
def test_unusable_repo_fails_before_fetching_weights(
        repo_id: str, words: tuple[str, ...], pulled: dict[str, dict[str, Any]], hub: FakeHub,
        home: Path, hf_home: Path) -> None:
    before = _library_state(home)
    proc = run_strata("pull", repo_id, home=home, env=_env(hub.url, hf_home), timeout=60)
    line = _one_error_line(proc)
    assert repo_id in line and all(w in line for w in words), line
    fetched = hub.fetched(repo_id)
    assert not any(is_lfs(p) for p in fetched), fetched
    assert _library_state(home) == before


def test_existing_name_fails_before_downloading(pulled: dict[str, dict[str, Any]], hub: FakeHub,
                                                home: Path, hf_home: Path) -> None:
    seen = len(hub.requests)
    proc = run_strata("pull", MLX_REPO, home=home, env=_env(hub.url, hf_home), timeout=60)
    assert "already in the library" in _one_error_line(proc)
    assert len(hub.requests) == seen


@pytest.mark.parametrize("text", ["starter-model", "a/b/c", "owner/", "/name", "own er/name",
                                  "owner/na--me", "owner/name.git", "o/../x", "x\ny/z"])
def test_bad_repo_ids_fail_in_one_line(text: str, tmp_path: Path) -> None:
    from engine.errors import FetchFailed
    from engine.importers.hub import pull_hub
    from engine.library import Library

    lib = Library(tmp_path)
    with pytest.raises(FetchFailed) as info:
        pull_hub(lib, text)
    message = str(info.value)
    assert "\n" not in message and "OWNER/NAME" in message
    assert _library_state(tmp_path) == []


def test_offline_pull_reimports_from_cache(repos: dict[str, dict[str, bytes]],
                                           tmp_path: Path) -> None:
    """After one online pull, the cache serves HF_HUB_OFFLINE=1 and an unreachable Hub."""
    home, hf_home = tmp_path / "strata", tmp_path / "hf"
    server = _start_hub({HF_REPO: repos[HF_REPO]})
    try:
        first = run_strata("pull", HF_REPO, "--json", home=home, env=_env(server.url, hf_home),
                           timeout=120)
        assert first.returncode == 0, first.stderr
    finally:
        server.stop()
    online = json.loads(first.stdout)

    for name, offline in (("offline-copy", True), ("hub-down-copy", False)):
        proc = run_strata("pull", HF_REPO, "--name", name, "--json", home=home,
                          env=_env(server.url, hf_home, offline=offline), timeout=120)
        assert proc.returncode == 0, proc.stderr
        m = json.loads(proc.stdout)
        assert m["name"] == name
        assert m["source"] == online["source"]
        assert m["fingerprint"] == online["fingerprint"]

    before = _library_state(home)
    proc = run_strata("pull", "tiny-org/never-pulled", home=home,
                      env=_env(server.url, hf_home, offline=True), timeout=60)
    line = _one_error_line(proc)
    assert "tiny-org/never-pulled" in line and "HF_HUB_OFFLINE" in line
    proc = run_strata("pull", "tiny-org/never-pulled", home=home, env=_env(server.url, hf_home),
                      timeout=60)
    line = _one_error_line(proc)
    assert "tiny-org/never-pulled" in line and "cannot reach" in line
    assert _library_state(home) == before


PROGRESS_SCRIPT = """
import json, sys
from pathlib import Path
from engine.errors import Cancelled
from engine.library import Library
from engine.importers.hub import pull_hub

lib = Library(Path(sys.argv[1]))
calls = []
try:
    pull_hub(lib, sys.argv[2], name="cancelled", progress=lambda d, t: calls.append([d, t]),
             cancel=lambda: len(calls) > 0)
    cancelled = None
except Cancelled as exc:
    cancelled = str(exc)
left = sorted(p.name for p in (Path(sys.argv[1]) / "models").iterdir())
steps = []
m = pull_hub(lib, sys.argv[2], progress=lambda d, t: steps.append([d, t]))
print(json.dumps({"cancelled": cancelled, "left": left, "steps": steps, "name": m["name"]}))
"""


def test_progress_and_cancel(repos: dict[str, dict[str, bytes]], tmp_path: Path) -> None:
    """progress() rises to (1000, 1000); a cancel during the download leaves no trace."""
    import os

    server = _start_hub({MLX_REPO: repos[MLX_REPO]})
    env = dict(os.environ)
    for key, value in _env(server.url, tmp_path / "hf").items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    try:
        proc = subprocess.run([sys.executable, "-c", PROGRESS_SCRIPT, str(tmp_path / "lib"),
                               MLX_REPO], capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=120)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the engine prints nothing: no progress bars
    out = json.loads(proc.stdout)
    assert out["cancelled"] == f"download of {MLX_REPO} cancelled"
    assert out["left"] == []
    steps = out["steps"]
    assert steps[-1] == [1000, 1000]
    assert [d for d, _ in steps] == sorted({d for d, _ in steps})  # strictly rising
    assert any(0 < d < 500 for d, _ in steps) or [500, 1000] in steps
    assert out["name"] == "tiny-llama-4bit-mlx"


def test_staging_refuses_names_that_leave_the_folder(tmp_path: Path) -> None:
    """A shard index naming '../x' or 'a/b' never places a link outside the staging folder."""
    from engine.errors import FetchFailed
    from engine.importers.hub import _stage

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").write_bytes(b"x")
    for i, bad in enumerate(["../evil.safetensors", "sub/model.safetensors", ".."]):
        dest = tmp_path / f"stage{i}"
        with pytest.raises(FetchFailed, match="not a plain file name"):
            _stage(snapshot, [bad], dest)
        assert list(dest.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snapshot", "stage0", "stage1",
                                                          "stage2"]
    _stage(snapshot, ["model.safetensors"], tmp_path / "ok")
    assert (tmp_path / "ok" / "model.safetensors").read_bytes() == b"x"


# -- Discover: search, variants, resumable downloads ---------------------------------------
GGUF_DISCOVER = "tiny-org/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"
Q8 = "SmolLM2-135M-Instruct-Q8_0.gguf"
STARTER_PARAMS = 134_515_008


@pytest.fixture(scope="module")
def discover_hub(repos: dict[str, dict[str, bytes]]) -> Iterator[FakeHub]:
    """A GGUF repository (the starter, and a larger listed-only variant) and an MLX one,
    searchable, reached through HF_ENDPOINT in this process."""
    from engine.importers.starter import starter_gguf

    gguf_bytes = starter_gguf().read_bytes()
    hub = FakeHub()
    hub.add(GGUF_DISCOVER, {"README.md": b"# SmolLM2 GGUF\n", Q4: gguf_bytes,
                            Q8: gguf_bytes + bytes(40 << 20)},
            tags=["gguf", "llama"], params=STARTER_PARAMS, architecture="llama",
            downloads=500)
    hub.add(MLX_REPO, repos[MLX_REPO], tags=["mlx", "llama", "safetensors"], params=300_000,
            architecture="llama", downloads=20)
    hub.start()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _env(hub.url, Path("/nonexistent-hf-home")).items():
            if value is None:
                mp.delenv(key, raising=False)
            else:
                mp.setenv(key, value)
        yield hub
    hub.stop()


def test_search_by_name_format_architecture_and_size(discover_hub: FakeHub) -> None:
    from engine.importers.hub import search_models

    found = search_models("smollm2")
    assert [m.repo_id for m in found] == [GGUF_DISCOVER]
    assert found[0].formats == ("gguf",) and found[0].architecture == "llama"
    assert found[0].params == STARTER_PARAMS
    assert [m.repo_id for m in search_models("tiny", fmt="mlx")] == [MLX_REPO]
    assert {m.repo_id for m in search_models("tiny")} == {GGUF_DISCOVER, MLX_REPO}
    assert search_models("tiny", architecture="qwen2") == []
    assert [m.repo_id for m in search_models("", max_params=1_000_000)] == [MLX_REPO]
    assert [m.repo_id for m in search_models("", min_params=1_000_000)] == [GGUF_DISCOVER]
    searches = [p for m, p in discover_hub.requests if p == "/api/models"]
    assert searches  # through HfApi.list_models' own endpoint


def test_variants_have_size_bits_and_a_fit(discover_hub: FakeHub,
                                           repos: dict[str, dict[str, bytes]],
                                           tmp_path: Path) -> None:
    from engine.importers.hub import list_variants
    from engine.library.found import safetensors_headers
    from engine.platform import ComputeProfile
    from engine.runtime.fit import WeightSizes

    variants = list_variants(GGUF_DISCOVER)
    assert [v.label for v in variants] == [Q4, Q8]
    q4, q8 = variants
    assert q4.exact and not q8.exact
    assert q4.bytes == len(discover_hub.repos[GGUF_DISCOVER][Q4])
    assert q4.files[0].sha256 == hashlib.sha256(discover_hub.repos[GGUF_DISCOVER][Q4]
                                                ).hexdigest()
    assert q4.config is not None and q4.config["num_hidden_layers"] == 30
    assert q4.weights is not None and q4.weights.params == STARTER_PARAMS
    assert q4.bits_per_weight is not None and 5.5 < q4.bits_per_weight < 6.0
    assert q8.bits_per_weight is not None and q8.bits_per_weight > q4.bits_per_weight
    # Only the header was fetched, by HTTP Range: nowhere near the whole 98 MB file.
    assert all(r.startswith("bytes=0-") for p, r in discover_hub.ranges)
    profile = ComputeProfile("native", dequantize=False, dtype="float16")
    fit = q4.fit(profile)
    assert fit is not None and fit.context == 8192 and fit.weights_bytes > 0
    assert q8.fit(profile).weights_bytes > fit.weights_bytes  # type: ignore[union-attr]

    (mlx,) = list_variants(MLX_REPO)
    assert mlx.kind == "mlx" and mlx.label == "MLX folder"
    assert "README.md" not in {f.path for f in mlx.files}
    files = {f.path: repos[MLX_REPO][f.path] for f in mlx.files}
    assert mlx.bytes == sum(len(d) for d in files.values())
    assert mlx.config is not None and "quantization" in mlx.config
    for name, data in files.items():  # the sizes are the folder's own safetensors headers'
        (tmp_path / name).write_bytes(data)
    headers = safetensors_headers(sorted(tmp_path.glob("*.safetensors")))
    items = {k: (h.size, h.nbytes, h.dtype) for k, h in headers.items()}
    assert mlx.weights == WeightSizes.from_items(mlx.config, items)
    assert mlx.weights.quant_params > 0


def _pausing(limit: int, calls: list[tuple[int, int]]) -> tuple[Any, Any]:
    def progress(done: int, total: int) -> None:
        calls.append((done, total))

    return progress, (lambda: bool(calls) and calls[-1][0] >= limit)


def test_download_survives_a_dropped_connection_and_a_pause(discover_hub: FakeHub,
                                                            tmp_path: Path) -> None:
    from engine.errors import Cancelled
    from engine.importers.hub import download, list_variants, pending_downloads, start_download

    data = discover_hub.repos[GGUF_DISCOVER][Q4]
    q4 = list_variants(GGUF_DISCOVER)[0]
    discover_hub.ranges.clear()
    discover_hub.drops[Q4] = 20 << 20  # the connection drops 20 MB in
    folder = start_download(tmp_path, q4)
    calls: list[tuple[int, int]] = []
    progress, pause = _pausing(50 << 20, calls)
    with pytest.raises(Cancelled):
        download(folder, progress, pause)  # paused at 50 MB
    part = folder / (Q4 + ".part")
    assert (50 << 20) <= part.stat().st_size < len(data)
    assert not (folder / Q4).exists()
    # The drop was resumed from where it stopped, in the same call.
    assert [r for _, r in discover_hub.ranges] == [f"bytes={20 << 20}-"]

    # A restart: the pending download is found from its state file and resumed.
    (pending,) = pending_downloads(tmp_path)
    assert pending[0] == folder and pending[1].label == Q4 and pending[2] == part.stat().st_size
    have = part.stat().st_size
    calls.clear()
    path = download(folder, lambda d, t: calls.append((d, t)))
    assert path == folder / Q4 and path.read_bytes() == data
    assert not part.exists()
    assert discover_hub.ranges[-1][1] == f"bytes={have}-"
    assert calls[0][0] >= have and calls[-1] == (len(data), len(data))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_checksum_mismatch_is_refused_and_removed(discover_hub: FakeHub,
                                                  tmp_path: Path) -> None:
    from engine.errors import FetchFailed
    from engine.importers.hub import download, list_variants, start_download

    q4 = list_variants(GGUF_DISCOVER)[0]
    discover_hub.corrupt.add(Q4)
    try:
        folder = start_download(tmp_path, q4)
        with pytest.raises(FetchFailed) as info:
            download(folder)
    finally:
        discover_hub.corrupt.discard(Q4)
    message = str(info.value)
    assert "\n" not in message and "checksum mismatch" in message and Q4 in message
    assert "sha256" in message
    assert sorted(p.name for p in folder.iterdir()) == ["download.json"]


def test_an_unreachable_hub_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import FetchFailed
    from engine.importers.hub import list_variants

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    # (search_models says the same, after huggingface_hub's list_models has retried for
    # about 23 s with back-off: too slow for this suite.)
    with pytest.raises(FetchFailed) as info:
        list_variants("a/b")
    message = str(info.value)
    assert "\n" not in message and f"a/b: cannot reach http://127.0.0.1:{port}" in message
