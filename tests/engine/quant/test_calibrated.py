"""Calibrated quantization through mlx-lm's quant module, recipes on import, expected sizes.

Real parts: the starter model, mlx-lm's gptq and awq code in a real child process, calibration
tokens from ../shared/data/tinyshakespeare.txt, a real library on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.errors import Cancelled
from engine.quant.recipes import Format, RecipeError
from tests.engine.quant.test_quantize import _cli, _library_state, _read_back, _source

# Mostly float16 so that calibration stays quick; the quantized layers cover GPTQ's own
# packer (4-bit), Strata's packer for widths mlx-lm's lacks (3-bit), and two group sizes.
SMALL_GPTQ = """name = "small-gptq"
bits = 16
[[rules]]
tensors = ["attn.q", "attn.v"]
layers = ["0:2"]
bits = 4
group_size = 64
[[rules]]
tensors = ["mlp.down"]
layers = [0]
bits = 3
group_size = 32
[[rules]]
tensors = ["embed"]
bits = 8
group_size = 32
"""


def _quantizable_formats(manifest: dict[str, Any]) -> set[Format]:
    """The stored formats of every tensor but the norms (which stay float16)."""
    stored = _read_back(Path(manifest["path"]))
    return {f for module, f in stored.items() if "norm" not in module}


def _generate(library: Any, name: str, prompt: str, n: int = 12) -> str:
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(name, library)
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return "".join(ev.text for ev in generate(lm, ids, SamplingParams(temperature=0.0),
                                              max_tokens=n))


def test_gptq_on_a_mixed_recipe_loads_generates_and_keeps_the_bits(
        library: Any, starter: Any, shared_data: Path, tmp_path: Path) -> None:
    from engine.quant.quantize import quantize

    recipe = tmp_path / "small-gptq.toml"
    recipe.write_text(SMALL_GPTQ)
    seen: list[tuple[int, int]] = []
    m = quantize(library, _source(library, "starter"), str(recipe), "t-gptq", method="gptq",
                 calibration=shared_data / "tinyshakespeare.txt", calibration_tokens=256,
                 progress=lambda d, t: seen.append((d, t)))
    assert m["recipe"]["method"] == "gptq" and m["recipe"]["calibration_tokens"] == 256
    assert seen and seen[-1][0] == seen[-1][1] and len(seen) > 3
    stored = _read_back(Path(m["path"]))
    for i in (0, 1):
        assert stored[f"model.layers.{i}.self_attn.q_proj"] == Format(4, 64)
        assert stored[f"model.layers.{i}.self_attn.v_proj"] == Format(4, 64)
        assert stored[f"model.layers.{i}.self_attn.k_proj"] == Format(16, 64)
    assert stored["model.layers.0.mlp.down_proj"] == Format(3, 32)
    assert stored["model.layers.1.mlp.down_proj"] == Format(16, 64)
    assert stored["model.embed_tokens"] == Format(8, 32)
    config = json.loads((Path(m["path"]) / "config.json").read_text())
    assert config["quantization"]["model.layers.0.mlp.down_proj"] == {"bits": 3,
                                                                      "group_size": 32}
    assert "Paris" in _generate(library, "t-gptq", "What is the capital of France?")


def test_awq_loads_generates_and_keeps_the_bits(library: Any, starter: Any,
                                                shared_data: Path) -> None:
    from engine.quant.quantize import quantize

    # AWQ searches every block (30 here), so few tokens; with 128 its scales and clips
    # overfit and the answer changes even at 8 bits, with 256 it holds. A 4-point grid (of
    # mlx-lm's 20) still searches scales and clips, in a fraction of the time.
    m = quantize(library, _source(library, "starter"), "q8-g64", "t-awq", method="awq",
                 calibration=shared_data / "tinyshakespeare.txt", calibration_tokens=256,
                 awq_grid=4)
    assert _quantizable_formats(m) == {Format(8, 64)}
    assert m["recipe"]["method"] == "awq" and m["recipe"]["awq_grid"] == 4
    assert "Paris" in _generate(library, "t-awq", "What is the capital of France?")


def test_cancelled_calibration_leaves_the_library_as_it_was(
        library: Any, starter: Any, shared_data: Path) -> None:
    from engine.quant.quantize import quantize

    before = _library_state(library)
    seen: list[int] = []
    with pytest.raises(Cancelled):
        quantize(library, _source(library, "starter"), "q4-g64", "t-cancelled", method="gptq",
                 calibration=shared_data / "tinyshakespeare.txt", calibration_tokens=256,
                 progress=lambda d, t: seen.append(d), cancel=lambda: len(seen) >= 2)
    assert _library_state(library) == before
    seen.clear()  # imatrix runs in this process: cancelled while measuring importance
    with pytest.raises(Cancelled):
        quantize(library, _source(library, "starter"), "q4-g64", "t-cancelled", method="imatrix",
                 calibration=shared_data / "tinyshakespeare.txt", calibration_tokens=2048,
                 progress=lambda d, t: seen.append(d), cancel=lambda: len(seen) >= 2)
    assert _library_state(library) == before


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--recipe", "q4-g64", "--method", "gptx"], "unknown method 'gptx'"),
    (["--recipe", "mixed-attn8-mlp4", "--method", "awq"],
     "mlx-lm's AWQ gives every transformer block one format"),
    (["--recipe", "q4-g128", "--method", "awq"], "4-bit g128, 4-bit g64"),
    (["--recipe", "auto", "--bpw", "4", "--method", "awq"], "cannot follow recipe 'auto'"),
    (["--recipe", "f16", "--method", "awq"], "nothing to calibrate"),
    (["--recipe", "q8-g64", "--method", "awq", "--awq-grid", "1"], "AWQ grid 1 is too small"),
    (["--recipe", "q4-g64", "--method", "gptq", "--awq-grid", "4"],
     "applies only to method 'awq'"),
    (["--recipe", "q4-g64", "--method", "gptq", "--calibration", "/nonexistent.txt"],
     "no such calibration text"),
    (["--recipe", "q4-g64", "--method", "imatrix", "--calibration", "/nonexistent.txt"],
     "no such calibration text"),
])
def test_bad_method_input_fails_first_and_writes_nothing(
        library: Any, starter: Any, capsys: Any, tmp_path: Path, argv: list[str],
        fragment: str) -> None:
    before = _library_state(library)
    if "--calibration" not in argv:  # a text is there, so the method's own check speaks
        argv = [*argv, "--calibration", str(_calibration_text(tmp_path))]
    assert _cli("quantize", "starter", "--name", "t-bad-method", *argv) == 1
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1, err
    assert _library_state(library) == before


def test_check_method_without_a_model() -> None:
    from engine.quant.methods import check_method

    check_method("gptq", None, "auto", "llama")  # gptq and dwq take any plan, auto included
    check_method("dwq", {"model.layers.0.mlp.up_proj": Format(3, 64)}, "x", "llama")
    check_method("imatrix", None, "auto", "llama")  # Strata's own weighted rounding: any
    with pytest.raises(RecipeError, match="unknown method"):
        check_method("rtn2", {}, "x", "llama")


# -- recipes on import, and the sizes the import dialog shows -------------------------------
def test_import_with_a_recipe_is_quantize(library: Any, starter: Any, capsys: Any) -> None:
    from engine.importers import import_path, open_source
    from engine.importers.starter import starter_gguf
    from engine.quant.quantize import Requantize, expected_sizes

    gguf = starter_gguf()
    bpw, size = expected_sizes(open_source(gguf), ["q4-g64"])["q4-g64"]
    m = import_path(library, gguf, name="t-import-q4", requantize=Requantize("q4-g64"))
    assert m["recipe"]["name"] == "q4-g64" and m["source_format"] == "quantized"
    assert _quantizable_formats(m) == {Format(4, 64)}
    assert round(bpw, 3) == m["bits_per_weight"]
    weights = (Path(m["path"]) / "model.safetensors").stat().st_size
    assert size <= weights <= size * 1.001  # the safetensors header is the difference
    before = _library_state(library)
    assert _cli("import", str(gguf), "--name", "t-import-bad", "--method", "gptq") == 1
    err = capsys.readouterr().err.strip()
    assert "need --recipe" in err and len(err.splitlines()) == 1, err
    assert _cli("import", str(gguf), "--name", "t-import-bad", "--awq-grid", "4") == 1
    assert "need --recipe" in capsys.readouterr().err
    assert _library_state(library) == before


def test_expected_sizes_match_what_quantize_writes(library: Any, starter: Any) -> None:
    from engine.quant.quantize import expected_sizes

    m = library.find("t-gptq")
    if m is None:
        pytest.skip("needs test_gptq_on_a_mixed_recipe_... (same session)")
    recipe = str(Path(m["path"]) / "recipe.toml")
    bpw, size = expected_sizes(_source(library, "starter"), [recipe])[recipe]
    assert round(bpw, 3) == m["bits_per_weight"]
    # A library source's tokenizer files are counted; config, recipe and manifest are not.
    assert 0 <= m["bytes"] - size < 0.001 * size


def test_import_options_list_every_recipe_with_its_size(library: Any, starter: Any) -> None:
    from engine.importers import open_source
    from engine.importers.starter import starter_gguf
    from engine.quant.quantize import import_options
    from engine.quant.recipes import builtin_names

    info = import_options(open_source(starter_gguf()))
    assert info["kind"] == "gguf"
    first, *recipes = info["options"]
    assert first["recipe"] is None and first["bytes"] == starter_gguf().stat().st_size
    assert [o["recipe"] for o in recipes] == builtin_names()
    by = {o["recipe"]: o for o in recipes}
    assert by["f16"]["bits_per_weight"] == 16.0
    assert by["q4-g64"]["bits_per_weight"] == pytest.approx(4.503, abs=1e-3)
    assert by["q3-g64"]["bytes"] < by["q4-g64"]["bytes"] < by["q8-g32"]["bytes"]


def _calibration_text(folder: Path) -> Path:
    """Plain prose for runs that must not depend on ../shared (a clone elsewhere)."""
    from engine.bench.common import FILLER

    path = folder / "calibration.txt"
    path.write_text(FILLER * 20)
    return path


def test_ctrl_c_in_the_cli_leaves_the_library_as_it_was(library: Any, starter: Any,
                                                        tmp_path: Path) -> None:
    """SIGINT to the command's process group, as a terminal sends it: parent and child stop."""
    import os
    import signal
    import subprocess
    import sys
    import time

    before = _library_state(library)
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "quantize", "starter", "--recipe", "q4-g64",
         "--method", "gptq", "--calibration-tokens", "256", "--name", "t-interrupted",
         "--calibration", str(_calibration_text(tmp_path))],
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        # As from a terminal, even when this test runs with SIGINT ignored (a background job).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        env=dict(os.environ, STRATA_HOME=str(library.home)))
    time.sleep(8)  # the child is up and working (loading or calibrating)
    assert proc.poll() is None
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "strata: interrupted"
    assert _library_state(library) == before
