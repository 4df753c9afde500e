"""Hugging Face folders of every family, and MLX folders mlx-lm saved, give mlx-lm's logits.

Contract checked, for each family of tests.engine.hf_factory.FAMILIES (llama with Llama 3.1's
rope scaling, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma2, gemma3_text, phi3,
gpt_oss with MXFP4 experts, deepseek_v2), on tiny random-weight folders with the real config
keys and transformers' tensor names:

- A Hugging Face folder imported with `import_path` (the default recipe), loaded by Strata's
  runtime (LoadedModel.load), gives at every position of TOKENS the next-token logits that
  `mlx_lm.load` gives on the same library folder, and those of mlx-lm's own conversion of the
  Hugging Face folder (mlx_lm.load, then mlx_lm.utils.quantize_model with the same recipe):
  the import converts as mlx-lm converts. Both compute profiles: "native" (quantized kernels)
  and "cpu-f32" (dequantized to float32, experts included).
- With the floats kept (an import with the "f16" recipe) the logits are mlx_lm.load's on the
  Hugging Face folder itself, in float32.
- MLX folders saved by mlx_lm.convert (uniform 4-bit llama, mixed_3_6 qwen3, 4-bit qwen3_moe
  with its 8-bit routers, gpt_oss with MXFP4 experts and affine rest, 8-bit deepseek_v2) import
  as they are and give mlx_lm.load's logits on the same folder.
- gpt-oss's MXFP4 experts are kept byte for byte (MLX's mxfp4 mode is the checkpoint's format);
  mlx-lm's 8-bit router choice (qwen3_moe, gpt_oss) is kept. A BF16 gpt-oss checkpoint
  (transformers' input-major experts, which mlx-lm's loader cannot read) gives the MXFP4 one's
  float logits; an MXFP4 checkpoint missing a scale tensor fails in one line, library unchanged.

Tolerances, as max |logit difference| over all positions and the vocabulary: QUANT_ATOL for the
same quantized weights on both sides (measured 0.0: the same MLX kernels on the same arrays);
FLOAT_RTOL times the largest logit for the float pair (measured 1.9e-6 absolute for bfloat16
sources, whose values float16 holds exactly, and 3.4e-4 relative for Gemma 2's float32
checkpoint, which float16 rounds). The real mlx-lm runs once, in one subprocess
(tests/engine/mlxlm_reference.py logits), for every reference of the module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.engine.hf_factory import (
    FAMILIES,
    MOE_FAMILIES,
    WINDOW,
    write_hf_family,
    write_hf_gpt_oss_bf16,
)

REPO = Path(__file__).resolve().parents[3]
# Longer than every sliding window (WINDOW), ids inside the tokenizer's vocabulary.
TOKENS = [(i * 37 + 11) % 300 for i in range(20)]
PROFILES = ("native", "cpu-f32")
QUANT_ATOL = 1e-4
FLOAT_RTOL = 2e-3
# MLX folders as mlx_lm.convert saves them: family -> convert keywords.
MLX_FOLDERS: dict[str, dict[str, Any]] = {
    "llama": {"quantize": True},
    "qwen3": {"quantize": True, "quant_predicate": "mixed_3_6", "q_group_size": 64},
    "qwen3_moe": {"quantize": True},
    "gpt_oss": {"quantize": True},
    "deepseek_v2": {"quantize": True, "q_bits": 8},
}
# Where the float import (engine.quant, "f16") cannot run yet, and why (files of other owners).
assert len(TOKENS) > WINDOW


@dataclass
class World:
    """Everything the module's tests compare: folders, the library, reference logits."""

    tmp: Path
    library: Any
    hf: dict[str, Path] = field(default_factory=dict)
    imported: dict[str, dict[str, Any]] = field(default_factory=dict)  # family -> manifest
    mlx: dict[str, Path] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def ref(self, kind: str, family: str, profile: str) -> Path:
        return self.tmp / "ref" / f"{kind}-{family}-{profile}.npy"


def _logits_job(world: World, kind: str, family: str, folder: Path, profile: str,
                **extra: Any) -> dict[str, Any]:
    return {"folder": str(folder), "profile": profile, "tokens": TOKENS,
            "out": str(world.ref(kind, family, profile)), **extra}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    from engine.importers import import_path
    from engine.importers.hf import DEFAULT_RECIPE
    from engine.library import Library

    tmp = tmp_path_factory.mktemp("hf-archs")
    w = World(tmp, Library(tmp / "home"))
    (tmp / "ref").mkdir()
    jobs: dict[str, list[dict[str, Any]]] = {"convert": [], "logits": []}
    for family in FAMILIES:
        folder = tmp / "hf" / family
        write_hf_family(folder, family)
        w.hf[family] = folder
        w.imported[family] = import_path(w.library, folder, name=family)
        for profile in PROFILES:
            jobs["logits"].append(_logits_job(w, "imported", family,
                                              Path(w.imported[family]["path"]), profile))
            jobs["logits"].append(_logits_job(w, "recipe", family, folder, profile,
                                              recipe=DEFAULT_RECIPE))
        jobs["logits"].append(_logits_job(w, "float", family, folder, "cpu-f32"))
    for family, keywords in MLX_FOLDERS.items():
        w.mlx[family] = tmp / "mlx" / family
        jobs["convert"].append({"hf": str(w.hf[family]), "mlx": str(w.mlx[family]), **keywords})
        for profile in PROFILES:
            jobs["logits"].append(_logits_job(w, "mlx", family, w.mlx[family], profile))
    proc = subprocess.run([sys.executable, str(REPO / "tests/engine/mlxlm_reference.py"),
                           "logits"], input=json.dumps(jobs), capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    w.seconds = json.loads(proc.stdout)["seconds"]
    return w


def _strata_logits(folder: str | Path, profile: str) -> Any:
    """Next-token logits at every position of TOKENS, from Strata's runtime."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel

    lm = LoadedModel.load(folder, profile=compute_profile(profile), warm_up=False)
    if compute_profile(profile).dequantize:
        # Dequantized means every weight: no quantized layer (experts included) is left.
        left = [p for p, m in lm.model.named_modules()
                if "scales" in m or isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
        assert not left, left[:3]
    return np.array(lm.model(mx.array(TOKENS)[None])[0].astype(mx.float32))


def _agree(ours: Any, ref: Any, atol: float) -> float:
    """Max |difference|; asserts it is within `atol` and the argmax agrees at every position."""
    import numpy as np

    assert ours.shape == ref.shape == (len(TOKENS), ref.shape[1])
    assert np.isfinite(ours).all()
    diff = float(np.abs(ours - ref).max())
    assert diff <= atol, f"max |logit difference| {diff:.3g} over {atol:.3g}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    return diff


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_import_gives_mlx_lm_logits(world: World, family: str, profile: str) -> None:
    import numpy as np

    m = world.imported[family]
    assert m["source_format"] == "hf" and m["architecture"] == family
    ours = _strata_logits(m["path"], profile)
    # The library folder read by mlx-lm itself, and mlx-lm's own conversion of the source.
    _agree(ours, np.load(world.ref("imported", family, profile)), QUANT_ATOL)
    _agree(ours, np.load(world.ref("recipe", family, profile)), QUANT_ATOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_float_import_gives_mlx_lm_logits_of_the_source(world: World, family: str) -> None:
    import numpy as np

    from engine.importers import import_path
    from engine.quant.quantize import Requantize

    m = import_path(world.library, world.hf[family], name=f"{family}-f16",
                    requantize=Requantize("f16"))
    assert not any("bit" in f for fs in m["quantization"].values() for f in fs)
    ref = np.load(world.ref("float", family, "cpu-f32"))
    _agree(_strata_logits(m["path"], "cpu-f32"), ref, FLOAT_RTOL * float(np.abs(ref).max()))


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("family", sorted(MLX_FOLDERS))
def test_mlx_folder_saved_by_mlx_lm_gives_its_logits(world: World, family: str,
                                                     profile: str) -> None:
    import numpy as np

    from engine.importers import import_path

    name = f"{family}-mlx"
    m = world.library.find(name) or import_path(world.library, world.mlx[family], name=name)
    assert m["source_format"] == "mlx"
    folder = Path(m["path"])
    for f in world.mlx[family].glob("*.safetensors"):
        assert (folder / f.name).read_bytes() == f.read_bytes(), f.name
    _agree(_strata_logits(folder, profile), np.load(world.ref("mlx", family, profile)),
           QUANT_ATOL)


def test_gpt_oss_keeps_its_mxfp4_experts(world: World) -> None:
    import mlx.core as mx

    folder = Path(world.imported["gpt_oss"]["path"])
    quant = json.loads((folder / "config.json").read_text())["quantization"]
    saved: Any = mx.load(str(folder / "model.safetensors"))
    source: Any = mx.load(str(world.hf["gpt_oss"] / "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}.mlp."
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert quant[p + "experts." + proj] == {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        assert quant[p + "router"] == {"group_size": 64, "bits": 8}  # mlx-lm's own choice
        # The checkpoint's codes and scales as they were: gate and up rows interleaved.
        blocks = source[p + "experts.gate_up_proj_blocks"]
        codes = blocks.view(mx.uint32).reshape(*blocks.shape[:2], -1)
        scales = source[p + "experts.gate_up_proj_scales"]
        assert mx.array_equal(saved[p + "experts.gate_proj.weight"], codes[:, ::2]).item()
        assert mx.array_equal(saved[p + "experts.up_proj.weight"], codes[:, 1::2]).item()
        assert mx.array_equal(saved[p + "experts.up_proj.scales"], scales[:, 1::2]).item()
        down = source[p + "experts.down_proj_blocks"]
        assert mx.array_equal(saved[p + "experts.down_proj.weight"],
                              down.view(mx.uint32).reshape(*down.shape[:2], -1)).item()
    assert "quant_method" not in json.dumps(quant)


def test_gpt_oss_bf16_checkpoint_gives_the_mxfp4_ones_logits(world: World) -> None:
    """transformers saves float gpt-oss experts input-major (unsloth's BF16 release), which
    mlx-lm's loader cannot read; the importer lays them out as mlx-lm's model holds them. The
    values are the MXFP4 checkpoint's, so mlx_lm.load of that one (dequantized to float32) is
    the reference."""
    import mlx.core as mx
    import numpy as np

    from engine.importers import import_path
    from engine.quant.quantize import Requantize

    src = world.tmp / "hf" / "gpt_oss-bf16"
    write_hf_gpt_oss_bf16(src, world.hf["gpt_oss"])
    ref = np.load(world.ref("float", "gpt_oss", "cpu-f32"))
    m = import_path(world.library, src, name="gpt-oss-bf16-f16", requantize=Requantize("f16"))
    _agree(_strata_logits(m["path"], "cpu-f32"), ref, FLOAT_RTOL * float(np.abs(ref).max()))
    # The default import quantizes those experts by the recipe (affine 4-bit): they hold the
    # float experts to 4-bit precision (random weights drift too far for a logit check).
    m = import_path(world.library, src, name="gpt-oss-bf16")
    quant = json.loads((Path(m["path"]) / "config.json").read_text())["quantization"]
    assert quant["model.layers.0.mlp.experts.down_proj"] == {"group_size": 64, "bits": 4}
    saved: Any = mx.load(str(Path(m["path"]) / "model.safetensors"))
    floats: Any = mx.load(str(src / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    gate_up = mx.swapaxes(floats[p + "gate_up_proj"], -1, -2).astype(mx.float32)
    for proj, want in (("gate_proj", gate_up[:, ::2]), ("up_proj", gate_up[:, 1::2]),
                       ("down_proj", mx.swapaxes(floats[p + "down_proj"], -1, -2))):
        got = mx.dequantize(saved[p + proj + ".weight"], saved[p + proj + ".scales"],
                            saved[p + proj + ".biases"], group_size=64, bits=4)
        want = want.astype(mx.float32)
        rel: Any = (mx.linalg.norm(got.astype(mx.float32) - want) / mx.linalg.norm(want)).item()
        assert rel < 0.12, (proj, rel)


def test_moe_routers_and_experts_are_quantized_as_mlx_lm_does(world: World) -> None:
    for family in MOE_FAMILIES:
        folder = Path(world.imported[family]["path"])
        quant = json.loads((folder / "config.json").read_text())["quantization"]
        experts = [k for k in quant if "switch_mlp" in k or ".experts." in k]
        assert experts, family  # the stacked experts are quantized layers too
        if family == "qwen3_moe":
            assert quant["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
        if family == "mixtral":
            assert quant["model.layers.1.block_sparse_moe.gate"]["bits"] == 4


def test_mxfp4_checkpoint_missing_its_scales_fails_in_one_line(world: World,
                                                               tmp_path: Path) -> None:
    import shutil

    import mlx.core as mx

    from engine.errors import ImportFailed
    from engine.importers import import_path

    src = tmp_path / "gpt-oss-broken"
    shutil.copytree(world.hf["gpt_oss"], src)
    loaded: Any = mx.load(str(src / "model.safetensors"))
    w = dict(loaded)
    del w["model.layers.1.mlp.experts.down_proj_scales"]
    mx.save_safetensors(str(src / "model.safetensors"), w)
    before = sorted(m["name"] for m in world.library.manifests())
    with pytest.raises(ImportFailed) as exc:
        import_path(world.library, src, name="broken")
    line = str(exc.value)
    assert "\n" not in line and line.startswith(str(src))
    assert "model.layers.1.mlp.experts.down_proj" in line
    assert sorted(m["name"] for m in world.library.manifests()) == before
