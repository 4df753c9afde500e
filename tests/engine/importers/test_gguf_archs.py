"""Dense GGUF architectures import and compute what llama.cpp computes.

Contract checked, per architecture (llama with Llama 3's RoPE scaling, qwen2, qwen3, gemma2,
gemma3, phi3, starcoder2, olmo2, granite, command-r) and GGUF type (F32 as the converter writes
it; Q8_0 and Q4_K_M made from it by llama.cpp's own quantizer): the file imports through
`engine.importers.import_path` into a temporary library, loads with Strata's runtime in the
float32 compute profile, and its next-token logits equal llama.cpp's (llama-cpp-python on the
same file) within the tolerance `MATRIX` states, as a fraction of llama.cpp's logit standard
deviation: at every position of a fixed 24-token prompt (prefilled into mlx-lm's own KV cache,
rotating for sliding-window layers) and at each of the decode steps that follow,
teacher-forced along llama.cpp's greedy tokens; and 32 greedy tokens from Strata's decode loop
equal llama.cpp's. The random models are decisive (logit std of several units and a wide
top-token margin, both checked): see tests/engine/gguf_arch_factory.py. Variants (llama's
linear and yarn RoPE scaling, Mistral Nemo's head size, OLMo 3's sliding windows) are checked
the same way in F32. Llama 3's scaling, which the converter folds into `rope_freqs`, is
recovered as mlx-lm's rope_scaling whose frequencies equal the tensor's. Settings mlx-lm's
model files cannot express are refused in one line. `MATRIX` is what docs/models.md's table
is generated from.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import ImportFailed
from engine.importers import gguf_arch, import_path
from engine.library import Library
from tests.engine.gguf_arch_factory import (
    ARCH_SPECS,
    ROPE_SPECS,
    ArchFile,
    ArchSpec,
    llama3_factors,
    write_arch,
)
from tests.engine.gguf_factory import Vocab, bpe_vocab
from tests.engine.llamacpp_reference import llama_cpp, quantize, reference

# (GGUF architecture, GGUF type, max |logit difference| / llama.cpp's logit std), for the
# prompt's logits and the decode steps' alike. Measured on these files (worst of prompt and
# decode over the ten architectures, two seed sets): F32 at most 1.5e-3 (llama.cpp keeps its
# KV cache in float16); Q8_0 at most 0.045 (codes repacked exactly; llama.cpp quantizes
# activations to 8 bits for its dot products); Q4_K_M at most 0.085 (Strata requantizes Q4_K
# and Q6_K at MLX's 4 and 6 bits, on top of llama.cpp's own activation rounding). A mapping
# mistake (a RoPE base, scaling, window, softcap, multiplier or attention scale left at
# mlx-lm's default) moves the F32 logits by 0.1 std or more on these files.
TOLERANCE = {"F32": 5e-3, "Q8_0": 0.08, "Q4_K_M": 0.15}
MATRIX: list[tuple[str, str, float]] = [
    (arch, gtype, TOLERANCE[gtype]) for arch in ARCH_SPECS for gtype in ("F32", "Q8_0", "Q4_K_M")
]
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3": "gemma3_text", "phi3": "phi3", "starcoder2": "starcoder2",
               "olmo2": "olmo2", "granite": "granite", "command-r": "cohere"}
N_PROMPT, N_GREEDY = 24, 32
MIN_LOGIT_STD = 2.0  # below this a random model's greedy choices are near ties
SPECS: dict[str, ArchSpec] = {**ARCH_SPECS, **ROPE_SPECS}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama_cpp()  # skip the module, with why, where llama-cpp-python is not installed
    return tmp_path_factory.mktemp("gguf_archs")


@pytest.fixture(scope="module")
def lib(workdir: Path) -> Library:
    return Library(workdir / "home")


@pytest.fixture(scope="module")
def bpe() -> tuple[Vocab, Any]:
    return bpe_vocab()


@pytest.fixture(scope="module")
def tokens(bpe: tuple[Vocab, Any]) -> list[int]:
    """A fixed prompt of ordinary (non-special) token ids."""
    rng = np.random.default_rng(5)
    return [int(t) for t in rng.integers(3, len(bpe[0].tokens), N_PROMPT)]


@pytest.fixture(scope="module")
def arch_file(workdir: Path, bpe: tuple[Vocab, Any]) -> Callable[[str], ArchFile]:
    """case -> its F32 file, written once."""
    done: dict[str, ArchFile] = {}

    def get(case: str) -> ArchFile:
        if case not in done:
            # A seed per case that does not move when cases are added.
            done[case] = write_arch(workdir / f"{case}-F32.gguf", SPECS[case], bpe[0],
                                    seed=zlib.crc32(case.encode()))
        return done[case]

    return get


@pytest.fixture(scope="module")
def gguf_file(workdir: Path, arch_file: Callable[[str], ArchFile]
              ) -> Callable[[str, str], Path]:
    """(case, GGUF type) -> the file: F32 as written, others quantized by llama.cpp."""

    def get(case: str, gtype: str) -> Path:
        src = arch_file(case).path
        if gtype == "F32":
            return src
        dst = workdir / f"{case}-{gtype}.gguf"
        if not dst.exists():
            quantize(src, dst, gtype)
        return dst

    return get


@pytest.fixture(scope="module")
def imported(lib: Library, gguf_file: Callable[[str, str], Path]
             ) -> Callable[[str, str], dict[str, Any]]:
    """(case, GGUF type) -> the manifest of its import, imported once."""
    done: dict[tuple[str, str], dict[str, Any]] = {}

    def get(case: str, gtype: str) -> dict[str, Any]:
        if (case, gtype) not in done:
            done[case, gtype] = dict(import_path(lib, gguf_file(case, gtype),
                                                 name=f"{case}-{gtype.lower()}"))
        return done[case, gtype]

    return get


@dataclass
class Run:
    """Next-token logits over the prompt and the decode steps, and greedy tokens."""

    prompt: np.ndarray  # (N_PROMPT, vocab): after each prompt position
    decode: np.ndarray  # (N_GREEDY, vocab): after the prompt and after each forced token
    greedy: list[int]


def llamacpp_run(path: Path, tokens: list[int]) -> Run:
    """llama.cpp's greedy tokens, and its logits over the prompt followed by them."""
    ref = reference(path)
    try:
        greedy = ref.greedy(tokens, N_GREEDY)
        logits = ref.logits(tokens + greedy[:-1])
    finally:
        ref.close()
    return Run(logits[:N_PROMPT], logits[N_PROMPT - 1:], greedy)


def strata_run(folder: Path, tokens: list[int], forced: list[int]) -> Run:
    """Strata's runtime on an imported folder (float32 compute profile): the prompt prefilled
    in one call into the model's own mlx-lm KV cache, then `forced` fed one token at a time
    through that cache; and the greedy tokens of engine.runtime.generate."""
    import mlx.core as mx

    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(folder, profile=compute_profile("cpu-f32"), warm_up=False)
    cache = lm.new_cache().cache  # mlx-lm's make_prompt_cache: kv_settings is unset
    prompt = lm.model(mx.array([tokens]), cache=cache)[0]
    steps = [prompt[-1]] + [lm.model(mx.array([[t]]), cache=cache)[0, -1] for t in forced]
    lm.eos_ids = set()  # a random model may pick an end-of-turn token; compare all of them
    events = generate(lm, tokens, SamplingParams(temperature=0.0), max_tokens=N_GREEDY)
    return Run(np.array(prompt.astype(mx.float32)), np.array(mx.stack(steps).astype(mx.float32)),
               [e.token for e in events if e.token is not None])


def check_against_llamacpp(case: str, gtype: str, tol: float, path: Path,
                           manifest: dict[str, Any], tokens: list[int]) -> None:
    want = llamacpp_run(path, tokens)
    got = strata_run(Path(manifest["path"]), tokens, want.greedy[:-1])
    std = float(want.prompt.std())
    assert std >= MIN_LOGIT_STD, f"random model not decisive (logit std {std:.2f})"
    for what, ours, theirs in (("prompt", got.prompt, want.prompt),
                               ("decode", got.decode, want.decode)):
        assert ours.shape == theirs.shape, what
        diff = float(np.abs(ours - theirs).max())
        print(f"{case} {gtype} {what}: logit std {std:.2f}, max |diff| {diff:.3g} "
              f"= {diff / std:.3g} std")
        assert diff <= tol * std, (f"{what}: max |logit diff| {diff:.3g} = {diff / std:.3g} "
                                   f"std > {tol}")
    # Decisive: at every step llama.cpp's top token leads by more than both sides may be off.
    top2 = np.sort(want.decode, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    assert margin > 2 * tol * std, f"a greedy step is a near tie (margin {margin:.3g})"
    assert got.greedy == want.greedy


# -- 1. every architecture and type against llama.cpp -------------------------------------
@pytest.mark.parametrize(("arch", "gtype", "tol"), MATRIX, ids=[f"{a}-{t}" for a, t, _ in MATRIX])
def test_matches_llamacpp(gguf_file: Callable[[str, str], Path],
                          imported: Callable[[str, str], dict[str, Any]], tokens: list[int],
                          arch: str, gtype: str, tol: float) -> None:
    manifest = imported(arch, gtype)
    assert manifest["architecture"] == MODEL_TYPES[arch]
    assert manifest["source_format"] == "gguf"
    check_against_llamacpp(arch, gtype, tol, gguf_file(arch, gtype), manifest, tokens)


@pytest.mark.parametrize("case", sorted(ROPE_SPECS))
def test_variants_match_llamacpp(gguf_file: Callable[[str, str], Path],
                                 imported: Callable[[str, str], dict[str, Any]],
                                 tokens: list[int], case: str) -> None:
    """llama's rope.scaling.type linear and yarn, a llama head size other than hidden / heads
    (Mistral Nemo), and olmo2 with sliding-window layers (OLMo 3, run as mlx-lm's olmo3)."""
    check_against_llamacpp(case, "F32", TOLERANCE["F32"], gguf_file(case, "F32"),
                           imported(case, "F32"), tokens)


# -- 2. what the configs say ----------------------------------------------------------------
def read_config(manifest: dict[str, Any]) -> dict[str, Any]:
    import json

    return dict(json.loads((Path(manifest["path"]) / "config.json").read_text()))


def test_llama3_rope_scaling_from_rope_freqs(arch_file: Callable[[str], ArchFile],
                                             imported: Callable[[str, str], dict[str, Any]]
                                             ) -> None:
    """The converter's rope_freqs becomes rope_type llama3 with the factors it came from, and
    mlx-lm's Llama3RoPE then divides each frequency by exactly the tensor's value."""
    import mlx.core as mx

    from engine.runtime.model import ensure_mlx_lm

    ensure_mlx_lm()  # mlx-lm's model files without its package's imports (transformers)
    from mlx_lm.models.rope_utils import Llama3RoPE

    written = arch_file("llama")
    spec, freqs = written.spec, written.rope_freqs
    assert freqs is not None
    # The ramp acts: some frequencies are left alone, some divided by the factor, some between.
    assert (freqs == 1).any() and (freqs == 8).any() and ((freqs > 1) & (freqs < 8)).sum() >= 2
    for gtype in ("F32", "Q4_K_M"):  # rope_freqs stays F32 in quantized files too
        config = read_config(imported("llama", gtype))
        assert config["rope_scaling"] == {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = Llama3RoPE(spec.hd, base=spec.rope_base, scaling_config=config["rope_scaling"])
    plain = spec.rope_base ** (np.arange(0, spec.hd, 2) / spec.hd)
    np.testing.assert_allclose(np.array(rope._freqs.astype(mx.float32)) / plain, freqs,
                               rtol=2e-5)


@pytest.mark.parametrize(("factor", "low", "high", "old", "dim", "base"), [
    (8.0, 1.0, 4.0, 8192, 128, 500000.0),  # Llama 3.1 8B/70B/405B
    (32.0, 1.0, 4.0, 8192, 64, 500000.0),  # Llama 3.2 1B (head size 64)
    (32.0, 1.0, 4.0, 8192, 128, 500000.0),  # Llama 3.2 3B
    (8.0, 2.0, 8.0, 4096, 128, 10000.0),  # another low_freq_factor: same divisors, refitted
    (4.0, 1.0, 4.0, 8192, 16, 500000.0),  # few frequencies: at most one on the ramp
])
def test_llama3_scaling_recovered_exactly(factor: float, low: float, high: float, old: int,
                                          dim: int, base: float) -> None:
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": old}
    freqs = llama3_factors(rope, base, dim)
    got = gguf_arch.llama3_rope_scaling(freqs, base, dim)
    assert got is not None and got["rope_type"] == "llama3" and got["factor"] == factor
    np.testing.assert_allclose(gguf_arch._llama3_factors(got, base, dim), freqs, rtol=1e-5)
    if low == 1.0 and ((freqs > 1) & (freqs < factor)).sum() >= 2:
        # With low_freq_factor 1 (every Llama 3 release) the very values come back.
        assert got == rope
    assert gguf_arch.llama3_rope_scaling(np.ones(dim // 2, np.float32), base, dim) is None


def test_config_fields(imported: Callable[[str, str], dict[str, Any]]) -> None:
    """The settings llama.cpp derives or defaults, as mlx-lm's ModelArgs name them."""
    g2 = read_config(imported("gemma2", "F32"))
    assert (g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (2.0, 30.0)
    assert g2["query_pre_attn_scalar"] == 64.0 and g2["tie_word_embeddings"] is True
    assert g2["rope_theta"] == 10000.0  # Gemma2Model writes no RoPE base: llama.cpp's default
    g3 = read_config(imported("gemma3", "F32"))
    assert g3["model_type"] == "gemma3_text" and g3["architectures"] == ["Gemma3ForCausalLM"]
    assert (g3["sliding_window"], g3["sliding_window_pattern"]) == (8, 6)
    assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert (g3["rope_theta"], g3["rope_local_base_freq"]) == (1e6, 10000.0)
    assert g3["rope_scaling"]["rope_type"] == "linear" and g3["rope_scaling"]["factor"] == 8.0
    q3 = read_config(imported("qwen3", "F32"))
    assert (q3["head_dim"], q3["hidden_size"] // q3["num_attention_heads"]) == (128, 64)
    phi = read_config(imported("phi3", "F32"))
    assert phi["rope_scaling"]["type"] == "longrope"
    assert len(phi["rope_scaling"]["long_factor"]) == 32
    assert (phi["max_position_embeddings"], phi["original_max_position_embeddings"]) == (1024, 256)
    granite = read_config(imported("granite", "F32"))
    assert (granite["embedding_multiplier"], granite["residual_multiplier"],
            granite["attention_multiplier"], granite["logits_scaling"]
            ) == pytest.approx((12.0, 0.22, 0.015625, 8.0))  # float32 in the file
    olmo3 = read_config(imported("olmo3", "F32"))
    assert olmo3["model_type"] == "olmo3" and olmo3["sliding_window"] == 8
    assert olmo3["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"]
    assert read_config(imported("olmo2", "F32"))["model_type"] == "olmo2"


# -- 3. what llama.cpp derives from the layer count, and what is refused -------------------
def config_for(arch: str, meta: dict[str, Any],
               tensors: Mapping[str, tuple[int, ...]] | None = None,
               read: Callable[[str], np.ndarray] | None = None) -> dict[str, Any]:
    """model_config for metadata alone (no file): `meta` without the `{arch}.` prefix."""
    full: dict[str, Any] = {"general.architecture": arch,
                            "tokenizer.ggml.tokens": ["a"] * 320}
    base = {"block_count": 2, "embedding_length": 256, "feed_forward_length": 512,
            "attention.head_count": 4, "attention.head_count_kv": 2, "context_length": 512}
    full.update({f"{arch}.{k}": v for k, v in {**base, **meta}.items()})
    shapes = {"blk.0.attn_qkv.weight": (256, 768)} if arch == "phi3" else {}
    found, m = gguf_arch.arch_for(Path(f"/x/{arch}.gguf"), full, {**shapes, **(tensors or {})},
                                  read)
    return gguf_arch.model_config(found, m)


def test_gemma_27b_attention_scale() -> None:
    """llama.cpp scales queries by 1/sqrt(hidden / heads) in Gemma 2 27B (46 layers) and Gemma
    3 27B (62 layers), by 1/sqrt(head size) otherwise."""
    big = {"embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128}
    assert config_for("gemma2", {**big, "block_count": 46})["query_pre_attn_scalar"] == 144.0
    assert config_for("gemma2", {**big, "block_count": 42})["query_pre_attn_scalar"] == 128.0
    big3 = {"embedding_length": 5376, "attention.head_count": 32, "attention.key_length": 128}
    assert config_for("gemma3", {**big3, "block_count": 62})["query_pre_attn_scalar"] == 168.0
    assert config_for("gemma3", {**big3, "block_count": 34})["query_pre_attn_scalar"] == 128.0


def test_gemma3_window_pattern() -> None:
    """No window: every layer global; a pattern array that is every n-th layer global."""
    none = config_for("gemma3", {"block_count": 4})
    assert none["sliding_window_pattern"] == 1 and set(none["layer_types"]) == {"full_attention"}
    flags = [True, True, False] * 2
    arr = config_for("gemma3", {"block_count": 6, "attention.sliding_window": 512,
                                "attention.sliding_window_pattern": flags})
    assert arr["sliding_window_pattern"] == 3


@pytest.mark.parametrize(("arch", "meta", "reason"), [
    ("gemma3", {"final_logit_softcapping": 30.0}, "final logit softcapping"),
    ("gemma3", {"block_count": 4, "attention.sliding_window": 512,
                "attention.sliding_window_pattern": [True, False, False, True]}, "pattern"),
    ("gemma2", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, "RoPE scaling"),
    ("llama", {"rope.scaling.type": "longrope"}, "RoPE scaling 'longrope'"),
    ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0,
               "rope.scaling.attn_factor": 1.2}, "attn_factor"),
    ("llama", {"rope.dimension_count": 32}, "partial RoPE"),
    ("qwen2", {"attention.key_length": 128}, "head size 128"),
    ("phi3", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0}, "RoPE scaling"),
])
def test_unsupported_settings_are_refused(arch: str, meta: dict[str, Any], reason: str
                                          ) -> None:
    tensors = {"blk.0.attn_q.bias": (256,)} if arch == "qwen2" else {}
    with pytest.raises(ImportFailed) as info:
        config_for(arch, meta, tensors)
    assert reason in str(info.value) and f"/x/{arch}.gguf" in str(info.value)
    assert "\n" not in str(info.value)


def test_phi3_longrope_scale_must_match() -> None:
    factors = {"rope_factors_long.weight": np.full(32, 2.0, np.float32),
               "rope_factors_short.weight": np.ones(32, np.float32)}
    meta = {"context_length": 1024, "rope.scaling.original_context_length": 256,
            "rope.scaling.attn_factor": 1.0}
    with pytest.raises(ImportFailed, match="attn_factor 1 differs"):
        config_for("phi3", meta, {k: (32,) for k in factors}, factors.__getitem__)


def test_qwen2_without_biases_runs_as_llama() -> None:
    config = config_for("qwen2", {})
    assert config["model_type"] == "llama" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["attention_bias"] is False


def test_unknown_architecture_lists_the_dense_ones() -> None:
    with pytest.raises(ImportFailed) as info:
        gguf_arch.arch_for(Path("/x/falcon.gguf"), {"general.architecture": "falcon"}, {})
    text = str(info.value)
    assert "unsupported architecture 'falcon'" in text
    for arch in ARCH_SPECS:
        assert arch in text
