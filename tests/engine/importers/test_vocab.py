"""GGUF vocabularies tokenize as llama.cpp tokenizes them, family by family.

Contract checked: for llama.cpp's own vocab-only GGUF files (models/ggml-vocab-*.gguf, which the
README's install step puts in ~/.cache/strata/llama.cpp/models) and for vocabularies derived
from them here with another `tokenizer.ggml.pre` or kind (o200k/gpt-oss, tekken, deepseek-v3,
Gemma 3's SentencePiece layout), `write_tokenizer` then the engine's `Tokenizer` give the ids
llama.cpp's tokenize gives (parse_special=True, with and without BOS) on a multilingual text with
code, emoji and special tokens, and the ids in llama.cpp's .inp/.out test cases; text round-trips
through decode and the streaming detokenizer; the ids that end generation equal llama.cpp's EOG
set; the families' chat templates render in the engine's sandbox; a 262,144-entry vocabulary
writes in a couple of seconds; bad vocabularies are one-line ImportFailed errors.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest

from engine.errors import ImportFailed
from engine.importers.gguf_file import read_gguf
from engine.importers.vocab import write_tokenizer
from engine.platform import default_cache
from engine.runtime.tokenizer import StreamingDetokenizer, Tokenizer
from tests.engine.llamacpp_reference import Reference, llama_cpp, reference

MODELS = Path.home() / ".cache" / "strata" / "llama.cpp" / "models"
TEMPLATES = MODELS / "templates"

TEXT = """\
Hello world! It's a test: we'll see, they've done it, I'm sure. DON'T SHOUT.
Caf\u00e9, na\u00efve, \u00e9l\u00e8ve, No\u00ebl, gar\u00e7on \u2014 \u00ab \u00c7a va ? \u00bb \
O\u00f9 est l'h\u00f4tel ?
Stra\u00dfe, Gr\u00f6\u00dfe, \u00dcberm\u00e4\u00dfig, \u00c4pfel und \u00d6l; SCHLOSSSTRASSE.
\u4e2d\u6587\u6d4b\u8bd5\uff1a\u6211\u4eec\u4eca\u5929\u53bb\u5317\u4eac\u3002\u4f60\u597d\uff0c\
\u4e16\u754c\uff01
\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\
\u304c\u306a\u3002\u6771\u4eac\u30bf\u30ef\u30fc
\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0647\u0630\u0627 \
\u0627\u062e\u062a\u0628\u0627\u0631.
\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e, \u092f\u0939 \
\u090f\u0915 \u092a\u0930\u0940\u0915\u094d\u0937\u0923 \u0939\u0948\u0964
\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u00c9COLE \u0395\u03bb\u03bb\u03b7\u03bd\
\u03b9\u03ba\u03ac
def fib(n: int) -> int:
    if n < 2:
        return n
\treturn fib(n - 1) + fib(n - 2)  # tab-indented


    x = [1, 2, 3]   ;;  {"key": "value"}
Emoji: \U0001f600 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 \
\U0001f3f3\ufe0f\u200d\U0001f308 \u2764\ufe0f \U0001f999.cpp
Digits: 1 12 123 1234 12345 123456789 3.14159 1,000,000 \u00bd \u00b2
Specials inline: <|im_start|>user
hi<|im_end|> and <|endoftext|> and <s> </s> <|eot_id|><end_of_turn> <start_of_turn>model
<|start_header_id|>assistant<|end_header_id|> [INST] <|user|> <|end|> <|return|><|call|>
   trailing spaces   \
"""
LINES = TEXT.split("\n")

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke \U0001f642"}]


# -- vocabularies ---------------------------------------------------------------------------
def models_dir() -> Path:
    if not (MODELS / "ggml-vocab-gpt-2.gguf").is_file():
        pytest.skip(f"llama.cpp's vocab files are not in {MODELS} (the README's install step "
                    "puts them there)")
    return MODELS


def write_vocab_gguf(path: Path, meta: dict[str, Any], changes: dict[str, Any]) -> Path:
    """A vocab-only GGUF: `meta` (a file's metadata) with `changes` (None removes a key)."""
    meta = {k: v for k, v in {**meta, **changes}.items() if v is not None}
    w = gguf.GGUFWriter(str(path), meta["general.architecture"])
    for key, value in meta.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif key == "tokenizer.ggml.token_type":
            w.add_array(key, [int(x) for x in value])  # llama.cpp wants INT32
        elif key == "tokenizer.ggml.scores":
            w.add_array(key, [float(x) for x in value])
        else:
            w.add_array(key, list(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level(text: str) -> str:
    """`text` as a byte-level BPE token (GPT-2's byte-to-character table)."""
    from tokenizers import pre_tokenizers

    split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return "".join(piece for piece, _ in split.pre_tokenize_str(text))


def with_tokens(meta: dict[str, Any], added: list[tuple[str, int]]) -> dict[str, Any]:
    """Token list and types with `added` (text, type) appended."""
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    known = set(tokens)
    for text, ty in added:
        if text not in known:
            tokens.append(text)
            types.append(ty)
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}


# Words that llama.cpp splits where the upstream o200k/tekken regex does not (an all-caps
# non-ASCII word; Devanagari's combining marks): as whole tokens, they show whose split is used.
DEVIATING_WORDS = ["\u00c9COLE", " \u00c9COLE", "\u0928\u092e\u0938\u094d\u0924\u0947"]
HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
           "<|constrain|>"]


def derived(name: str, workdir: Path) -> Path:
    """Vocabularies llama.cpp has no test file for, from its files with another pre or kind."""
    models = models_dir()
    if name == "gemma3":  # Gemma 3: a 262,144-piece SentencePiece BPE, no space prefix
        meta = read_gguf(models / "ggml-vocab-gemma-4.gguf").meta
        changes: dict[str, Any] = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.merges": None,
                                   "tokenizer.ggml.pre": None, "general.architecture": "gemma3",
                                   "tokenizer.ggml.add_space_prefix": False}
    else:
        meta = read_gguf(models / "ggml-vocab-qwen2.gguf").meta
        pre = {"gpt-oss": "gpt-4o", "tekken": "tekken", "deepseek-v3": "deepseek-v3"}[name]
        changes = {"tokenizer.ggml.pre": pre, "tokenizer.chat_template": None}
        if name == "gpt-oss":
            changes.update(with_tokens(meta, [(t, 3) for t in HARMONY]))
        if name == "tekken":  # tekken ignores merges: a whole-word token is taken as it is
            changes.update(with_tokens(meta, [(byte_level(w), 1) for w in DEVIATING_WORDS]))
    return write_vocab_gguf(workdir / f"derived-{name}.gguf", meta, changes)


# family -> llama.cpp's vocab file (a name under MODELS) or a derived one (derived:<name>)
FAMILIES = {
    "llama3": "llama-bpe", "qwen2": "qwen2", "qwen35": "qwen35", "gpt-2": "gpt-2",
    "smollm": "starter", "deepseek-llm": "deepseek-llm", "deepseek-coder": "deepseek-coder",
    "command-r": "command-r", "falcon": "falcon", "mpt": "mpt", "starcoder": "starcoder",
    "refact": "refact", "llama-spm": "llama-spm", "phi-3": "phi-3", "gemma-4": "gemma-4",
    "gpt-oss": "derived:gpt-oss", "tekken": "derived:tekken",
    "deepseek-v3": "derived:deepseek-v3", "gemma3": "derived:gemma3",
}


@dataclass
class Family:
    name: str
    path: Path
    meta: dict[str, Any]
    folder: Path
    tok: Tokenizer
    ref: Reference

    @property
    def case_file(self) -> Path | None:
        inp = self.path.with_name(self.path.name + ".inp")
        return inp if inp.is_file() else None


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Family]:
    llama_cpp()
    name, source = request.param, FAMILIES[request.param]
    work = tmp_path_factory.mktemp(f"vocab-{name}")
    if source == "starter":  # the engine's starter model: a real SmolLM2 (smollm) vocabulary
        path = default_cache() / "starter" / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            pytest.skip(f"the starter GGUF is not in {path.parent} yet")
    elif source.startswith("derived:"):
        path = derived(source.removeprefix("derived:"), work)
    else:
        path = models_dir() / f"ggml-vocab-{source}.gguf"
    meta = read_gguf(path).meta
    folder = work / "model"
    folder.mkdir()
    write_tokenizer(meta, folder)
    ref = reference(path, vocab_only=True)
    yield Family(name, path, meta, folder, Tokenizer.load(folder), ref)
    ref.close()


# -- ids ------------------------------------------------------------------------------------
def test_ids_equal_llamacpp(family: Family) -> None:
    tok, ref = family.tok, family.ref
    wrong = [line for line in [TEXT, *LINES]
             if tok.encode(line, add_bos=False) != ref.tokenize(line)]
    assert not wrong, f"{family.name}: {len(wrong)} texts differ, first {wrong[0]!r}"
    # BOS (and EOS) as llama.cpp adds them for this vocabulary
    assert tok.encode(TEXT) == ref.tokenize(TEXT, add_bos=True)


def read_cases(inp: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer test cases: texts split by __ggml_vocab_test__, ids per line."""
    texts = inp.read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    outs = inp.with_suffix(".out").read_text(encoding="utf-8").split("\n")
    assert len(outs) >= len(texts), inp
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs, strict=False)]


def test_llamacpp_test_cases(family: Family) -> None:
    if family.case_file is None:
        pytest.skip(f"llama.cpp has no test cases for {family.path.name}")
    cases = read_cases(family.case_file)
    wrong = [(t, ids) for t, ids in cases if family.tok.encode(t, add_bos=False) != ids]
    assert not wrong, f"{family.name}: {len(wrong)}/{len(cases)} cases differ, first {wrong[0]}"


def test_decode_round_trips(family: Family) -> None:
    tok = family.tok
    for line in [TEXT, *LINES]:
        if family.name == "phi-3" and any(f"{s} " in line or f"{s}\n" in line
                                          for s in tok.specials):
            continue  # Phi-3 eats the whitespace after its special tokens, as llama.cpp does
        assert tok.decode(tok.encode(line, add_bos=False)) == line, line
    if family.name in ("llama3", "gemma3", "gemma-4", "deepseek-llm", "llama-spm"):
        detok = StreamingDetokenizer(tok)
        ids = tok.encode(TEXT, add_bos=False)
        assert "".join(detok.add(i) for i in ids) + detok.flush() == tok.decode(ids)


def test_end_of_generation_ids_equal_llamacpp(family: Family) -> None:
    lc = llama_cpp()
    vocab = family.ref.llm._model.vocab
    eog = {i for i in range(lc.llama_vocab_n_tokens(vocab)) if lc.llama_vocab_is_eog(vocab, i)}
    assert family.tok.eos_ids() == eog
    written = json.loads((family.folder / "generation_config.json").read_text())
    assert set(written["eos_token_id"]) == eog
    if family.name == "gpt-oss":  # harmony: <|end|> closes a message, not the reply
        tokens = family.tok.specials
        assert tokens["<|end|>"] not in eog
        assert {tokens["<|return|>"], tokens["<|call|>"]} <= eog


def test_chat_prompt_ids_equal_llamacpp(family: Family) -> None:
    if not family.tok.template_source:
        pytest.skip(f"{family.path.name} has no chat template")
    names = family.meta.get("tokenizer.chat_templates")
    if names:  # command-r: the default template and the named ones, as Hugging Face lists them
        config = json.loads((family.folder / "tokenizer_config.json").read_text())
        assert [t["name"] for t in config["chat_template"]] == ["default", *names]
    text = family.tok.render_chat(CHAT)
    assert all(m["content"] in text for m in CHAT if m["role"] != "system")  # Phi-3 drops it
    assert family.tok.encode_chat(CHAT) == family.ref.tokenize(text)


def test_large_vocabulary_writes_fast(family: Family, tmp_path: Path) -> None:
    if len(family.meta["tokenizer.ggml.tokens"]) < 200_000:
        pytest.skip("a small vocabulary")
    # A CPU-time limit alone failed under load (3.1 s against 0.7-0.9 s idle), so the write is
    # compared with a linear peer: dumping the same vocabulary and merges as JSON. Both took
    # 2.0-2.2 s at load 3 (ratio 0.8-1.0); a quadratic step would be 100x. The fixture's
    # write, timed minutes before the peer, once read 1.72 s against 0.29 (the load moved in
    # between), so both are timed here, in turn, and the least of each compared. Each is this
    # thread's CPU time with the collector off: the process's time counted other threads of
    # the test run (a fresh-clone CI run read 1.31 s against 0.25, ratio 5.3, where a lone
    # process reads 1.8-2.5).
    tokens = list(family.meta["tokenizer.ggml.tokens"])
    merges = [m.split(" ") for m in family.meta.get("tokenizer.ggml.merges", [])]

    def peer() -> float:
        start = time.thread_time()
        dump = json.dumps({"vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges},
                          ensure_ascii=False)
        (tmp_path / "peer.json").write_text(dump)
        return time.thread_time() - start

    def write(i: int) -> float:
        (tmp_path / str(i)).mkdir()
        start = time.thread_time()
        write_tokenizer(family.meta, tmp_path / str(i))
        return time.thread_time() - start

    gc.collect()
    gc.disable()
    try:
        times = [(peer(), write(i)) for i in range(3)]
    finally:
        gc.enable()
    peer_s, write_s = (min(t[j] for t in times) for j in (0, 1))
    assert write_s < 8 * peer_s, (
        f"{family.name}: {write_s:.2f} s of CPU to write, {peer_s:.2f} s to dump as JSON")


# -- templates ------------------------------------------------------------------------------
FAMILY_TEMPLATES = [
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
    "meta-llama-Llama-3.3-70B-Instruct", "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B",
    "Qwen-QwQ-32B", "Qwen3.5-4B", "Qwen3-Coder", "google-gemma-2-2b-it",
    "google-gemma-4-31B-it", "openai-gpt-oss-120b", "mistralai-Mistral-Nemo-Instruct-2407",
    "Mistral-Small-3.2-24B-Instruct-2506", "unsloth-mistral-Devstral-Small-2507",
    "mistralai-Ministral-3-14B-Reasoning-2512", "microsoft-Phi-3.5-mini-instruct",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "deepseek-ai-DeepSeek-V3.1", "HuggingFaceTB-SmolLM3-3B", "ibm-granite-granite-3.3-2B-Instruct",
    "LFM2-8B-A1B",  # (not a Strata family: its template uses {% generation %})
]


@pytest.fixture(scope="module")
def template_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with a tiny tokenizer, whose tokenizer_config.json each test rewrites."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    folder = tmp_path_factory.mktemp("templates")
    HFTokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_family_chat_templates_render(template_folder: Path, name: str) -> None:
    path = TEMPLATES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path} is not there (the README's install step puts it there)")
    config = {"chat_template": path.read_text(), "bos_token": "<s>", "eos_token": "</s>"}
    (template_folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(template_folder)
    messages = CHAT
    text = tok.render_chat(messages)
    positions = [text.find(m["content"]) for m in messages if m["role"] != "system"]
    assert -1 not in positions and positions == sorted(positions), text
    # Every template carries the system text somewhere (Mistral's in the last user turn); one
    # without a system role (Gemma 2's) gets it folded into the first user turn.
    system = next(m["content"] for m in messages if m["role"] == "system")
    assert system in text, text
    if name == "google-gemma-2-2b-it":
        assert text.find(system) < positions[0], text
    # (Mistral's templates have no generation prompt: theirs ends with the last [/INST].)
    assert len(text) >= len(tok.render_chat(messages, add_generation_prompt=False))


# -- bad input ------------------------------------------------------------------------------
def tiny_meta(**changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<|im_end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3], "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.eos_token_id": 3,
    }
    return {**meta, **changes}


def test_tiny_vocabulary_writes_and_encodes(tmp_path: Path) -> None:
    assert write_tokenizer(tiny_meta(), tmp_path) == {"tokenizer": "bpe", "vocab_size": 4}
    tok = Tokenizer.load(tmp_path)
    assert tok.encode("abab<|im_end|>") == [2, 2, 3]
    assert tok.eos_ids() == {3}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>" and not config["add_bos_token"]
    assert config["added_tokens_decoder"]["3"]["special"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"tokenizer.ggml.pre": "klingon"}, "unsupported BPE pre-tokenizer 'klingon'"),
    ({"tokenizer.ggml.model": "bert"}, "unsupported tokenizer kind 'bert'"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a", "x"]}, "the token 'a' twice"),
    ({"tokenizer.ggml.merges": ["ab"]}, "malformed BPE merge 'ab'"),
    ({"tokenizer.ggml.merges": None}, "without tokenizer.ggml.merges"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type has 2 entries for 4 tokens"),
    ({"tokenizer.ggml.tokens": []}, "no vocabulary"),
])
def test_bad_vocabularies_fail_in_one_line(tmp_path: Path, changes: dict[str, Any],
                                           message: str) -> None:
    meta = {k: v for k, v in tiny_meta(**changes).items() if v is not None}
    source = tmp_path / "bad.gguf"
    with pytest.raises(ImportFailed, match=message) as err:
        write_tokenizer(meta, tmp_path, source=source)
    assert str(err.value).startswith(f"{source}: ") and "\n" not in str(err.value)
