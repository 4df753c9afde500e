"""Constrained decoding: a grammar's token mask as a logits processor (llguidance).

Contract: `json_grammar(schema)` (None: any JSON object) and `lark_grammar(text)` compile a
grammar to llguidance's serialized form, refusing with one `GrammarError` line a schema that is
too deep, too large, or uses a feature the compiler does not implement (before any model work).
`GrammarProcessor(tokenizer, grammar)` is an engine.runtime.generate logits processor:
`(history, logits) -> logits` with every token the grammar cannot accept next at -inf, and
only the end-of-turn ids once the grammar is complete, so the output always matches it (unless
max_tokens cuts it short). The first call takes `history` as the prompt; later calls feed the
matcher the tokens sampled since. The vocabulary is read once per Tokenizer (tokenizer.json
through llguidance's Rust tokenizers; a SentencePiece model through its pieces' bytes).
"""

from __future__ import annotations

import json
import weakref
from collections import deque
from typing import Any

from engine.errors import StrataError
from engine.runtime.tokenizer import Tokenizer

MAX_SCHEMA_DEPTH = 40  # nesting of schema objects; real schemas stay under ~10
MAX_SCHEMA_NODES = 20_000  # JSON values in one schema (enum members count)
MAX_ENUM = 2_000  # members of one enum
# Whitespace between tokens is fixed: a small model left to choose loops on newlines.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ",
                                 "key_separator": ": "}


class GrammarError(StrataError):
    """A schema or grammar that cannot be enforced: the reason in one line."""


def check_schema(schema: Any, where: str = "schema") -> None:
    """Refuse schemas past the size limits, walking iteratively (no recursion to exhaust)."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"{where} must be a JSON object")
    todo: deque[tuple[Any, int]] = deque([(schema, 0)])
    nodes = 0
    while todo:
        value, depth = todo.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"{where} is too large (over {MAX_SCHEMA_NODES} values)")
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{where} is nested too deep (over {MAX_SCHEMA_DEPTH} levels)")
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list) and len(enum) > MAX_ENUM:
                raise GrammarError(f"{where} has an enum of {len(enum)} values "
                                   f"(at most {MAX_ENUM})")
            todo.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value)


def _validated(grammar: str, what: str) -> str:
    import llguidance

    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        reason = " ".join((messages[0] if messages else "invalid").split())
        raise GrammarError(f"{what} cannot be enforced: {reason[:300]}")
    return grammar


def json_grammar(schema: dict[str, Any] | bool | None, where: str = "schema") -> str:
    """A JSON schema's grammar (None: any JSON object)."""
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    check_schema(schema, where)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=_JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"{where} is not a valid JSON schema ({exc})") from exc
    return _validated(grammar, where)


def lark_json(schema: dict[str, Any] | bool) -> str:
    """A JSON schema as the body of a Lark rule (`name: <this>`), for grammars that embed
    JSON in other text (tool calls)."""
    check_schema(schema)
    opts = schema if isinstance(schema, bool) else {
        **schema, "x-guidance": {**_JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return f"%json {json.dumps(opts)}"


def lark_grammar(lark: str, what: str = "grammar") -> str:
    import llguidance

    return _validated(llguidance.LLMatcher.grammar_from_lark(lark), what)


# -- the vocabulary ------------------------------------------------------------------------
_VOCABS: weakref.WeakKeyDictionary[Tokenizer, Any] = weakref.WeakKeyDictionary()


def _sentencepiece_vocab(tok: Tokenizer) -> Any:
    import llguidance
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto((tok.folder / "tokenizer.model").read_bytes())
    pieces: list[bytes] = []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_byte(i):  # <0xAB>
            pieces.append(bytes([int(piece[3:5], 16)]))
        elif sp.is_control(i) or sp.is_unknown(i):
            pieces.append(b"")
        else:
            pieces.append(piece.replace("\u2581", " ").encode("utf-8"))
    specials = sorted(tok.specials.values())

    class Vocab:  # what llguidance.TokenizerWrapper reads
        eos_token_id = tok.eos_id if tok.eos_id is not None else 0
        bos_token_id = tok.bos_id
        tokens = pieces
        special_token_ids = specials

        def __call__(self, text: str) -> list[int]:
            return list(tok.encode(text, add_bos=False, add_eos=False))

    return llguidance.TokenizerWrapper(Vocab())


def vocabulary(tok: Tokenizer) -> Any:
    """llguidance's tokenizer for `tok` (about 0.2 s the first time; kept per Tokenizer)."""
    import llguidance

    vocab = _VOCABS.get(tok)
    if vocab is None:
        eos = sorted(tok.eos_ids()) or None
        if (tok.folder / "tokenizer.json").is_file():
            source: Any = (tok.folder / "tokenizer.json").read_text(encoding="utf-8")
        else:
            source = _sentencepiece_vocab(tok)
        try:
            vocab = llguidance.LLTokenizer(source, n_vocab=tok.vocab_size, eos_token=eos)
        except Exception as exc:  # the Rust side raises its own types
            raise GrammarError(f"{tok.folder}: vocabulary unusable for grammars ({exc})") \
                from exc
        _VOCABS[tok] = vocab
    return vocab


# -- the processor -------------------------------------------------------------------------
class GrammarProcessor:
    """One generation's mask: make a new one per request (it holds the parse state)."""

    def __init__(self, tok: Tokenizer, grammar: str) -> None:
        import llguidance
        import numpy as np

        self.vocab = vocabulary(tok)
        self.matcher = llguidance.LLMatcher(self.vocab, grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"grammar refused: {self.matcher.get_error()[:300]}")
        self._bits = np.full(((self.vocab.vocab_size + 31) // 32,), -1, dtype=np.int32)
        self._seen: int | None = None  # history length already fed to the matcher

    def _error(self) -> str:
        lines = self.matcher.get_error().strip().splitlines()
        return (lines[0] if lines else "parser error")[:200]

    @property
    def accepting(self) -> bool:
        return bool(self.matcher.is_accepting())

    def __call__(self, history: list[int], logits: Any) -> Any:
        import mlx.core as mx
        import numpy as np

        if self._seen is None:
            self._seen = len(history)  # the prompt: nothing of it is grammar text
        new = history[self._seen :]
        self._seen = len(history)
        if new and not self.matcher.consume_tokens(new):
            raise GrammarError(f"the grammar cannot continue: {self._error()}")
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():  # e.g. a schema with no finite instance
            raise GrammarError(f"the grammar cannot continue: {self._error()}")
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        width = logits.shape[-1]
        if allowed.shape[0] < width:
            allowed = np.pad(allowed, (0, width - allowed.shape[0]))
        mask = mx.array(allowed[:width].astype(np.bool_))
        return mx.where(mask, logits, mx.array(-float("inf"), dtype=logits.dtype))
