"""Tiny random-weight llama/qwen2 GGUF files for tests, written with `gguf.GGUFWriter`.

Contract: `write_gguf(path, spec, qtype, vocab)` writes a small model whose 2-D weights are
stored as `qtype` (floats, the types gguf quantizes (`GGUF_QUANTIZES`), NVFP4 quantized here,
or valid random blocks of any other type: K-quants, i-quants) and
returns what the file holds in Hugging Face layout: `source` (the random float weights before
encoding) and `expected` (the stored values dequantized with `gguf`, llama Q/K rows permuted
back), for comparison with what an importer produced. `bpe_vocab` and `spm_vocab` train real
tokenizers (byte-level BPE with `tokenizers`, SentencePiece BPE with `sentencepiece`) and
describe them as GGUF tokenizer metadata.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough varied text for a byte-level BPE of a few hundred tokens, with no data files needed.
BUILTIN_TEXT = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow.
A local model runs on your own machine: it reads the weights, builds the cache, and answers.
Numbers like 12, 345, 6789 and 3.14159 appear in text; so do dates such as 2024-05-17.
Caf\u00e9, na\u00efve, \u00fcber, \u65e5\u672c\u8a9e and emoji \U0001f642 are bytes too.
def main():
    return sum(x * x for x in range(10))
First Citizen: Before we proceed any further, hear me speak.
All: Speak, speak. You are all resolved rather to die than to famish?
"""

# Byte offsets of the float16 fields that make a random K-quant block sane (llama.cpp layouts).
_KQUANT_F16_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q4_K: (0, 2),  # d, dmin; then 12 bytes of 6-bit scales/mins and 128 bytes of nibbles
    QT.Q5_K: (0, 2),  # d, dmin; scales, 32 bytes of high bits, 128 bytes of nibbles
    QT.Q6_K: (208,),  # 128 low nibbles, 64 high bits, 16 int8 scales, then d
    QT.Q2_K: (80, 82),  # 16 bytes of scales/mins, 64 bytes of 2-bit codes, then d, dmin
    QT.IQ4_NL: (0,),  # d, then 16 bytes of 4-bit indices into a fixed table
}
# Scales that keep the dequantized values around +-0.5 for random codes.
_KQUANT_F16_RANGE = {QT.Q4_K: (1e-4, 6e-4), QT.Q5_K: (5e-5, 3e-4), QT.Q6_K: (3e-5, 1.2e-4)}
# Types whose values are d times a function of the codes: where d sits in a block. Their
# random blocks get d scaled so that the values have RANDOM_STD (IQ1_M spreads its d over
# the top nibbles of its last 8 bytes, see _set_iq1m_d).
_SCALED_D_FIELDS: dict[QT, tuple[int, ...]] = {
    QT.Q3_K: (108,), QT.IQ4_XS: (0,), QT.IQ3_S: (0,), QT.IQ3_XXS: (0,), QT.IQ2_S: (0,),
    QT.IQ2_XS: (0,), QT.IQ2_XXS: (0,), QT.IQ1_S: (0,), QT.IQ1_M: (), QT.NVFP4: (),
}
RANDOM_STD = 0.05
# Types the gguf package quantizes from floats (the others get valid random blocks).
GGUF_QUANTIZES = ("BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "TQ1_0", "TQ2_0", "MXFP4")
# E2M1 values in ggml's doubled convention (NVFP4 and MXFP4 code tables).
_FP4_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


# -- tokenizers -----------------------------------------------------------------------------
@dataclass
class Vocab:
    """GGUF tokenizer metadata (tokenizer.ggml.*)."""

    model: str  # "gpt2" | "llama"
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    add_bos: bool | None = None
    pre: str | None = None
    chat_template: str | None = None

    def write(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        if self.pre is not None:
            w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        w.add_token_types(self.types)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        for value, add in ((self.bos, w.add_bos_token_id), (self.eos, w.add_eos_token_id),
                           (self.unk, w.add_unk_token_id)):
            if value is not None:
                add(value)
        if self.add_bos is not None:
            w.add_add_bos_token(self.add_bos)
        if self.chat_template is not None:
            w.add_chat_template(self.chat_template)


CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def bpe_vocab(text: str = BUILTIN_TEXT, vocab_size: int = 320) -> tuple[Vocab, Any]:
    """Train a byte-level BPE (GPT-2 style) with ChatML specials; (GGUF vocab, tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    tokens = [str(tok.id_to_token(i)) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [CONTROL if t in CHATML_SPECIALS else NORMAL for t in tokens]
    vocab = Vocab(
        model="gpt2", tokens=tokens, types=types, merges=merges, pre="default",
        bos=tokens.index("<|im_start|>"), eos=tokens.index("<|im_end|>"), add_bos=False,
        chat_template=CHATML_TEMPLATE,
    )
    return vocab, tok


SPM_USER_DEFINED = "<|sep|>"


def spm_vocab(lines: Iterable[str], vocab_size: int = 400) -> tuple[Vocab, Any]:
    """Train a SentencePiece BPE with byte fallback, llama style; (GGUF vocab, processor).

    One USER_DEFINED piece (`SPM_USER_DEFINED`) is included, as chat vocabularies have.
    """
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf module: no static attributes
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=1.0,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True, num_threads=2, minloglevel=2,
        user_defined_symbols=[SPM_USER_DEFINED],
    )
    proto = pb.ModelProto.FromString(buf.getvalue())
    vocab = Vocab(
        model="llama",
        tokens=[p.piece for p in proto.pieces],
        types=[int(p.type) for p in proto.pieces],
        scores=[float(p.score) for p in proto.pieces],
        unk=proto.trainer_spec.unk_id, bos=proto.trainer_spec.bos_id,
        eos=proto.trainer_spec.eos_id, add_bos=True,
    )
    return vocab, spm.SentencePieceProcessor(model_proto=buf.getvalue())


# -- weights --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """Shape of the tiny model. K-quants need rows that are multiples of 256."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 512
    tie: bool = True
    qkv_bias: bool = False
    context: int = 512
    rope_base: float = 10000.0


@dataclass
class Written:
    """A GGUF written by `write_gguf`, keyed by Hugging Face tensor names."""

    path: Path
    spec: ModelSpec
    qtypes: dict[str, str] = field(default_factory=dict)
    source: dict[str, np.ndarray | None] = field(default_factory=dict)  # None: raw random blocks
    expected: dict[str, np.ndarray] = field(default_factory=dict)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (half-split -> interleaved)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def unpermute_index(rows: int, n_head: int) -> np.ndarray:
    """`idx` such that GGUF row i holds HF row idx[i]; built from `permute_qk` itself."""
    return permute_qk(np.arange(rows)[:, None], n_head)[:, 0]


def _set_iq1m_d(blocks: np.ndarray, d: np.ndarray) -> None:
    """IQ1_M's float16 d is the top nibbles of its four last uint16 words."""
    bits = d.astype(np.float16).view(np.uint16)
    words = np.ascontiguousarray(blocks[..., -8:]).view(np.uint16)
    for k, shift in enumerate((0, 4, 8, 12)):
        words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> shift) & 0xF) << 12)
    blocks[..., -8:] = words.view(np.uint8)


def random_blocks(rows: int, cols: int, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Valid random blocks (R, bytes) for a type gguf cannot quantize: random codes, sane scales."""
    shape = gguf.quants.quant_shape_to_byte_shape((rows, cols), qtype)
    raw = rng.integers(0, 256, size=shape, dtype=np.uint8)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(rows, -1, type_size)
    if qtype in _SCALED_D_FIELDS:
        # d = 1 first, then d scaled so that the values come out with RANDOM_STD.
        if qtype == QT.NVFP4:
            blocks[..., :4] = 0x38  # UE4M3 1.0
        offsets = _SCALED_D_FIELDS[qtype]
        one = np.ones(blocks.shape[:2], np.float32)
        if qtype == QT.IQ1_M:
            _set_iq1m_d(blocks, one)
        for off in offsets:
            blocks[..., off : off + 2] = one.astype(np.float16)[..., None].view(np.uint8)
        std = float(gguf.quants.dequantize(raw, qtype).std()) or 1.0
        d = (RANDOM_STD / std) * rng.uniform(0.8, 1.2, size=blocks.shape[:2])
        if qtype == QT.IQ1_M:
            _set_iq1m_d(blocks, d)
        for off in offsets:
            blocks[..., off : off + 2] = d.astype(np.float16)[..., None].view(np.uint8)
        if qtype == QT.NVFP4:
            blocks[..., :4] = gguf.quants.NVFP4.fp32_to_ue4m3(
                np.repeat(d, 4).reshape(*d.shape, 4).astype(np.float32))
        return raw
    lo, hi = _KQUANT_F16_RANGE.get(qtype, (1e-4, 5e-4))
    for off in _KQUANT_F16_FIELDS.get(qtype, ()):
        vals = rng.uniform(lo, hi, size=blocks.shape[:2]).astype(np.float16)
        blocks[..., off : off + 2] = vals[..., None].view(np.uint8)
    return raw


def quantize_nvfp4(w: np.ndarray) -> np.ndarray:
    """Float rows to NVFP4 blocks as ggml lays them out: per 64 values four UE4M3 scales (one
    per 16, in ggml's halved convention) then 32 bytes of codes, element j of a 16 in the
    low nibble and j + 8 in the high one. Round to nearest code under the rounded scale."""
    rows = w.shape[0]
    sub = w.astype(np.float32).reshape(rows, -1, 16)
    amax = np.abs(sub).max(-1)
    scale = gguf.quants.NVFP4.fp32_to_ue4m3(amax / 6)  # true scale: decoded value
    d = gguf.quants.NVFP4.ue4m3_to_fp32(scale)  # halved, against the doubled table
    err = np.abs(d[..., None, None] * _FP4_DOUBLED - sub[..., None])
    codes = err.argmin(-1).astype(np.uint8)
    qs = codes[..., :8] | (codes[..., 8:] << 4)
    n_super = sub.shape[1] // 4
    return np.concatenate([scale.reshape(rows, n_super, 4),
                           qs.reshape(rows, n_super, 32)], axis=-1).reshape(rows, -1)


def encode(w: np.ndarray, qtype: str, rng: np.random.Generator
           ) -> tuple[np.ndarray, QT | None, np.ndarray]:
    """(array to write, raw dtype for GGUFWriter, float32 values the file then holds).

    Types gguf cannot dequantize (Q8_K, Q1_0...) get random bytes and NaN values: such a
    file is for testing that the type is refused."""
    qt = QT[qtype]
    if qtype == "F32":
        w32 = w.astype(np.float32)
        return w32, None, w32
    if qtype == "F16":
        w16 = w.astype(np.float16)
        return w16, None, w16.astype(np.float32)
    if qtype in GGUF_QUANTIZES:
        raw = gguf.quants.quantize(w.astype(np.float32), qt)
    elif qtype == "NVFP4":
        raw = quantize_nvfp4(w)
    else:
        raw = random_blocks(w.shape[0], w.shape[1], qt, rng)
    try:
        held = gguf.quants.dequantize(raw, qt).astype(np.float32)
    except NotImplementedError:
        held = np.full(w.shape, np.nan, np.float32)
    return raw, qt, held


def _tensor_shapes(spec: ModelSpec, n_vocab: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, HF shape) for every tensor of the model."""
    hd = spec.hidden // spec.heads
    q, kv = spec.heads * hd, spec.kv_heads * hd
    out = [("token_embd.weight", "model.embed_tokens.weight", (n_vocab, spec.hidden)),
           ("output_norm.weight", "model.norm.weight", (spec.hidden,))]
    if not spec.tie:
        out.append(("output.weight", "lm_head.weight", (n_vocab, spec.hidden)))
    for i in range(spec.layers):
        b, h = f"blk.{i}.", f"model.layers.{i}."
        out += [
            (b + "attn_norm.weight", h + "input_layernorm.weight", (spec.hidden,)),
            (b + "attn_q.weight", h + "self_attn.q_proj.weight", (q, spec.hidden)),
            (b + "attn_k.weight", h + "self_attn.k_proj.weight", (kv, spec.hidden)),
            (b + "attn_v.weight", h + "self_attn.v_proj.weight", (kv, spec.hidden)),
            (b + "attn_output.weight", h + "self_attn.o_proj.weight", (spec.hidden, q)),
            (b + "ffn_norm.weight", h + "post_attention_layernorm.weight", (spec.hidden,)),
            (b + "ffn_gate.weight", h + "mlp.gate_proj.weight", (spec.ffn, spec.hidden)),
            (b + "ffn_up.weight", h + "mlp.up_proj.weight", (spec.ffn, spec.hidden)),
            (b + "ffn_down.weight", h + "mlp.down_proj.weight", (spec.hidden, spec.ffn)),
        ]
        if spec.qkv_bias:
            out += [
                (b + "attn_q.bias", h + "self_attn.q_proj.bias", (q,)),
                (b + "attn_k.bias", h + "self_attn.k_proj.bias", (kv,)),
                (b + "attn_v.bias", h + "self_attn.v_proj.bias", (kv,)),
            ]
    return out


def write_gguf(
    path: Path,
    spec: ModelSpec,
    qtype: str,
    vocab: Vocab,
    seed: int = 0,
    arch_name: str | None = None,
    overrides: dict[str, str] | None = None,
) -> Written:
    """Write a tiny random model; 2-D weights as `qtype` (per GGUF name: `overrides`).

    Norms and biases stay F32, as llama.cpp keeps them. `arch_name` writes another
    general.architecture (and key prefix) to test rejection of unknown architectures.
    """
    rng = np.random.default_rng(seed)
    arch = arch_name or spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{spec.arch}-{qtype.lower()}")
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(spec.rope_base)
    vocab.write(w)
    out = Written(path=Path(path), spec=spec)
    for gname, hf, shape in _tensor_shapes(spec, len(vocab.tokens)):
        if len(shape) == 1:
            base = 1.0 if hf.endswith("norm.weight") else 0.0
            src = (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(gname, src)
            out.qtypes[hf], out.source[hf], out.expected[hf] = "F32", src, src
            continue
        src = (0.05 * rng.standard_normal(shape)).astype(np.float32)
        n_head = {"q_proj": spec.heads, "k_proj": spec.kv_heads}.get(hf.split(".")[-2])
        permuted = spec.arch == "llama" and n_head is not None
        stored_src = permute_qk(src, n_head) if permuted and n_head else src
        t = (overrides or {}).get(gname, qtype)
        data, raw_dtype, held = encode(stored_src, t, rng)
        w.add_tensor(gname, data, raw_dtype=raw_dtype)
        if permuted and n_head:
            hf_held = np.empty_like(held)
            hf_held[unpermute_index(shape[0], n_head)] = held
            held = hf_held
        is_random = raw_dtype is not None and t not in (*GGUF_QUANTIZES, "NVFP4")
        out.qtypes[hf], out.source[hf], out.expected[hf] = t, None if is_random else src, held
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
