"""GGUF tokenizer metadata to tokenizer files that tokenize as llama.cpp does.

Contract: `write_tokenizer(meta, dest)` writes into `dest`, from a GGUF's `tokenizer.*` metadata:

- tokenizer.json (the `tokenizers` library's JSON, written directly) for BPE vocabularies:
  `gpt2` (byte-level BPE, split first by the regexes of the `tokenizer.ggml.pre` named in
  PRE_TOKENIZERS) and `gemma4` (BPE over raw UTF-8 with spaces as U+2581 and <0xXX> byte
  fallback); or tokenizer.model (a SentencePiece BPE model proto) for `llama` vocabularies
  (Llama 2, Mistral, Phi-3, Gemma 2/3), whose scores rank the merges as llama.cpp ranks them;
- tokenizer_config.json: BOS/EOS/UNK/PAD texts, add_bos_token/add_eos_token as llama.cpp decides
  them, `added_tokens_decoder` (the tokens llama.cpp cuts out of text before tokenizing: types
  CONTROL, USER_DEFINED and UNKNOWN plus the end-of-turn names it forces to CONTROL; `special`
  is false for the user-defined ones, which decode as text), the chat template (a list of named
  templates when the GGUF has `tokenizer.chat_templates`);
- generation_config.json: `eos_token_id`, every id llama.cpp ends generation on (`eog_ids`).

Encoding the written files with engine.runtime.tokenizer gives llama.cpp's
`tokenize(text, add_special, parse_special=True)` ids. An unknown vocabulary kind or
pre-tokenizer, duplicate tokens or a malformed list is one-line ImportFailed naming it (and the
file, given `source`). Returns the manifest's tokenizer facts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ImportFailed
from engine.runtime.tokenizer import END_MARKERS

# GGUF token types (llama.cpp's llama_token_type); they equal SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# -- pre-tokenizers -------------------------------------------------------------------------
# Each vocabulary's split regexes, applied in order, every match and every stretch between
# matches becoming a piece (llama.cpp's unicode_regex_split; `tokenizers`' Split "Isolated").
# The contraction groups are spelled per letter as llama.cpp does ((?i:) would also fold
# non-ASCII letters).
_CONTRACTIONS = "'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD]"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_GPT2_NO_TAIL = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (f"(?:{_CONTRACTIONS})" + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (f"(?:{_CONTRACTIONS})" + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (f"(?:{_CONTRACTIONS})" + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# o200k (gpt-4o, gpt-oss) and tekken split words at case changes. llama.cpp matches its
# "upper" class as any letter but a-z and its "lower" class as any letter but A-Z (its regex
# engine sees one placeholder for every non-ASCII letter, and no combining marks); these say
# the same with Oniguruma's class intersection, so that ids equal llama.cpp's.
_UPPER = r"[\p{L}&&[^a-z]]"
_LOWER = r"[\p{L}&&[^A-Z]]"


def _cased_words(suffix: str) -> str:
    lead = r"[^\r\n\p{L}\p{N}]?"
    return f"{lead}{_UPPER}*{_LOWER}+{suffix}|{lead}{_UPPER}+{_LOWER}*{suffix}"


_GPT4O = (_cased_words(f"(?:{_CONTRACTIONS})?")
          + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (_cased_words("")
           + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek's own splits (tokenizer.json of deepseek-llm / -coder / -v3).
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00"
    "-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149"
    "\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13"
    "-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
_DEEPSEEK_LLM = ("[\r\n]", rf"\s?[{_DEEPSEEK_LETTERS}]+", _DEEPSEEK_PUNCT, r"\s+$", _CJK,
                 r"\p{N}+")
_DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")
_DEEPSEEK_V3 = (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
                r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"
                r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_FALCON = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_NO_TAIL, "[0-9][0-9][0-9]")
_STARCODER = (r"\p{N}", _GPT2_NO_TAIL)
_NEWLINES = (r"[^\n]+|[\n]+",)


@dataclass(frozen=True)
class PreTokenizer:
    """How llama.cpp pre-tokenizes one `tokenizer.ggml.pre` (llama-vocab.cpp, per pre type)."""

    splits: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not merged up
    add_bos: bool = False  # llama.cpp's default when the GGUF does not say
    byte_level: bool = True  # GPT-2's bytes-as-characters; else raw UTF-8, spaces as U+2581


def _pre(splits: tuple[str, ...] | str, names: str, **kw: bool) -> dict[str, PreTokenizer]:
    entry = PreTokenizer(splits if isinstance(splits, tuple) else (splits,), **kw)
    return dict.fromkeys(names.split(), entry)


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_pre(_LLAMA3, "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
           ignore_merges=True, add_bos=True),
    **_pre(_LLAMA3, "dbrx smaug-bpe"),
    **_pre(_QWEN2, "qwen2 deepseek-r1-qwen stablelm2 megrez"),
    **_pre(_QWEN35, "qwen35"),
    **_pre(_GPT4O, "gpt-4o llama4 minimax-m2"),
    **_pre(_TEKKEN, "tekken", ignore_merges=True, add_bos=True),
    **_pre(_STARCODER, "smollm starcoder refact command-r codeshell exaone minerva-7b"),
    **_pre(_GPT2_NO_TAIL, "gpt-2 phi-2 mpt olmo jais exaone4 a.x-4.0 mellum gigachat trillion "
                          "granite-docling"),
    **_pre(_DEEPSEEK_LLM, "deepseek-llm"),
    **_pre(_DEEPSEEK_CODER, "deepseek-coder"),
    **_pre(_DEEPSEEK_V3, "deepseek-v3"),
    **_pre(_FALCON, "falcon"),
    # "default" (no pre-tokenizer recorded): GPT-2's own split, as Hugging Face's ByteLevel
    # does. (llama.cpp adds punctuation and three-digit splits here; such files are rare old
    # conversions that its converter no longer writes.)
    **_pre(_GPT2, "default"),
    **_pre(_NEWLINES, "gemma4 granite-embed-multi-311m", add_bos=True, byte_level=False),
}

# -- special tokens -------------------------------------------------------------------------
# Token texts llama.cpp ends generation on (llama_vocab::impl::load, special_eog_ids); the
# runtime stops on the same names.
EOG_NAMES = frozenset(END_MARKERS)
# Fill-in-the-middle names it recognises; pad, repo and file-separator also end generation.
_FIM_PRE = {"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<\uff5cfim\u2581begin\uff5c>",
            "<PRE>", "\u2581<PRE>", "<|code_prefix|>", "<|prefix|>"}
_FIM_SUF = {"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<\uff5cfim\u2581hole\uff5c>",
            "<SUF>", "\u2581<SUF>", "<|code_suffix|>", "<|suffix|>"}
_FIM_MID = {"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<\uff5cfim\u2581end\uff5c>",
            "<MID>", "\u2581<MID>", "<|code_middle|>", "<|middle|>"}
_FIM_PAD = ("tokenizer.ggml.fim_pad_token_id",
            {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"})
_FIM_REP = ("tokenizer.ggml.fim_rep_token_id",
            {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"})
_FIM_SEP = ("tokenizer.ggml.fim_sep_token_id", {"<|file_sep|>"})
# Names llama.cpp makes CONTROL whatever their type says (end of turn, FIM, end of generation).
_FORCED_CONTROL = (EOG_NAMES | _FIM_PRE | _FIM_SUF | _FIM_MID | _FIM_PAD[1] | _FIM_REP[1]
                   | _FIM_SEP[1])
# gpt-oss (harmony): rendered always, as llama.cpp does.
_HARMONY_TEXT = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


@dataclass
class Vocabulary:
    """A GGUF vocabulary as llama.cpp reads it."""

    kind: str  # tokenizer.ggml.model
    tokens: list[str]
    types: list[int]
    ids: dict[str, int]
    meta: dict[str, Any]

    def token_id(self, key: str, default: int | None = None) -> int | None:
        """The id a `tokenizer.ggml.*_token_id` key names, llama.cpp's default when absent."""
        value = self.meta.get(key)
        if value is None:
            return default if default is not None and 0 <= default < len(self.tokens) else None
        idx = int(value)
        return idx if 0 <= idx < len(self.tokens) else default

    def flag(self, key: str, default: bool) -> bool:
        value = self.meta.get(key)
        return default if value is None else bool(value)


def _vocabulary(meta: dict[str, Any]) -> Vocabulary:
    kind = str(meta.get("tokenizer.ggml.model", ""))
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ImportFailed("no vocabulary (tokenizer.ggml.tokens) in the GGUF metadata")
    # llama.cpp names an empty token so that every id has text.
    tokens = [str(t) if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    ids = {t: i for i, t in enumerate(tokens)}
    if len(ids) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if ids[t] != i)
        raise ImportFailed(f"vocabulary has the token {dup!r} twice (tokenizer.ggml.tokens)")
    types = meta.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types else [NORMAL] * len(tokens)
    if len(types) < len(tokens):
        raise ImportFailed(f"tokenizer.ggml.token_type has {len(types)} entries for "
                           f"{len(tokens)} tokens")
    return Vocabulary(kind, tokens, types[: len(tokens)], ids, meta)


@dataclass
class Special:
    """One token llama.cpp cuts out of text before tokenizing (its special-token cache)."""

    id: int
    content: str
    special: bool  # CONTROL/UNKNOWN: a special token; USER_DEFINED: text-like
    rstrip: bool = False


def eog_ids(v: Vocabulary) -> set[int]:
    """Every id llama.cpp ends generation on: EOS, EOT, EOM, FIM pad/repo/separator, and the
    end-of-turn names; without `<|end|>` for harmony (gpt-oss) and `</s>` for Gemma 4."""
    ids: set[int] = set()
    spm = v.kind == "llama"
    for key, default in (("tokenizer.ggml.eos_token_id", 2 if spm else None),
                         ("tokenizer.ggml.eot_token_id", None),
                         ("tokenizer.ggml.eom_token_id", None)):
        idx = v.token_id(key, default)
        if idx is not None:
            ids.add(idx)
    for key, names in (_FIM_PAD, _FIM_REP, _FIM_SEP):
        idx = v.token_id(key)
        if idx is None:  # llama.cpp takes the first name it meets; we, the lowest id
            found = sorted(v.ids[n] for n in names if n in v.ids)
            idx = found[0] if found else None
        if idx is not None:
            ids.add(idx)
    ids.update(v.ids[n] for n in EOG_NAMES if n in v.ids)
    texts = {v.tokens[i] for i in ids}
    has_call = "<|call|>" in texts or "<|calls|>" in texts
    if "<|end|>" in texts and has_call and ("<|return|>" in texts or "<|flush|>" in texts):
        ids.discard(v.ids["<|end|>"])  # harmony: <|end|> closes a message, not the reply
    if "</s>" in texts and "<|tool_response>" in texts:
        ids.discard(v.ids["</s>"])  # Gemma 4: a normal token there
    return ids


def special_tokens(v: Vocabulary) -> list[Special]:
    """llama.cpp's special-token cache for this vocabulary, with its rstrip rules."""
    eog = eog_ids(v)
    gemma4_s = v.ids.get("</s>") if "<|tool_response>" in v.ids else None
    harmony_end = (v.ids.get("<|end|>") if "<|end|>" in v.ids and v.ids["<|end|>"] not in eog
                   else None)
    out: list[Special] = []
    for i, (text, ty) in enumerate(zip(v.tokens, v.types, strict=True)):
        if i == gemma4_s:
            continue
        if text in _HARMONY_TEXT or i == harmony_end:
            out.append(Special(i, text, special=False))
        elif ty in (CONTROL, UNKNOWN) or text in _FORCED_CONTROL:
            out.append(Special(i, text, special=True))
        elif ty == USER_DEFINED:
            out.append(Special(i, text, special=False))
    name = str(v.meta.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        # llama.cpp's Phi-3 rule: whitespace after a special token is eaten, except after these.
        for s in out:
            s.rstrip = s.content not in ("<unk>", "<s>", "<|endoftext|>")
    return out


def _added_token(s: Special) -> dict[str, Any]:
    return {"id": s.id, "content": s.content, "single_word": False, "lstrip": False,
            "rstrip": s.rstrip, "normalized": False, "special": s.special}


# -- BPE (tokenizer.json) -------------------------------------------------------------------
def _merges(v: Vocabulary) -> list[str] | list[list[str]]:
    """tokenizer.ggml.merges for tokenizer.json, split as llama.cpp splits them (at the first
    space after the first character); merges whose parts or result are not tokens can never
    apply and are dropped. Kept as "left right" strings where that is unambiguous: `tokenizers`
    reads those about twice as fast as pairs."""
    raw = v.meta.get("tokenizer.ggml.merges")
    if raw is None:
        raise ImportFailed("BPE vocabulary without tokenizer.ggml.merges")
    ids = v.ids
    simple = all(m.count(" ") == 1 and not m.startswith(" ") for m in raw)
    strings: list[str] = []
    pairs: list[list[str]] = []
    for m in raw:
        pos = m.find(" ", 1)
        if pos < 0:
            raise ImportFailed(f"malformed BPE merge {m!r} in tokenizer.ggml.merges")
        left, right = m[:pos], m[pos + 1 :]
        if left in ids and right in ids and left + right in ids:
            if simple:
                strings.append(m)
            else:
                pairs.append([left, right])
    return strings if simple else pairs


def _split(regex: str) -> dict[str, Any]:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated",
            "invert": False}


def _bpe_json(v: Vocabulary, pre: PreTokenizer, specials: list[Special]) -> dict[str, Any]:
    byte_level = pre.byte_level
    splits: list[dict[str, Any]] = [_split(r) for r in pre.splits]
    if byte_level:
        splits.append({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                       "use_regex": False})
        normalizer = None
        decoder: dict[str, Any] = {"type": "ByteLevel", "add_prefix_space": False,
                                   "trim_offsets": False, "use_regex": False}
    else:  # Gemma 4: spaces become U+2581 before the split; bytes fall back to <0xXX>
        normalizer = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
        decoder = {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [_added_token(s) for s in specials],
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": splits},
        "post_processor": None,
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": not byte_level,
                  "ignore_merges": pre.ignore_merges, "vocab": v.ids, "merges": _merges(v)},
    }


# -- SentencePiece (tokenizer.model) --------------------------------------------------------
def _spm_model_proto(v: Vocabulary) -> bytes:
    # heavy (protobuf): only for a GGUF with a SentencePiece vocabulary
    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf module: no static attributes
    n = len(v.tokens)
    scores = v.meta.get("tokenizer.ggml.scores") or [0.0] * n
    if len(scores) < n:
        raise ImportFailed(f"tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    unk = v.token_id("tokenizer.ggml.unknown_token_id", 0)
    if unk is None:
        unk = next((i for i, t in enumerate(v.types) if t == UNKNOWN), 0)
    proto = pb.ModelProto()
    # llama.cpp ranks merges by the merged piece's score, as SentencePiece's BPE does.
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = n
    proto.trainer_spec.byte_fallback = BYTE in v.types
    proto.trainer_spec.unk_id = unk
    # BOS/EOS are the runtime's business (tokenizer_config.json), not SentencePiece's.
    proto.trainer_spec.bos_id = proto.trainer_spec.eos_id = proto.trainer_spec.pad_id = -1
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = v.flag("tokenizer.ggml.add_space_prefix", True)
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    # Piece types as llama.cpp uses them: it merges into USER_DEFINED and UNUSED pieces like
    # normal ones (user-defined text is cut out before, by the runtime), keeps one <unk>,
    # and treats other UNKNOWN-typed pieces as control tokens.
    kinds = {CONTROL: CONTROL, UNKNOWN: CONTROL, BYTE: BYTE}
    pieces = proto.pieces
    for i, (text, score, ty) in enumerate(zip(v.tokens, scores, v.types, strict=False)):
        kind = UNKNOWN if i == unk else kinds.get(ty, NORMAL)
        if kind == BYTE and not (len(text) == 6 and text.startswith("<0x")):
            kind = NORMAL
        pieces.add(piece=text, score=float(score), type=kind)
    return bytes(proto.SerializeToString())


# -- writing --------------------------------------------------------------------------------
def _chat_templates(meta: dict[str, Any]) -> str | list[dict[str, str]] | None:
    default = meta.get("tokenizer.chat_template")
    names = meta.get("tokenizer.chat_templates") or []
    named = [{"name": str(n), "template": str(meta[f"tokenizer.chat_template.{n}"])}
             for n in names if f"tokenizer.chat_template.{n}" in meta]
    if not named:
        return str(default) if default else None
    return ([{"name": "default", "template": str(default)}] if default else []) + named


def write_tokenizer(meta: dict[str, Any], dest: Path, source: Path | None = None
                    ) -> dict[str, Any]:
    """Write tokenizer files into `dest`; return facts for the manifest. `source`, the GGUF
    file, names it in an ImportFailed."""
    try:
        return _write(meta, dest)
    except ImportFailed as exc:
        if source is None:
            raise
        raise ImportFailed(f"{source}: {exc}") from exc


def _write(meta: dict[str, Any], dest: Path) -> dict[str, Any]:
    v = _vocabulary(meta)
    if v.kind in ("gpt2", "gemma4"):
        pre_name = "gemma4" if v.kind == "gemma4" else str(meta.get("tokenizer.ggml.pre")
                                                           or "default")
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ImportFailed(f"unsupported BPE pre-tokenizer {pre_name!r} "
                               f"(tokenizer.ggml.pre; supported: "
                               f"{', '.join(sorted(PRE_TOKENIZERS))})")
        specials = special_tokens(v)
        text = json.dumps(_bpe_json(v, pre, specials), ensure_ascii=False)
        (dest / "tokenizer.json").write_text(text, encoding="utf-8")
        add_bos = v.flag("tokenizer.ggml.add_bos_token", pre.add_bos)
        if not pre.byte_level:
            add_bos = True  # llama.cpp overrides a false flag for Gemma 4's pre-tokenizer
        kind_name, tokenizer_class = "bpe", "PreTrainedTokenizerFast"
        bos_default = None
    elif v.kind == "llama":
        specials = special_tokens(v)
        (dest / "tokenizer.model").write_bytes(_spm_model_proto(v))
        add_bos = v.flag("tokenizer.ggml.add_bos_token", True)
        kind_name, tokenizer_class = "sentencepiece", "LlamaTokenizer"
        bos_default = 1
    else:
        raise ImportFailed(f"unsupported tokenizer kind {v.kind!r} "
                           "(tokenizer.ggml.model; supported: gpt2, gemma4, llama)")
    spm = v.kind == "llama"

    def text_of(idx: int | None) -> str | None:
        return None if idx is None else v.tokens[idx]

    bos = v.token_id("tokenizer.ggml.bos_token_id", bos_default)
    eos = v.token_id("tokenizer.ggml.eos_token_id", 2 if spm else None)
    config: dict[str, Any] = {
        "tokenizer_class": tokenizer_class,
        "bos_token": text_of(bos),
        "eos_token": text_of(eos),
        "unk_token": text_of(v.token_id("tokenizer.ggml.unknown_token_id", 0 if spm else None)),
        "pad_token": text_of(v.token_id("tokenizer.ggml.padding_token_id")),
        "add_bos_token": add_bos and bos is not None,
        "add_eos_token": v.flag("tokenizer.ggml.add_eos_token", False) and eos is not None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("context_length") or meta.get(
            f"{meta.get('general.architecture')}.context_length") or 0) or None,
        "added_tokens_decoder": {str(s.id): {k: val for k, val in _added_token(s).items()
                                             if k != "id"} for s in specials},
        "chat_template": _chat_templates(meta),
    }
    if spm:
        config["legacy"] = False
    config = {k: val for k, val in config.items() if val is not None}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                                encoding="utf-8")
    generation = {"bos_token_id": bos, "eos_token_id": sorted(eog_ids(v))}
    (dest / "generation_config.json").write_text(
        json.dumps({k: val for k, val in generation.items() if val is not None}, indent=2))
    return {"tokenizer": kind_name, "vocab_size": len(v.tokens)}
