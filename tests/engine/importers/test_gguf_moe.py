"""Mixture-of-experts GGUF files import and compute what llama.cpp computes.

Contract checked, per family (mixtral, qwen2moe, qwen3moe, gpt-oss) and GGUF type (F32 as the
converter writes it; Q8_0, Q4_K_M and MXFP4_MOE made from it by llama.cpp's own quantizer):
the file imports through `engine.importers.import_path` into a temporary library and loads
with Strata's runtime in the float32 compute profile (every quantized layer dense, stacked
experts too); its next-token logits at every position of a fixed 24-token prompt (one batched
call) and at each of 32 decode steps (the prompt prefilled into the model's own KV cache,
rotating for gpt-oss's sliding-window layers, then llama.cpp's greedy tokens fed one at a
time) equal llama.cpp's on the same file within the tolerance `MATRIX` states, as a fraction of
llama.cpp's logit standard deviation (quantized files: up to MAX_FLIPS positions where a
token's expert choice was a near tie may differ more, within FLIP_TOL); and 32 greedy tokens
from Strata's decode loop equal llama.cpp's. The random models are decisive (logit std about
4; every greedy step leads by more than twice the tolerance, checked): see
tests/engine/gguf_moe_factory.py. `MATRIX` is what docs/models.md's table is generated from.
Also: the quantized experts run unexpanded in the native profile, and settings mlx-lm's model
files would silently ignore are refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import ImportFailed
from engine.importers import import_path
from engine.library import Library
from tests.engine.gguf_factory import Vocab, bpe_vocab
from tests.engine.gguf_moe_factory import FAMILIES, write_moe_gguf
from tests.engine.llamacpp_reference import llama_cpp, quantize, reference

# (family as users name it, GGUF type, max |logit difference| / llama.cpp's logit std at a
# position), for the prompt's positions and the decode steps alike. mixtral's GGUF
# architecture is "llama" with llama.expert_count; the others are their own. Measured on these
# files, worst position apart from routing flips (below): F32 2.0e-3 (llama.cpp keeps its KV
# cache in float16); Q8_0 0.06 (codes repacked exactly; llama.cpp quantizes activations to 8
# bits for its dot products); Q4_K_M 0.14; MXFP4_MOE (experts MXFP4, the rest Q8_0) 0.054.
TOLERANCE = {"F32": 5e-3, "Q8_0": 0.1, "Q4_K_M": 0.2, "MXFP4_MOE": 0.1}
MATRIX: list[tuple[str, str, float]] = [
    (family, gtype, TOLERANCE[gtype])
    for family in FAMILIES
    for gtype in ("F32", "Q8_0", "Q4_K_M", "MXFP4_MOE")
]
# A routing flip: where a token's k-th and (k+1)-th experts score within the noise of
# llama.cpp's 8-bit activations, the two sides may route that token differently, and its
# logits differ by more than the rest (measured: at most one position of 56 per file, up to
# 0.63 std). Quantized files may have up to MAX_FLIPS such positions, each within FLIP_TOL.
MAX_FLIPS, FLIP_TOL = 2, 1.0
PROMPT = ("The quick brown fox jumps over the lazy dog. A local model runs on your own "
          "machine: it reads the weights, builds the cache, and answers.")
N_PROMPT, N_GREEDY = 24, 32
MIN_LOGIT_STD = 3.0  # below this a random model's greedy choices are near ties


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama_cpp()  # skip the module, with why, where llama-cpp-python is not installed
    return tmp_path_factory.mktemp("gguf_moe")


@pytest.fixture(scope="module")
def bpe() -> tuple[Vocab, Any]:
    return bpe_vocab()


@pytest.fixture(scope="module")
def tokens(bpe: tuple[Vocab, Any]) -> list[int]:
    ids = list(bpe[1].encode(PROMPT).ids)[:N_PROMPT]
    assert len(ids) == N_PROMPT
    return ids


@pytest.fixture(scope="module")
def gguf_file(workdir: Path, bpe: tuple[Vocab, Any]) -> Callable[[str, str], Path]:
    """(family, GGUF type) -> the file: F32 written once per family, others quantized from it
    by llama.cpp."""

    def get(family: str, gtype: str) -> Path:
        src = workdir / f"{family}-F32.gguf"
        if not src.exists():
            write_moe_gguf(src, family, bpe[0], seed=FAMILIES.index(family))
        if gtype == "F32":
            return src
        dst = workdir / f"{family}-{gtype}.gguf"
        if not dst.exists():
            quantize(src, dst, gtype)
        return dst

    return get


@dataclass
class Run:
    """What Strata's runtime computes for one imported folder (float32 compute profile)."""

    prompt: np.ndarray  # next-token logits at every prompt position, one batched call
    decode: np.ndarray  # logits after the prompt and after each forced token, via the cache
    greedy: list[int]  # N_GREEDY tokens from Strata's decode loop


def strata_run(folder: Path, tokens: list[int], forced: list[int],
               profile: str = "cpu-f32") -> Run:
    """Load `folder` with Strata's runtime and compute a `Run`: the prompt's logits without a
    cache; the prompt prefilled into the model's own KV cache (mlx-lm's, rotating for
    sliding-window layers) and then `forced` fed one token at a time, the last logits of each
    step kept; and the greedy tokens of engine.runtime.generate."""
    import mlx.core as mx

    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.model import cache_module
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(folder, profile=compute_profile(profile), warm_up=False)
    if profile == "cpu-f32":  # every quantized layer, stacked experts too, is now dense
        assert not [p for p, m in lm.model.named_modules() if "Quantized" in type(m).__name__]
    prompt = np.array(lm.model(mx.array([tokens]))[0].astype(mx.float32))
    cache = cache_module().make_prompt_cache(lm.model)
    steps = [lm.model(mx.array([tokens]), cache=cache)[0, -1]]
    for t in forced:
        steps.append(lm.model(mx.array([[t]]), cache=cache)[0, -1])
    decode = np.array(mx.stack(steps).astype(mx.float32))
    lm.eos_ids = set()  # a random model may pick an end-of-turn token; compare all of them
    events = generate(lm, tokens, SamplingParams(temperature=0.0), max_tokens=N_GREEDY)
    return Run(prompt, decode, [e.token for e in events if e.token is not None])


def llamacpp_run(path: Path, tokens: list[int]) -> Run:
    """The same from llama.cpp: its greedy tokens, and its logits over the prompt and over the
    prompt followed by those tokens (the decode steps, teacher-forced)."""
    ref = reference(path)
    try:
        prompt = ref.logits(tokens)
        greedy = ref.greedy(tokens, N_GREEDY)
        decode = ref.logits(tokens + greedy[:-1])[len(tokens) - 1:]
    finally:
        ref.close()
    return Run(prompt, decode, greedy)


@pytest.mark.parametrize(("family", "gtype", "tol"), MATRIX,
                         ids=[f"{f}-{t}" for f, t, _ in MATRIX])
def test_matches_llamacpp(gguf_file: Callable[[str, str], Path], workdir: Path,
                          tokens: list[int], family: str, gtype: str, tol: float) -> None:
    path = gguf_file(family, gtype)
    manifest = import_path(Library(workdir / f"home-{family}-{gtype}"), path)
    want = llamacpp_run(path, tokens)
    got = strata_run(Path(manifest["path"]), tokens, want.greedy[:-1])

    std = float(want.prompt.std())
    assert std >= MIN_LOGIT_STD, f"random model not decisive (logit std {std:.2f})"
    assert got.prompt.shape == want.prompt.shape and got.decode.shape == want.decode.shape
    per_position = np.concatenate([np.abs(got.prompt - want.prompt).max(axis=-1),
                                   np.abs(got.decode - want.decode).max(axis=-1)]) / std
    worst = np.sort(per_position)[::-1]
    print(f"{family} {gtype}: logit std {std:.2f}; worst positions {np.round(worst[:3], 4)} "
          "std")
    off = worst[worst > tol]
    allowed = 0 if gtype == "F32" else MAX_FLIPS
    assert len(off) <= allowed and (off <= FLIP_TOL).all(), (
        f"{len(off)} of {len(worst)} positions beyond {tol} std (worst {worst[0]:.3g} std)")
    # Decisive: at every greedy step llama.cpp's top token leads by more than twice the
    # tolerance, so equal greedy tokens are required, not luck.
    top2 = np.sort(want.decode, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 2 * tol * std, f"a greedy step is a near tie (margin {margin:.3g})"
    assert got.greedy == want.greedy


@pytest.mark.parametrize(("family", "gtype"), [("mixtral", "Q4_K_M"), ("gpt-oss", "MXFP4_MOE")])
def test_native_profile_runs_quantized_experts(gguf_file: Callable[[str, str], Path],
                                               workdir: Path, tokens: list[int], family: str,
                                               gtype: str) -> None:
    """Without dequantizing, the stacked experts run as mlx-lm's QuantizedSwitchLinear (affine
    or mxfp4 mode, from config.json's per-module entries) and compute what the float32
    profile computes."""
    path = gguf_file(family, gtype)
    manifest = import_path(Library(workdir / f"native-{family}-{gtype}"), path)
    folder = Path(manifest["path"])
    native = strata_run(folder, tokens, [], profile="native")
    dense = strata_run(folder, tokens, [], profile="cpu-f32")
    std = float(dense.prompt.std())
    assert float(np.abs(native.prompt - dense.prompt).max()) <= 1e-3 * std
    assert native.greedy == dense.greedy


@pytest.mark.parametrize(("family", "extra", "says"), [
    ("qwen3moe", {"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": 4.0},
     "RoPE scaling 'yarn' is not supported for qwen3_moe"),
    ("gpt-oss", {"gpt-oss.attention.sliding_window_pattern": 1},
     "needs both sliding-window and full-attention layers"),
    ("mixtral", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
     "RoPE scaling 'linear' is not supported for mixtral"),
])
def test_settings_mlx_lm_would_ignore_are_refused(
        workdir: Path, bpe: tuple[Vocab, Any], family: str, extra: dict[str, Any],
        says: str) -> None:
    """A file whose settings mlx-lm's model file cannot express fails in one line naming the
    file and the setting, before anything reaches the library."""
    path = workdir / f"refused-{family}.gguf"
    write_moe_gguf(path, family, bpe[0], extra=extra)
    home = workdir / f"refused-home-{family}"
    lib = Library(home)
    with pytest.raises(ImportFailed) as err:
        import_path(lib, path)
    message = str(err.value)
    assert str(path) in message and says in message and "\n" not in message
    assert lib.manifests() == []
    assert not list(home.rglob("*.safetensors"))  # nor a half-written folder
