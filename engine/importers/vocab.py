"""GGUF tokenizer metadata to tokenizer files a runtime (ours or mlx-lm's) can open.

Contract: `write_tokenizer(fields, dest)` writes tokenizer.json (gpt2-style BPE, through
`tokenizers`) or tokenizer.model (llama/SentencePiece, through `sentencepiece`'s model proto)
plus tokenizer_config.json (chat template, BOS/EOS, special tokens). Raises ImportFailed for a
vocabulary kind it does not know.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.errors import ImportFailed

# GGUF token types (llama.cpp's llama_token_type); they equal SentencePiece's piece types.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as the upstream tokenizers define them.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _special_tokens(tokens: Sequence[str], types: Sequence[int]) -> list[str]:
    return [t for t, ty in zip(tokens, types, strict=False) if ty in (CONTROL, USER_DEFINED)]


def _bpe_tokenizer(meta: dict[str, Any]) -> Any:
    # heavy (Rust extension): only for a GGUF with a BPE vocabulary
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    merges_raw: list[str] = meta.get("tokenizer.ggml.merges") or []
    merges = []
    for m in merges_raw:
        left, sep, right = m.partition(" ")
        if not sep:
            raise ImportFailed(f"malformed BPE merge {m!r} in tokenizer.ggml.merges")
        merges.append((left, right))
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre in ("llama-bpe", "llama3"),
    )
    tok = Tokenizer(model)
    if pre in _SPLIT_BY_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    specials = _special_tokens(tokens, types)
    if specials:
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def _spm_model_proto(meta: dict[str, Any]) -> bytes:
    # heavy (protobuf): only for a GGUF with a SentencePiece vocabulary
    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf module: no static attributes
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    proto = pb.ModelProto()
    # llama.cpp treats every "llama" vocabulary as score-ranked BPE; so do we.
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = any(t == BYTE for t in types)
    for field, key in (
        ("unk_id", "tokenizer.ggml.unknown_token_id"),
        ("bos_id", "tokenizer.ggml.bos_token_id"),
        ("eos_id", "tokenizer.ggml.eos_token_id"),
        ("pad_id", "tokenizer.ggml.padding_token_id"),
    ):
        setattr(proto.trainer_spec, field, int(meta.get(key, -1)))
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for text, score, ty in zip(tokens, scores, types, strict=False):
        piece = proto.pieces.add()
        piece.piece = text
        piece.score = float(score)
        piece.type = int(ty) if int(ty) in (1, 2, 3, 4, 5, 6) else NORMAL
    return bytes(proto.SerializeToString())


def write_tokenizer(meta: dict[str, Any], dest: Path) -> dict[str, Any]:
    """Write tokenizer files into `dest`; return facts for the manifest."""
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ImportFailed("no vocabulary (tokenizer.ggml.tokens) in the GGUF metadata")

    def token_text(key: str) -> str | None:
        idx = meta.get(key)
        if idx is None or not 0 <= int(idx) < len(tokens):
            return None
        return str(tokens[int(idx)])

    config: dict[str, Any] = {
        "bos_token": token_text("tokenizer.ggml.bos_token_id"),
        "eos_token": token_text("tokenizer.ggml.eos_token_id"),
        "unk_token": token_text("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_text("tokenizer.ggml.padding_token_id"),
        "model_max_length": int(meta.get("context_length", 0)) or None,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    if kind == "gpt2":
        tok = _bpe_tokenizer(meta)
        tok.save(str(dest / "tokenizer.json"))
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        kind_name = "bpe"
    elif kind == "llama":
        (dest / "tokenizer.model").write_bytes(_spm_model_proto(meta))
        config["tokenizer_class"] = "LlamaTokenizer"
        config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        config["legacy"] = False
        kind_name = "sentencepiece"
    else:
        raise ImportFailed(f"unsupported tokenizer kind {kind!r} (supported: gpt2, llama)")
    config = {k: v for k, v in config.items() if v is not None}
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {"tokenizer": kind_name, "vocab_size": len(tokens)}
