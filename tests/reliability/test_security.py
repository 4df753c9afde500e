"""Model files are data, never code; paths stay inside Strata's folders; two running
instances do not corrupt each other's library.

Contract checked: no pickle, eval/exec or trust_remote_code anywhere in engine/ or app/
(a source scan) and none reached by an import (a behavioural check with booby-trapped
files); names with '..' or '/', index entries outside the folder and symlinked cache files
are refused; the library's install lock lets one of two racing processes win cleanly.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import ImportFailed
from engine.importers import import_path
from engine.library.store import Library, check_name
from tests.conftest import REPO
from tests.reliability.common import (
    new_prefix_cache,
    prefix_prompt,
    read_prefix_page,
    write_prefix_pages,
    write_tiny_gguf,
)

FORBIDDEN = re.compile(r"\bpickle\b|torch\.load|trust_remote_code|allow_pickle\s*=\s*True|"
                       r"(?<![.\w])eval\(|(?<![.\w])exec\(|__import__\(")


def test_no_code_execution_paths_in_the_sources() -> None:
    hits = []
    for root in ("engine", "app"):
        for f in sorted((REPO / root).rglob("*.py")):
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if FORBIDDEN.search(line.split("#")[0]):
                    hits.append(f"{f.relative_to(REPO)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


class _Trap:
    """Unpickling this runs code: the marker file appears if anything unpickles it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def booby_trap(folder: Path, marker: Path) -> None:
    """A pickle checkpoint, remote code named by auto_map, and a model_file entry."""
    import json

    for name in ("pytorch_model.bin", "model.pt", "training_args.bin"):
        (folder / name).write_bytes(pickle.dumps(_Trap(marker)))
    (folder / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    config["model_file"] = "modeling_evil.py"
    (folder / "config.json").write_text(json.dumps(config))


def test_model_files_are_never_executed(tmp_path: Path) -> None:
    from tests.engine.hf_factory import write_hf_llama

    marker = tmp_path / "EXECUTED"
    folder = tmp_path / "trapped"
    write_hf_llama(folder, layers=1)
    booby_trap(folder, marker)
    library = Library(tmp_path / "home")
    m = import_path(library, folder, name="trapped")  # safetensors used, the rest ignored
    imported = {p.name for p in Path(m["path"]).iterdir()}
    assert not imported & {"pytorch_model.bin", "model.pt", "modeling_evil.py"}
    # Only pickle weights: refused, not loaded.
    (folder / "model.safetensors").unlink()
    with pytest.raises(ImportFailed, match="no weights"):
        import_path(library, folder, name="pickled")
    from engine.runtime.generate import LoadedModel

    LoadedModel.load(m["path"], warm_up=False)
    assert not marker.exists(), "a model file ran code"


def test_names_and_index_entries_cannot_leave_the_folder(tmp_path: Path) -> None:
    import json

    from tests.engine.hf_factory import write_hf_llama

    for bad in ("../evil", "a/b", "..", ".hidden", "x/../../y", "/abs"):
        with pytest.raises(ImportFailed):
            check_name(bad)
    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    library = Library(tmp_path / "home")
    with pytest.raises(ImportFailed):
        import_path(library, source, name="../../escaped")
    assert not (tmp_path / "escaped").exists()
    folder = tmp_path / "hf"
    write_hf_llama(folder, layers=1)
    outside = tmp_path / "outside.safetensors"
    (folder / "model.safetensors").rename(outside)
    (folder / "decoy.safetensors").write_bytes(outside.read_bytes())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../outside.safetensors"}}))
    with pytest.raises(ImportFailed, match="outside the folder"):
        import_path(library, folder, name="indexed")
    # A weight file that is a symlink is read, and the library gets a real file.
    (folder / "model.safetensors.index.json").unlink()
    (folder / "decoy.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside)
    m = import_path(library, folder, name="linked")
    links = [p for p in Path(m["path"]).rglob("*") if p.is_symlink()]
    assert not links
    assert not [p for p in library.models_dir.iterdir() if p.is_symlink()]


def test_prefix_cache_never_reads_through_a_symlink(tmp_path: Path) -> None:
    cache = new_prefix_cache(tmp_path / "prefix")
    prompt = prefix_prompt(1)
    write_prefix_pages(cache, prompt, 1)
    (page,) = cache.folder.glob("*.kvp")
    elsewhere = tmp_path / "elsewhere.kvp"
    page.rename(elsewhere)  # a valid page, but outside the cache folder
    page.symlink_to(elsewhere)
    ok, _, _ = read_prefix_page(cache, prompt, 0)
    assert not ok and not page.exists() and elsewhere.exists()
    cache.close()


RACE = """
import sys, time
from pathlib import Path
from engine.errors import ImportFailed
from engine.importers import import_path
from engine.library.store import Library
home, source, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
library = Library(home)
while not go.exists():
    time.sleep(0.001)
try:
    import_path(library, source, name="shared")
    print("WON")
except ImportFailed as exc:
    print("LOST", exc)
"""


def test_two_processes_installing_one_name(tmp_path: Path) -> None:
    source = write_tiny_gguf(tmp_path / "tiny.gguf")
    home = tmp_path / "home"
    Library(home)
    for round_ in range(3):
        go = tmp_path / f"go{round_}"
        kids = [subprocess.Popen([sys.executable, "-c", RACE, str(home), str(source), str(go)],
                                 cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for _ in range(2)]
        import time

        time.sleep(1.0)  # both are waiting at the line
        go.touch()
        outs = [k.communicate(timeout=120) for k in kids]
        said = sorted(o[0].split()[0] for o in outs if o[0])
        assert said == ["LOST", "WON"], outs
        assert all("already in the library" in o[0] for o in outs if o[0].startswith("LOST"))
        library = Library(home)
        assert [m["name"] for m in library.manifests()] == ["shared"]
        assert not [p for p in library.models_dir.iterdir() if p.name.startswith(".tmp-")]
        library.remove("shared")
