"""Models of LM Studio, Ollama and the Hugging Face cache, laid out as those apps lay them out.

Real files: the starter's GGUF and its MLX library folder, placed in a fake LM Studio models
folder (publisher/repo/file.gguf, an MLX repo folder, a vision projector to skip), a fake
Ollama store (manifests/registry.ollama.ai/library/<model>/<tag> JSON whose model layer names
blobs/sha256-<hex>) and a fake hub cache (models--owner--name/snapshots/<commit>/ links to
blobs/). `scan` finds exactly the models; `install_linked` adds an MLX folder with hard links
(same file system) or references (another one: /dev/shm), the manifest matching what a real
import writes, and the model loads and generates from the linked files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.library import Library
from engine.library.found import HF_CACHE, LM_STUDIO, OLLAMA, Roots, added, install_linked, scan

COMMIT = "a" * 40


def _mlx_folder(starter: dict[str, Any], dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in Path(starter["path"]).iterdir():
        if f.name != "manifest.json":
            shutil.copyfile(f, dest / f.name)
    return dest


def lay_out(root: Path, starter: dict[str, Any]) -> Roots:
    """The three apps' folders under `root`, as they lay them out."""
    from engine.importers.starter import starter_gguf

    gguf = starter_gguf()
    lms = root / "lmstudio" / "models"
    repo = lms / "lmstudio-community" / "SmolLM2-135M-Instruct-GGUF"
    repo.mkdir(parents=True)
    os.link(gguf, repo / "SmolLM2-135M-Instruct-Q4_1.gguf")  # inputs: no need to copy 98 MB
    (repo / "mmproj-model-f16.gguf").write_bytes(b"GGUF" + bytes(60))  # a vision projector
    _mlx_folder(starter, lms / "mlx-community" / "SmolLM2-135M-Instruct-4bit")
    (lms / "mlx-community" / "empty-repo").mkdir()

    ollama = root / "ollama" / "models"
    blobs = ollama / "blobs"
    blobs.mkdir(parents=True)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    os.link(gguf, blobs / f"sha256-{digest}")
    template = b"{{ .Prompt }}"
    tdigest = hashlib.sha256(template).hexdigest()
    (blobs / f"sha256-{tdigest}").write_bytes(template)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "c" * 64, "size": 485},
        "layers": [
            {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
             "size": gguf.stat().st_size},
            {"mediaType": "application/vnd.ollama.image.template",
             "digest": f"sha256:{tdigest}", "size": len(template)},
        ],
    }
    tags = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2"
    tags.mkdir(parents=True)
    (tags / "135m").write_text(json.dumps(manifest))
    no_model = dict(manifest, layers=manifest["layers"][1:])  # an adapter-only manifest
    (tags / "adapter").write_text(json.dumps(no_model))

    hub = root / "hf" / "hub"
    cached = hub / "models--mlx-community--SmolLM2-135M-Instruct-8bit"
    (cached / "refs").mkdir(parents=True)
    (cached / "refs" / "main").write_text(COMMIT)
    snap = cached / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (cached / "blobs").mkdir()
    for f in Path(starter["path"]).iterdir():
        if f.name == "manifest.json":
            continue
        blob = cached / "blobs" / hashlib.sha1(f.name.encode()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    return Roots(lmstudio=[lms, root / "lmstudio-missing"], ollama=[ollama], hf_cache=[hub])


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory, starter: dict[str, Any]) -> Roots:
    return lay_out(tmp_path_factory.mktemp("found"), starter)


def test_scan_finds_each_app_s_models(roots: Roots, starter: dict[str, Any]) -> None:
    found = scan(roots)
    by = {(f.app, f.label): f for f in found}
    assert sorted(by) == [
        (HF_CACHE, "mlx-community/SmolLM2-135M-Instruct-8bit"),
        (LM_STUDIO, "lmstudio-community/SmolLM2-135M-Instruct-GGUF/"
                    "SmolLM2-135M-Instruct-Q4_1.gguf"),
        (LM_STUDIO, "mlx-community/SmolLM2-135M-Instruct-4bit"),
        (OLLAMA, "smollm2:135m"),
    ]
    ollama = by[(OLLAMA, "smollm2:135m")]
    assert ollama.kind == "gguf" and ollama.path.name.startswith("sha256-")
    assert ollama.name == "smollm2-135m" and ollama.bytes == 98_362_432
    mlx = by[(LM_STUDIO, "mlx-community/SmolLM2-135M-Instruct-4bit")]
    assert mlx.kind == "mlx" and mlx.linkable and mlx.name == "smollm2-135m-instruct-4bit"
    gguf = by[(LM_STUDIO, "lmstudio-community/SmolLM2-135M-Instruct-GGUF/"
                          "SmolLM2-135M-Instruct-Q4_1.gguf")]
    assert gguf.name == "smollm2-135m-instruct-q4_1" and not gguf.linkable
    assert by[(HF_CACHE, "mlx-community/SmolLM2-135M-Instruct-8bit")].path.name == COMMIT


def test_roots_follow_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STRATA_LMSTUDIO_MODELS", f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "o"))
    monkeypatch.delenv("STRATA_OLLAMA_MODELS", raising=False)
    monkeypatch.delenv("STRATA_HF_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    roots = Roots.from_env()
    assert roots.lmstudio == [tmp_path / "a", tmp_path / "b"]
    assert roots.ollama == [tmp_path / "o"]
    assert roots.hf_cache == [tmp_path / "hf" / "hub"]
    assert scan(roots) == []  # none of them exists


def test_linked_mlx_folder_matches_an_import_and_runs(roots: Roots, tmp_path: Path,
                                                      starter: dict[str, Any]) -> None:
    from engine.importers import import_path
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lib = Library(tmp_path / "home")
    found = {f.label: f for f in scan(roots)}["mlx-community/SmolLM2-135M-Instruct-4bit"]
    m = install_linked(lib, found.path, found.name, found_in=LM_STUDIO)
    assert m["placement"] == "hardlink" and m["found_in"] == LM_STUDIO
    assert m["external_path"] == str(found.path)
    folder = Path(m["path"])
    assert (folder / "model.safetensors").stat().st_ino == \
        (found.path / "model.safetensors").stat().st_ino
    assert not (folder / "config.json").samefile(found.path / "config.json")  # small: copied
    assert added(found, lib.manifests()) == found.name

    copied = import_path(lib, found.path, name="copied")
    for key in ("quantization", "bits_per_weight", "params", "architecture", "context_length",
                "tokenizer", "fingerprint", "source_format"):
        assert m[key] == copied[key], key

    lm = LoadedModel.load(folder)
    prompt = lm.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    events = list(generate(lm, prompt, SamplingParams(temperature=0.0), max_tokens=2))
    assert any(e.token is not None for e in events)

    lib.remove(found.name)  # the library's delete leaves LM Studio's file alone
    assert (found.path / "model.safetensors").is_file()


def test_hf_cache_snapshot_links_its_blobs(roots: Roots, tmp_path: Path) -> None:
    lib = Library(tmp_path / "home")
    found = [f for f in scan(roots) if f.app == HF_CACHE][0]
    m = install_linked(lib, found.path, found.name, found_in=HF_CACHE)
    weights = Path(m["path"]) / "model.safetensors"
    assert m["placement"] == "hardlink"
    assert weights.samefile((found.path / "model.safetensors").resolve())
    assert not weights.is_symlink()


@pytest.fixture
def other_fs(starter: dict[str, Any], tmp_path: Path) -> Iterator[Path]:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second file system here")
    folder = shm / f"strata-found-{os.getpid()}"
    try:
        yield _mlx_folder(starter, folder / "mlx-community" / "SmolLM2-135M-Instruct-4bit")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_another_file_system_gets_a_reference(other_fs: Path, tmp_path: Path) -> None:
    lib = Library(tmp_path / "home")
    m = install_linked(lib, other_fs, "on-another-disk", found_in=LM_STUDIO)
    weights = Path(m["path"]) / "model.safetensors"
    assert m["placement"] == "reference"
    assert weights.is_symlink() and weights.resolve() == (other_fs / "model.safetensors")
    assert m["bytes"] > 90_000_000  # what the model weighs, wherever it lives


def test_a_folder_without_weights_is_refused_and_nothing_installed(tmp_path: Path) -> None:
    from engine.errors import ImportFailed

    lib = Library(tmp_path / "home")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama", "quantization": {}}')
    with pytest.raises(ImportFailed, match="not an MLX model folder"):
        install_linked(lib, bad, "bad")
    assert lib.manifests() == []
    assert [p.name for p in lib.models_dir.iterdir()] == []
