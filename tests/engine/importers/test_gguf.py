"""GGUF import: every supported tensor type, both tokenizer kinds, qwen2, and bad input.

Contract checked: GGUF files written here with the `gguf` package (tests/engine/gguf_factory.py)
import into a temporary library with weights equal to the file's dequantized values within each
type's tolerance (llama Q/K rows back in Hugging Face order), then load and generate; their
tokenizers encode like the originals and round-trip text. Bad input fails through the real CLI
with one `strata: error:` line naming the path, and leaves the library unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

from engine.errors import Cancelled, ImportFailed
from engine.importers import import_path
from engine.library import Library
from tests.engine.gguf_factory import (
    CHATML_TEMPLATE,
    SPM_USER_DEFINED,
    ModelSpec,
    Vocab,
    Written,
    bpe_vocab,
    random_blocks,
    spm_vocab,
    write_gguf,
)
from tests.helpers import run_strata

FLOAT_TYPES = ("F32", "F16", "BF16")
EXACT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4", "NVFP4")
GRID_TYPES = ("Q4_K", "Q5_K")  # codes carried over, per-32 scales rounded to float16
REQUANT_TYPES = ("Q6_K", "IQ4_XS", "IQ2_XXS")
ALL_TYPES = FLOAT_TYPES + EXACT_TYPES + GRID_TYPES + REQUANT_TYPES
# (The whole matrix of types, against llama.cpp, is tests/engine/importers/test_gguf_types.py.)
# Hidden and FFN sizes are multiples of 256 so that K-quant rows hold whole super-blocks.
SPEC = ModelSpec(hidden=256, heads=4, kv_heads=2, ffn=512, layers=2)
UNTIED = ("F32", "Q6_K")  # these files carry output.weight; the others tie it to the embedding
SMALL = ModelSpec(hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)

Snapshot = dict[str, tuple[int, int]]


def snapshot(home: Path) -> Snapshot:
    """Every file under STRATA_HOME/models with its size and mtime: 'unchanged' means equal."""
    models = home / "models"
    return {str(p.relative_to(models)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(models.rglob("*"))}


def leftovers(home: Path) -> list[str]:
    return [p.name for p in (home / "models").glob(".tmp-*")]


def load_imported(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json, weights dict) of an imported model folder."""
    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    weights: dict[str, Any] = {}
    for f in sorted(folder.glob("model*.safetensors")):
        weights.update(cast(dict[str, Any], mx.load(str(f))))
    return config, weights


def dense(config: dict[str, Any], weights: dict[str, Any], name: str) -> np.ndarray:
    """A tensor as float32 numpy; quantized ones through mx.dequantize in float32."""
    import mlx.core as mx

    module = name.rsplit(".", 1)[0]
    if not name.endswith(".weight") or f"{module}.scales" not in weights:
        return np.array(weights[name].astype(mx.float32))
    q = config["quantization"][module]
    mode = q.get("mode", "affine")
    scales = weights[f"{module}.scales"]
    biases = weights.get(f"{module}.biases")
    return np.array(mx.dequantize(
        weights[name], scales.astype(mx.float32) if mode == "affine" else scales,
        None if biases is None else biases.astype(mx.float32),
        group_size=q["group_size"], bits=q["bits"], mode=mode, dtype=mx.float32,
    ))


def assert_requantized(got: np.ndarray, want: np.ndarray, bits: int, name: str) -> None:
    """Per group of 32: within one MLX step (rounding plus MLX's zero-point snap); mean < 0.3.

    mx.quantize makes zero exact by snapping the scale (edge / round(edge / scale)), which can
    leave the far end of a group up to one step short; fp16 scales and biases add ~2**-11.
    """
    g_want = want.reshape(want.shape[0], -1, 32)
    g_err = np.abs(got - want).reshape(g_want.shape)
    step = (g_want.max(-1) - g_want.min(-1)) / (2**bits - 1)
    tol = step + 2e-3 * np.abs(g_want).max(-1) + 1e-7
    worst = g_err.max(-1) / tol
    assert worst.max() <= 1.0, f"{name}: group error {worst.max():.3f} x tolerance"
    assert g_err.mean() <= 0.3 * step.mean() + 1e-7, f"{name}: mean error too large"


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


@pytest.fixture(scope="module")
def lib(workdir: Path) -> Library:
    return Library(workdir / "home")


@pytest.fixture(scope="module")
def bpe() -> tuple[Vocab, Any]:
    return bpe_vocab()


@pytest.fixture(scope="module")
def imported(workdir: Path, lib: Library, bpe: tuple[Vocab, Any]
             ) -> Callable[[str], tuple[Written, dict[str, Any]]]:
    """qtype -> (what the GGUF holds, manifest of its import); each written and imported once."""
    done: dict[str, tuple[Written, dict[str, Any]]] = {}

    def get(qtype: str) -> tuple[Written, dict[str, Any]]:
        if qtype not in done:
            spec = ModelSpec(**{**SPEC.__dict__, "tie": qtype not in UNTIED})
            written = write_gguf(workdir / f"tiny-{qtype}.gguf", spec, qtype, bpe[0],
                                 seed=ALL_TYPES.index(qtype))
            done[qtype] = (written, import_path(lib, written.path))
        return done[qtype]

    return get


def generate_n(folder: Path, n: int, profile: str | None = None) -> list[Any]:
    """Load an imported folder and generate `n` greedy tokens, EOS disabled (random weights)."""
    from engine.platform import compute_profile
    from engine.runtime.generate import LoadedModel, generate
    from engine.runtime.sampling import SamplingParams

    lm = LoadedModel.load(folder, profile=compute_profile(profile) if profile else None)
    lm.eos_ids = set()  # a random model may well pick EOS; the loop is what is tested here
    prompt = lm.tokenizer.encode("Hello world, speak.") or [0]
    return list(generate(lm, prompt, SamplingParams(temperature=0.0), max_tokens=n))


def check_generation(events: list[Any], n: int, vocab_size: int) -> None:
    tokens = [e.token for e in events if e.token is not None]
    assert len(tokens) == n
    assert all(0 <= t < vocab_size for t in tokens)
    assert events[-1].finish_reason == "length"
    assert events[-1].generated_tokens == n


# -- 1. every tensor type -------------------------------------------------------------------
@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_weights_match_source(
    imported: Callable[[str], tuple[Written, dict[str, Any]]], qtype: str
) -> None:
    written, manifest = imported(qtype)
    folder = Path(manifest["path"])
    config, weights = load_imported(folder)
    assert manifest["source_format"] == "gguf"
    assert config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is written.spec.tie
    assert ("lm_head.weight" in weights) is (not written.spec.tie)
    assert (config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"]) == (SPEC.hidden, SPEC.heads, SPEC.kv_heads)
    formats = {f for fs in manifest["quantization"].values() for f in fs}
    if qtype in FLOAT_TYPES:
        assert qtype.lower() in formats
    else:
        assert any(f"from {qtype}," in f for f in formats), formats
    assert set(weights) >= set(written.expected)

    for name, want in written.expected.items():
        got = dense(config, weights, name)
        assert got.shape == want.shape, name
        t = written.qtypes[name]
        if t in FLOAT_TYPES:
            # Floats arrive unchanged: F32 and F16 bit for bit, BF16 as the same bf16 values.
            np.testing.assert_array_equal(got, want, err_msg=name)
            assert weights[name].dtype.size == {"F32": 4, "F16": 2, "BF16": 2}[t], name
        elif t in EXACT_TYPES:
            np.testing.assert_array_equal(got, want, err_msg=name)
        else:
            bits = config["quantization"][name.rsplit(".", 1)[0]]["bits"]
            assert bits == {"Q4_K": 4, "Q5_K": 5, "Q6_K": 8, "IQ4_XS": 5, "IQ2_XXS": 3}[t]
            assert_requantized(got, want, bits, name)
        source = written.source[name]
        if source is not None and name.endswith(("q_proj.weight", "k_proj.weight")):
            # Against the Hugging Face-layout array the file was made from: rows un-permuted.
            if t == "F32":
                np.testing.assert_array_equal(got, source, err_msg=name)
            else:
                scale = np.abs(source).max()
                # (E2M1's steps near a block's top are a sixth of its range: fp4 rounds more.)
                rel = 0.25 if t in ("MXFP4", "NVFP4") else 0.1
                assert np.abs(got - source).max() < rel * scale, name


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_imported_model_generates(
    imported: Callable[[str], tuple[Written, dict[str, Any]]], qtype: str
) -> None:
    written, manifest = imported(qtype)
    events = generate_n(Path(manifest["path"]), 4)
    check_generation(events, 4, len(written.expected["model.embed_tokens.weight"]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_K", "Q6_K", "MXFP4", "NVFP4", "BF16"])
def test_imported_model_generates_with_quantized_weights_kept(
    imported: Callable[[str], tuple[Written, dict[str, Any]]], qtype: str
) -> None:
    """The 'native' profile keeps MLX quantized layers (4/5/8-bit, mxfp4, nvfp4) as they are
    on Metal."""
    written, manifest = imported(qtype)
    events = generate_n(Path(manifest["path"]), 3, profile="native")
    check_generation(events, 3, len(written.expected["model.embed_tokens.weight"]))


# -- 2. tokenizers --------------------------------------------------------------------------
ROUND_TRIP = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "digits 0123456789 and 3.14159",
    "na\u00efve caf\u00e9 \u65e5\u672c\u8a9e \U0001f642",
    "line one\nline two\n\n    indented\tand tabbed",
    "  two  spaces   here ",
]


@pytest.fixture(scope="module")
def bpe_model(workdir: Path, lib: Library, bpe: tuple[Vocab, Any]) -> dict[str, Any]:
    written = write_gguf(workdir / "tok-gpt2.gguf", SMALL, "F16", bpe[0], seed=11)
    return import_path(lib, written.path, name="tok-gpt2")


def test_bpe_tokenizer_matches_original(bpe: tuple[Vocab, Any], bpe_model: dict[str, Any]
                                        ) -> None:
    from engine.runtime.tokenizer import Tokenizer

    vocab, original = bpe
    folder = Path(bpe_model["path"])
    assert (folder / "tokenizer.json").is_file()
    assert bpe_model["tokenizer"] == {"tokenizer": "bpe", "vocab_size": len(vocab.tokens)}
    tok = Tokenizer.load(folder)
    assert tok.vocab_size == len(vocab.tokens)
    for text in [*ROUND_TRIP, "<|im_start|>user\nHi<|im_end|>\n"]:
        ids = tok.encode(text)
        assert ids == original.encode(text).ids, text
        assert tok.decode(ids) == text
    # Specials written in text become their ids, and only those.
    assert tok.encode("<|im_end|>") == [vocab.tokens.index("<|im_end|>")]
    assert len(tok.encode("<|im_end")) > 1


def test_bpe_chat_template_and_eos(bpe: tuple[Vocab, Any], bpe_model: dict[str, Any]) -> None:
    from engine.runtime.tokenizer import Tokenizer

    vocab, original = bpe
    folder = Path(bpe_model["path"])
    tok = Tokenizer.load(folder)
    assert tok.template_source == CHATML_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.render_chat(messages)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode_chat(messages)
    assert ids == original.encode(text).ids
    assert ids[0] == vocab.tokens.index("<|im_start|>")
    im_end, eot = vocab.tokens.index("<|im_end|>"), vocab.tokens.index("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_ids() == {im_end, eot}
    assert tok.bos_id == vocab.tokens.index("<|im_start|>")
    assert not tok.add_bos
    config, _ = load_imported(folder)
    assert config["eos_token_id"] == im_end
    from engine.runtime.generate import LoadedModel

    lm = LoadedModel.load(folder, warm_up=False)
    assert lm.eos_ids == {im_end, eot}


@pytest.fixture(scope="module")
def spm(shared_data: Path) -> tuple[Vocab, Any]:
    text = (shared_data / "tinyshakespeare.txt").read_text()[:200_000]
    return spm_vocab([line for line in text.splitlines() if line.strip()], vocab_size=400)


@pytest.fixture(scope="module")
def spm_model(workdir: Path, lib: Library, spm: tuple[Vocab, Any]) -> dict[str, Any]:
    written = write_gguf(workdir / "tok-llama.gguf", SMALL, "Q8_0", spm[0], seed=12)
    return import_path(lib, written.path, name="tok-llama")


def test_sentencepiece_tokenizer_matches_original(spm: tuple[Vocab, Any],
                                                  spm_model: dict[str, Any]) -> None:
    from engine.runtime.tokenizer import Tokenizer

    vocab, original = spm
    folder = Path(spm_model["path"])
    assert (folder / "tokenizer.model").is_file()
    assert spm_model["tokenizer"] == {"tokenizer": "sentencepiece", "vocab_size": 400}
    tok = Tokenizer.load(folder)
    assert tok.vocab_size == 400
    assert tok.bos_id == original.bos_id() == 1
    assert original.eos_id() in tok.eos_ids()
    assert tok.add_bos
    for text in [*ROUND_TRIP, "First Citizen:\nBefore we proceed any further, hear me speak."]:
        ids = tok.encode(text, add_bos=False)
        assert ids == original.encode(text), text
        assert tok.encode(text) == [original.bos_id(), *ids]
        assert tok.decode(ids) == text, text
    # Characters outside the vocabulary go through byte pieces, not <unk>.
    assert original.unk_id() not in tok.encode("\u65e5\u672c\u8a9e \U0001f642")
    # USER_DEFINED pieces are specials: written in text, they become their one id.
    sep = vocab.tokens.index(SPM_USER_DEFINED)
    assert vocab.types[sep] == 4 and tok.specials[SPM_USER_DEFINED] == sep
    # (sentencepiece itself puts its dummy-prefix piece first; HF and llama.cpp do not.)
    assert tok.encode(SPM_USER_DEFINED, add_bos=False) == [sep]
    assert original.encode(SPM_USER_DEFINED)[-1] == sep


def test_sentencepiece_model_generates(spm_model: dict[str, Any]) -> None:
    check_generation(generate_n(Path(spm_model["path"]), 4), 4, 400)


# -- 4. qwen2 -------------------------------------------------------------------------------
def test_qwen2_with_biases_imports_and_generates(workdir: Path, lib: Library,
                                                 bpe: tuple[Vocab, Any]) -> None:
    spec = ModelSpec(**{**SMALL.__dict__, "arch": "qwen2", "qkv_bias": True})
    written = write_gguf(workdir / "tiny-qwen2.gguf", spec, "Q8_0", bpe[0], seed=21)
    manifest = import_path(lib, written.path, name="tiny-qwen2")
    folder = Path(manifest["path"])
    config, weights = load_imported(folder)
    assert manifest["architecture"] == config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    for i in range(spec.layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.bias"
            np.testing.assert_array_equal(dense(config, weights, name), written.expected[name])
    # Qwen2 rows are not permuted in GGUF: the importer must leave them alone.
    for proj in ("q_proj", "k_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        np.testing.assert_allclose(dense(config, weights, name), written.expected[name],
                                   rtol=1e-6, atol=1e-7)
        source = written.source[name]
        assert source is not None
        assert np.abs(dense(config, weights, name) - source).max() < 0.02 * np.abs(source).max()
    check_generation(generate_n(folder, 4), 4, len(bpe[0].tokens))


# -- 3. bad input ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_home(workdir: Path, bpe: tuple[Vocab, Any]) -> Path:
    """A STRATA_HOME that already holds one model, so 'unchanged' has something to keep."""
    home = workdir / "cli-home"
    good = write_gguf(workdir / "cli-good.gguf", SMALL, "Q4_0", bpe[0], seed=31)
    import_path(Library(home), good.path, name="already-here")
    return home


@pytest.fixture(scope="module")
def bad_inputs(workdir: Path, bpe: tuple[Vocab, Any]) -> dict[str, tuple[Path, str]]:
    """case -> (path to import, words the error line must contain)."""
    bad = workdir / "bad"
    bad.mkdir()
    cases: dict[str, tuple[Path, str]] = {}

    text = bad / "notes.gguf"
    text.write_text("these are not the weights you are looking for\n" * 20)
    cases["not-gguf"] = (text, "not a model file")

    whole = write_gguf(bad / "whole.gguf", SMALL, "Q8_0", bpe[0], seed=41).path
    data = whole.read_bytes()
    cut = bad / "truncated.gguf"
    cut.write_bytes(data[: len(data) // 2])
    whole.unlink()
    cases["truncated"] = (cut, "truncated")

    arch = write_gguf(bad / "falcon.gguf", SMALL, "F16", bpe[0], arch_name="falcon").path
    cases["architecture"] = (arch, "unsupported architecture 'falcon'")

    # Types gguf cannot dequantize: Q8_K (llama.cpp's intermediate type), Q8_1.
    qtype = write_gguf(bad / "q8k.gguf", ModelSpec(**{**SMALL.__dict__, "hidden": 256}), "F16",
                       bpe[0], overrides={"blk.1.ffn_up.weight": "Q8_K"}).path
    cases["tensor-type"] = (qtype, "unsupported tensor type Q8_K in blk.1.ffn_up.weight")

    q81 = write_gguf(bad / "q81.gguf", SMALL, "F16", bpe[0],
                     overrides={"blk.0.attn_v.weight": "Q8_1"}).path
    cases["tensor-type-q8_1"] = (q81, "unsupported tensor type Q8_1")

    no_weights = bad / "hf-no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (no_weights / "tokenizer_config.json").write_text("{}")
    cases["folder-no-weights"] = (no_weights, "no weights")

    empty = bad / "empty-folder"
    empty.mkdir()
    cases["empty-folder"] = (empty, "not a model folder")

    cases["missing"] = (bad / "does-not-exist.gguf", "no such file")
    return cases


BAD_CASES = ["not-gguf", "truncated", "architecture", "tensor-type", "tensor-type-q8_1",
             "folder-no-weights", "empty-folder", "missing"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_fails_cleanly_through_cli(cli_home: Path,
                                             bad_inputs: dict[str, tuple[Path, str]],
                                             case: str) -> None:
    path, reason = bad_inputs[case]
    before = snapshot(cli_home)
    proc = run_strata("import", str(path), home=cli_home, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("strata: error: "), lines[0]
    assert str(path) in lines[0], lines[0]
    assert reason in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert snapshot(cli_home) == before
    assert leftovers(cli_home) == []


def test_truncated_anywhere_is_import_failed(workdir: Path, lib: Library,
                                            bpe: tuple[Vocab, Any]) -> None:
    """Cut in the magic, the metadata, the tensor infos or the data: always ImportFailed."""
    data = write_gguf(workdir / "sweep.gguf", SMALL, "Q8_0", bpe[0], seed=61).path.read_bytes()
    cut = workdir / "sweep-cut.gguf"
    before = snapshot(lib.home)
    for n in sorted({*range(0, 40, 3), *np.linspace(40, len(data) - 1, 60).astype(int)}):
        cut.write_bytes(data[:n])
        with pytest.raises(ImportFailed) as info:
            import_path(lib, cut)
        assert str(cut) in str(info.value) and "\n" not in str(info.value), n
    assert snapshot(lib.home) == before
    assert leftovers(lib.home) == []


def test_random_q2k_blocks_are_well_formed() -> None:
    """The unsupported-type case must fail on the type, not on malformed bytes."""
    import gguf

    raw = random_blocks(4, 256, gguf.GGMLQuantizationType.Q2_K, np.random.default_rng(0))
    assert raw.shape == (4, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K][1])
    assert np.isfinite(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q2_K)).all()


def test_cancelled_import_leaves_library_unchanged(workdir: Path, bpe: tuple[Vocab, Any]
                                                   ) -> None:
    home = workdir / "cancel-home"
    library = Library(home)
    good = write_gguf(workdir / "cancel.gguf", SMALL, "Q4_1", bpe[0], seed=51)
    import_path(library, good.path, name="keep-me")
    before = snapshot(home)
    calls: list[int] = []
    seen: list[tuple[int, int]] = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) > 5

    with pytest.raises(Cancelled):
        import_path(library, good.path, name="cancelled", cancel=cancel,
                    progress=lambda done, total: seen.append((done, total)))
    assert len(seen) == 5 and seen[-1][0] < seen[-1][1]  # stopped part-way, not before or after
    assert snapshot(home) == before
    assert leftovers(home) == []
    assert [m["name"] for m in library.manifests()] == ["keep-me"]


def test_in_process_errors_are_import_failed(workdir: Path, lib: Library,
                                             bad_inputs: dict[str, tuple[Path, str]]) -> None:
    """The same cases raise ImportFailed in-process (what the app's worker catches)."""
    before = snapshot(lib.home)
    for case in BAD_CASES:
        path, reason = bad_inputs[case]
        with pytest.raises(ImportFailed) as info:
            import_path(lib, path)
        assert reason in str(info.value), case
    assert snapshot(lib.home) == before
    assert leftovers(lib.home) == []
