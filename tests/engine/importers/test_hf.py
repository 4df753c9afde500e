"""Hugging Face float folders and MLX folders through `strata import`.

Contract checked: a float folder becomes a quantized MLX folder by the default recipe (8-bit
embedding and output head, 4-bit attention and MLP, group 64) that the engine's mlx-lm loader
opens under both compute profiles, with a manifest that records quantization per tensor class,
bits per weight, bytes and fingerprint; shards are read through their index and stray
checkpoints ignored; an MLX folder is imported byte for byte; a folder whose weights do not
match its config fails with one line and leaves the library as it was.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.engine.hf_factory import write_hf_llama
from tests.helpers import run_strata


def _import(folder: Path, home: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_strata("import", str(folder), "--json", *extra, home=home, timeout=120)


def _imported(folder: Path, home: Path, *extra: str) -> dict[str, Any]:
    proc = _import(folder, home, *extra)
    assert proc.returncode == 0, proc.stderr
    manifest: dict[str, Any] = json.loads(proc.stdout)
    return manifest


def _state(home: Path) -> list[str]:
    models = home / "models"
    return sorted(p.name for p in models.iterdir()) if models.is_dir() else []


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf") / "Tiny-Llama"
    write_hf_llama(folder)
    return folder


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("import-home")


@pytest.fixture(scope="module")
def imported(hf_folder: Path, home: Path) -> dict[str, Any]:
    return _imported(hf_folder, home)


def test_hf_folder_is_quantized_by_the_default_recipe(imported: dict[str, Any],
                                                      hf_folder: Path) -> None:
    import mlx.core as mx

    from engine.importers.hf import DEFAULT_RECIPE
    from engine.library.store import fingerprint, folder_bytes

    m = imported
    folder = Path(m["path"])
    assert m["name"] == "tiny-llama"
    assert m["source"] == str(hf_folder.resolve())
    assert m["source_format"] == "hf" and m["architecture"] == "llama"
    assert m["context_length"] == 512
    assert m["quantization"] == {
        "attention": ["affine 4-bit g64"], "mlp": ["affine 4-bit g64"],
        "embedding": ["affine 8-bit g64"], "output": ["affine 8-bit g64"], "norm": ["bfloat16"],
    }
    # Bytes and fingerprint are taken before the manifest is written.
    assert m["bytes"] == folder_bytes(folder) - (folder / "manifest.json").stat().st_size
    assert m["fingerprint"] == fingerprint(folder)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "manifest.json"):
        assert (folder / name).is_file(), name

    config = json.loads((folder / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"]) == (DEFAULT_RECIPE["group_size"], DEFAULT_RECIPE["bits"])
    assert q["model.embed_tokens"] == {"group_size": 64, "bits": 8}
    assert q["lm_head"] == {"group_size": 64, "bits": 8}
    assert q["model.layers.1.self_attn.q_proj"] == {"group_size": 64, "bits": 4}
    assert q["model.layers.0.mlp.down_proj"] == {"group_size": 64, "bits": 4}

    source = mx.load(str(hf_folder / "model.safetensors"))
    saved = mx.load(str(folder / "model.safetensors"))
    assert not any("rotary_emb" in k for k in saved)
    # Parameter count: the float tensors the model uses (not the RoPE buffer).
    params = sum(a.size for k, a in source.items() if "rotary_emb" not in k)
    assert m["params"] == params
    bits = sum(a.nbytes for a in saved.values()) * 8
    assert m["bits_per_weight"] == round(bits / params, 3)

    for key, b in (("model.embed_tokens", 8), ("lm_head", 8),
                   ("model.layers.0.self_attn.k_proj", 4), ("model.layers.1.mlp.down_proj", 4)):
        w = saved[f"{key}.weight"]
        original = source[f"{key}.weight"].astype(mx.float32)
        assert w.dtype == mx.uint32
        assert w.shape == (original.shape[0], original.shape[1] * b // 32)
        back = mx.dequantize(w, saved[f"{key}.scales"], saved[f"{key}.biases"], group_size=64,
                             bits=b).astype(mx.float32)
        rel = (mx.linalg.norm(back - original) / mx.linalg.norm(original)).item()
        assert rel < (0.01 if b == 8 else 0.12), (key, rel)
    assert saved["model.norm.weight"].dtype == mx.bfloat16


def test_imported_folder_loads_with_the_mlx_lm_loader(imported: dict[str, Any]) -> None:
    import mlx.core as mx
    import mlx.nn as nn

    from engine.platform import compute_profile
    from engine.runtime.model import load_weights_into_model

    folder = Path(imported["path"])
    tokens = mx.array([[1, 5, 9, 42, 7]])
    logits = {}
    for name in ("native", "cpu-f32"):
        model, config = load_weights_into_model(folder, compute_profile(name))
        if name == "native":
            assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
            assert model.model.embed_tokens.bits == 8
            assert model.model.layers[0].self_attn.q_proj.bits == 4
            assert model.lm_head.bits == 8
        out = model(tokens).astype(mx.float32)
        assert out.shape == (1, 5, config["vocab_size"])
        assert mx.all(mx.isfinite(out)).item()
        logits[name] = out
    # Quantized kernels and dequantized float32 weights compute the same function.
    assert mx.allclose(logits["native"], logits["cpu-f32"], atol=0.05).item()


def test_sharded_tied_folder_reads_the_index_and_ignores_stray_checkpoints(
        tmp_path: Path) -> None:
    import mlx.core as mx

    src = tmp_path / "Sharded"
    write_hf_llama(src, shards=2, tie=True)
    # Mistral-style repositories carry a second checkpoint under other names.
    mx.save_safetensors(str(src / "consolidated.safetensors"),
                        {"layers.0.attention.wq.weight": mx.zeros((64, 64))})
    m = _imported(src, tmp_path / "home")
    assert "output" not in m["quantization"]  # tied: the embedding is the head
    assert m["quantization"]["embedding"] == ["affine 8-bit g64"]
    saved = mx.load(str(Path(m["path"]) / "model.safetensors"))
    assert "lm_head.weight" not in saved
    assert not (Path(m["path"]) / "consolidated.safetensors").exists()


def test_mlx_folder_is_imported_as_is(imported: dict[str, Any], tmp_path: Path) -> None:
    src = tmp_path / "tiny-llama-4bit"
    shutil.copytree(imported["path"], src)
    (src / "manifest.json").unlink()
    m = _imported(src, tmp_path / "home")
    assert m["source_format"] == "mlx"
    assert m["quantization"] == imported["quantization"]
    assert m["params"] == imported["params"]
    assert m["bits_per_weight"] == imported["bits_per_weight"]
    assert m["fingerprint"] == imported["fingerprint"]
    folder = Path(m["path"])
    for f in src.iterdir():
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [p.name for p in src.iterdir()] + ["manifest.json"])


def test_uniformly_quantized_mlx_folder_reports_its_bits(hf_folder: Path, tmp_path: Path) -> None:
    """mlx_lm.convert -q writes only the folder-wide settings: formats come from those."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from engine.runtime.model import build_model

    config = json.loads((hf_folder / "config.json").read_text())
    model = build_model(config)
    weights = model.sanitize(mx.load(str(hf_folder / "model.safetensors")))
    model.load_weights(list(weights.items()))
    nn.quantize(model, group_size=64, bits=4)
    src = tmp_path / "uniform-q4"
    src.mkdir()
    mx.save_safetensors(str(src / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config["quantization"] = {"group_size": 64, "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    shutil.copy2(hf_folder / "tokenizer.json", src / "tokenizer.json")
    m = _imported(src, tmp_path / "home")
    assert m["source_format"] == "mlx"
    assert m["quantization"]["embedding"] == ["affine 4-bit g64"]
    assert m["quantization"]["attention"] == ["affine 4-bit g64"]
    assert m["params"] == sum(a.size for k, a in weights.items())
    assert 4.4 < m["bits_per_weight"] < 5.0


def _break(case: str, folder: Path) -> str:
    """Damage a copy of a good folder; return a word the error line must contain."""
    config = json.loads((folder / "config.json").read_text())
    if case == "more-layers":
        config["num_hidden_layers"] = 3
    elif case == "other-width":
        config["intermediate_size"] = 192
    elif case == "pre-quantized":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    if case == "missing-tensor":
        import mlx.core as mx

        w = mx.load(str(folder / "model.safetensors"))
        del w["model.layers.1.mlp.up_proj.weight"]
        mx.save_safetensors(str(folder / "model.safetensors"), w)
    if case == "truncated":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return {"more-layers": "model.layers.2", "other-width": "wrong shape",
            "missing-tensor": "model.layers.1.mlp.up_proj.weight", "pre-quantized": "gptq",
            "truncated": "unreadable"}[case]


@pytest.mark.parametrize("case", ["more-layers", "other-width", "missing-tensor",
                                  "pre-quantized", "truncated"])
def test_mismatched_folder_fails_in_one_line(case: str, hf_folder: Path, imported: dict[str, Any],
                                             home: Path, tmp_path: Path) -> None:
    src = tmp_path / f"bad-{case}"
    shutil.copytree(hf_folder, src)
    word = _break(case, src)
    before = _state(home)
    proc = _import(src, home)
    assert proc.returncode == 1, proc.stdout
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"strata: error: {src}")
    assert word in lines[0]
    assert _state(home) == before  # nothing added, no temporary folder left behind

