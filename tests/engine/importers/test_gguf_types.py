"""Every GGUF tensor type against llama.cpp: stored values, logits and greedy tokens.

Contract checked, per row of `MATRIX` (gguf type, status, logit tolerance), on a tiny random
llama (hidden 256, 2 layers, tied embeddings, its final norm scaled so that logits have a std
of about 6.4 and the greedy choice is decisive): a file whose every matrix is that type, made
by llama.cpp's own quantizer from an F32 file where llama.cpp quantizes without an importance
matrix and from valid random blocks otherwise (tests/engine/gguf_factory.py), imports; every
imported tensor equals the `gguf` package's dequantization of the file (bit for bit where the
status is "exact", within float16 rounding of the block scales for "same grid", within one
MLX step per group of 32 for "requantized"); next-token logits at every position of a fixed
48-token sequence are within the row's tolerance of llama.cpp's on the same file; and along
llama.cpp's 32 greedy tokens ours pick the same token wherever llama.cpp's own margin exceeds
that tolerance. llama.cpp computes quantized matrices with its activations rounded to 8 bits,
which moves its logits by up to ~1 here; so exact and same-grid rows are also held against
llama.cpp on the file's F32 twin (llama.cpp's own dequantization of it): within 0.05 (exact)
or 0.15 (same grid) at every position, and all 32 free-running greedy tokens equal.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import gguf
import numpy as np
import pytest

from engine.importers import import_path
from engine.importers.gguf_types import PLANS
from engine.library import Library
from tests.engine.gguf_factory import (
    ModelSpec,
    Vocab,
    bpe_vocab,
    encode,
    unpermute_index,
    write_gguf,
)
from tests.engine.llamacpp_reference import Reference, llama_cpp, reference


@dataclass(frozen=True)
class Tol:
    """Logits against llama.cpp on the same file: largest and mean |difference|."""

    max: float
    mean: float


# (gguf type, status, tolerance). Measured (max, mean) |logit difference| against llama.cpp
# on the file, logit std 6.4: exact rows 0.46-0.58 / 0.09-0.10 (llama.cpp's 8-bit activations),
# 0.02 / 0.003 against the F32 twin; same grid 0.81-0.83 / 0.13-0.14 (twin 0.06-0.08);
# requantized rows as their tolerance says, at about 0.7 of it.
MATRIX: list[tuple[str, str, Tol]] = [
    ("F32", "exact", Tol(0.05, 0.01)),
    ("F16", "exact", Tol(0.06, 0.01)),
    ("BF16", "exact", Tol(0.3, 0.05)),
    ("Q8_0", "exact", Tol(1.2, 0.2)),
    ("Q4_0", "exact", Tol(1.2, 0.2)),
    ("Q4_1", "exact", Tol(1.2, 0.2)),
    ("Q5_0", "exact", Tol(1.2, 0.2)),
    ("Q5_1", "exact", Tol(1.2, 0.2)),
    ("TQ1_0", "exact", Tol(1.5, 0.25)),
    ("TQ2_0", "exact", Tol(1.5, 0.25)),
    ("MXFP4", "exact", Tol(1.2, 0.2)),
    ("NVFP4", "exact", Tol(1.2, 0.2)),
    ("Q4_K", "same grid", Tol(1.5, 0.25)),
    ("Q5_K", "same grid", Tol(1.5, 0.25)),
    ("IQ1_S", "same grid", Tol(1.5, 0.25)),
    ("Q6_K", "requantized 8-bit", Tol(1.5, 0.3)),
    ("Q3_K", "requantized 4-bit", Tol(13.0, 2.4)),
    ("Q2_K", "requantized 3-bit", Tol(25.0, 5.0)),
    ("IQ4_NL", "requantized 5-bit", Tol(7.0, 1.2)),
    ("IQ4_XS", "requantized 5-bit", Tol(7.0, 1.2)),
    ("IQ3_S", "requantized 4-bit", Tol(15.0, 2.8)),
    ("IQ3_XXS", "requantized 4-bit", Tol(18.0, 3.0)),
    ("IQ2_S", "requantized 3-bit", Tol(30.0, 4.8)),
    ("IQ2_XS", "requantized 3-bit", Tol(25.0, 4.6)),
    ("IQ2_XXS", "requantized 3-bit", Tol(36.0, 5.5)),
    ("IQ1_M", "requantized 3-bit", Tol(28.0, 4.5)),
]
# llama.cpp quantizes these without an importance matrix (its ftype for a file of the type).
LLAMACPP_FTYPES = {
    "Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M", "Q6_K": "Q6_K",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_S": "IQ3_S", "TQ1_0": "TQ1_0",
    "TQ2_0": "TQ2_0", "BF16": "BF16", "F16": "F16",
}
TWIN_TOL = {"exact": 0.05, "same grid": 0.15}
SPEC = ModelSpec(hidden=256, heads=4, kv_heads=2, ffn=512, layers=2, tie=True)
LOGIT_SCALE = 8.0  # the final norm's weights times this: logits with a std of about 6.4
N_GREEDY = 32

# GGUF tensor name (per layer: blk.N.<key>) -> Hugging Face name.
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_of(gguf_name: str) -> str:
    base, suffix = gguf_name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, key = base.split(".", 2)
        return f"model.layers.{layer}.{_LAYER[key]}.{suffix}"
    return f"{_TOP[base]}.{suffix}"


def quantize_pure(src: Path, dst: Path, ftype: str) -> None:
    """llama.cpp's quantizer with every matrix of the ftype's type (its `pure` option), or
    F32 ("F32", from a quantized file: llama.cpp's own dequantization)."""
    lc = llama_cpp()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, "LLAMA_FTYPE_ALL_F32" if ftype == "F32"
                           else f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    params.pure = True
    params.allow_requantize = True
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    assert rc == 0, f"llama.cpp could not quantize {src} to {ftype}"


def scale_output_norm(path: Path) -> None:
    reader = gguf.GGUFReader(str(path), "r+")
    for t in reader.tensors:
        if t.name == "output_norm.weight":
            t.data[:] *= LOGIT_SCALE
    del reader


def file_values(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """HF name -> (GGUF type, the file's values dequantized by `gguf`, HF row order)."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        dense = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = tuple(reversed([int(x) for x in t.shape]))
        dense = dense.reshape(shape)
        heads = {"attn_q": SPEC.heads, "attn_k": SPEC.kv_heads}.get(t.name.split(".")[-2])
        if heads is not None:  # llama.cpp's converter permutes llama's Q/K rows
            hf = np.empty_like(dense)
            hf[unpermute_index(shape[0], heads)] = dense
            dense = hf
        out[hf_of(t.name)] = (t.tensor_type.name, dense)
    return out


@dataclass
class Case:
    qtype: str
    path: Path
    twin: Path
    manifest: dict[str, Any]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-types")


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return bpe_vocab()[0]


@pytest.fixture(scope="module")
def f32_file(workdir: Path, vocab: Vocab) -> Path:
    llama_cpp()
    path = workdir / "F32.gguf"
    write_gguf(path, SPEC, "F32", vocab, seed=7)
    scale_output_norm(path)
    return path


@pytest.fixture(scope="module")
def tokens(vocab: Vocab) -> list[int]:
    return [int(x) for x in np.random.default_rng(1).integers(3, len(vocab.tokens), 48)]


@pytest.fixture(scope="module")
def cases(workdir: Path, f32_file: Path, vocab: Vocab) -> Callable[[str], Case]:
    """qtype -> its file, F32 twin and import; each made once."""
    lib = Library(workdir / "home")
    done: dict[str, Case] = {}

    def get(qtype: str) -> Case:
        if qtype not in done:
            path = workdir / f"{qtype}.gguf"
            if qtype == "F32":
                path = f32_file
            elif qtype in LLAMACPP_FTYPES:
                quantize_pure(f32_file, path, LLAMACPP_FTYPES[qtype])
            else:
                write_gguf(path, SPEC, qtype, vocab, seed=7)
                scale_output_norm(path)
            twin = workdir / f"{qtype}-twin.gguf"
            quantize_pure(path, twin, "F32")
            manifest = import_path(lib, path, name=qtype.lower().replace("_", "-"))
            done[qtype] = Case(qtype, path, twin, manifest)
        return done[qtype]

    return get


def load(case: Case) -> Any:
    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel

    # mxfp4/nvfp4 layers stay quantized: the float32 profile's dequantization reads affine
    # scales only (engine/runtime/model.py apply_profile).
    profile = "native" if PLANS[case.qtype].mode in ("mxfp4", "nvfp4") else "cpu-f32"
    lm = LoadedModel.load(Path(case.manifest["path"]), profile=compute_profile(profile),
                          warm_up=False)
    lm.eos_ids = set()  # random weights: EOS is just another token
    return lm


def logits_of(lm: Any, tokens: list[int]) -> np.ndarray:
    import mlx.core as mx

    return np.array(lm.model(mx.array([tokens]))[0].astype(mx.float32))


def imported_weights(case: Case) -> tuple[dict[str, Any], dict[str, Any]]:
    import mlx.core as mx

    folder = Path(case.manifest["path"])
    weights: dict[str, Any] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(cast(dict[str, Any], mx.load(str(f))))
    return json.loads((folder / "config.json").read_text()), weights


def stored_dense(config: dict[str, Any], weights: dict[str, Any], name: str) -> np.ndarray:
    """What the imported folder holds for a tensor, through mx.dequantize in float32."""
    import mlx.core as mx

    module = name.rsplit(".", 1)[0]
    if f"{module}.scales" not in weights or not name.endswith(".weight"):
        return np.array(weights[name].astype(mx.float32))
    q = config["quantization"][module]
    mode = q.get("mode", "affine")
    scales = weights[f"{module}.scales"]
    biases = weights.get(f"{module}.biases")
    return np.array(mx.dequantize(
        weights[name], scales if mode != "affine" else scales.astype(mx.float32),
        None if biases is None else biases.astype(mx.float32),
        group_size=q["group_size"], bits=q["bits"], mode=mode, dtype=mx.float32))


ROWS = [pytest.param(t, s, tol, id=t) for t, s, tol in MATRIX]


def test_matrix_covers_every_type_gguf_dequantizes() -> None:
    assert {t for t, _, _ in MATRIX} == set(PLANS)
    for qtype, status, _ in MATRIX:
        plan = PLANS[qtype]
        if status.startswith("requantized"):
            assert plan.way == "requantize" and status == f"requantized {plan.bits}-bit"
        else:
            assert plan.way in ("repack", "float"), qtype


@pytest.mark.parametrize(("qtype", "status", "tol"), ROWS)
def test_stored_values(cases: Callable[[str], Case], qtype: str, status: str, tol: Tol) -> None:
    case = cases(qtype)
    config, weights = imported_weights(case)
    held = file_values(case.path)
    assert {t for t, _ in held.values()} == ({"F32"} | {qtype}), "a file of one type"
    how = "same grid, float16 scales" if status == "same grid" else status.split(" ")[0]
    labels = {f for fs in case.manifest["quantization"].values() for f in fs}
    if qtype not in ("F32", "F16", "BF16"):
        assert any(f"(from {qtype}, {how})" in f for f in labels), labels
    for name, (t, want) in held.items():
        got = stored_dense(config, weights, name)
        assert got.shape == want.shape, name
        if t == "F32" or status == "exact":
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif status == "same grid":
            # Codes kept; each per-32 scale and bias rounded to float16 (2**-11 relative).
            groups = np.abs(want).reshape(want.shape[0], -1, 32).max(-1, keepdims=True)
            err = np.abs(got - want).reshape(groups.shape[0], -1, 32)
            assert (err <= 2e-3 * groups + 1e-8).all(), name
        else:
            bits = PLANS[t].bits
            g = want.reshape(want.shape[0], -1, 32)
            step = (g.max(-1) - g.min(-1)) / (2**bits - 1)
            err = np.abs(got - want).reshape(g.shape).max(-1)
            assert (err <= step + 2e-3 * np.abs(g).max(-1) + 1e-7).all(), name


def greedy_ours(lm: Any, prompt: list[int], n: int) -> list[int]:
    from engine.runtime.generate import generate
    from engine.runtime.sampling import SamplingParams

    return [e.token for e in generate(lm, prompt, SamplingParams(temperature=0.0),
                                      max_tokens=n) if e.token is not None]


@pytest.mark.parametrize(("qtype", "status", "tol"), ROWS)
def test_logits_and_greedy_match_llama_cpp(cases: Callable[[str], Case], tokens: list[int],
                                           qtype: str, status: str, tol: Tol) -> None:
    case = cases(qtype)
    lm = load(case)
    ours = logits_of(lm, tokens)
    ref: Reference = reference(case.path)
    try:
        theirs = ref.logits(tokens)
        assert theirs.std() > 5.0  # decisive: the greedy choice is not a coin toss
        diff = np.abs(ours - theirs)
        assert diff.max() <= tol.max and diff.mean() <= tol.mean, (
            f"{qtype}: max {diff.max():.3f} mean {diff.mean():.3f} (tolerance {tol})")
        # Along llama.cpp's greedy path: the same pick wherever its margin is past the noise.
        prompt = tokens[:8]
        path = ref.greedy(prompt, N_GREEDY)
        along = ref.logits(prompt + path)[len(prompt) - 1 : -1]
    finally:
        ref.close()
    mine = logits_of(lm, prompt + path)[len(prompt) - 1 : -1]
    picks = mine.argmax(-1)
    margin = along[np.arange(N_GREEDY), path] - along[np.arange(N_GREEDY), picks]
    if status not in TWIN_TOL:
        return  # requantized: another model, near; its logits are held above
    assert (margin <= tol.max).all(), (qtype, margin.max())
    twin = reference(case.twin)
    try:
        twin_logits = twin.logits(tokens)
        twin_greedy = twin.greedy(prompt, N_GREEDY)
    finally:
        twin.close()
    assert np.abs(ours - twin_logits).max() <= TWIN_TOL[status], qtype
    assert greedy_ours(lm, prompt, N_GREEDY) == twin_greedy, qtype


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "MXFP4", "IQ4_NL"])
def test_a_tensor_converted_in_chunks_equals_it_converted_whole(
        qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large tensors are converted a few rows at a time (no float32 copy of a whole tensor):
    the same arrays, format and error as in one piece."""
    import mlx.core as mx

    from engine.importers import gguf_types

    rng = np.random.default_rng(5)
    raw, _, _ = encode((0.05 * rng.standard_normal((96, 256))).astype(np.float32), qtype, rng)
    whole = gguf_types.convert_tensor("m.weight", raw, qtype, (96, 256))
    monkeypatch.setattr(gguf_types, "CHUNK_ELEMENTS", 256 * 7)  # 7 rows a chunk: 14 chunks
    parts = gguf_types.convert_tensor("m.weight", raw, qtype, (96, 256))
    assert (parts.label, parts.quant, parts.max_error) == (whole.label, whole.quant,
                                                           whole.max_error)
    assert parts.arrays.keys() == whole.arrays.keys()
    for k, v in whole.arrays.items():
        assert mx.array_equal(v, parts.arrays[k]), k
