"""Tokenizers and chat templates, without transformers.

Contract: `Tokenizer.load(folder)` opens tokenizer.json (through `tokenizers`) or
tokenizer.model (through `sentencepiece`), tokenizer_config.json and generation_config.json. It
encodes text (added and special tokens written in the text become their ids, as Hugging Face
and llama.cpp's parse_special do; a SentencePiece vocabulary's `added_tokens_decoder` says which,
with their rstrip/lstrip), adds BOS/EOS as the config says, renders chat messages through the
model's Jinja template in a sandbox (Hugging Face's globals and extensions), streams decoded text
with correct UTF-8 boundaries (`StreamingDetokenizer`), and names the ids that end generation
(`eos_ids`: EOS, generation_config's eos_token_id list, and the end-of-turn tokens in
END_MARKERS, as llama.cpp picks them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.errors import LoadFailed

# End-of-turn and end-of-text token texts (llama.cpp's end-of-generation names): generation
# stops at any that is a special token of the vocabulary.
END_MARKERS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _spm_user_defined_ids(model: bytes) -> set[int]:
    """Ids of USER_DEFINED pieces; sentencepiece's Python API has no is_user_defined()."""
    from sentencepiece import sentencepiece_model_pb2

    pb: Any = sentencepiece_model_pb2  # generated protobuf module: no static attributes
    proto = pb.ModelProto.FromString(model)
    kind = pb.ModelProto.SentencePiece.USER_DEFINED
    return {i for i, piece in enumerate(proto.pieces) if piece.type == kind}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoadFailed(f"{path}: unreadable ({exc})") from exc
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class _Added:
    """A token cut out of text before the model tokenizes the rest."""

    id: int
    lstrip: bool = False  # whitespace before it is eaten
    rstrip: bool = False  # whitespace after it is eaten


def _id_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _generation_extension() -> Any:
    """`{% generation %}...{% endgeneration %}` (Hugging Face marks assistant text with it):
    rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    return Generation


class Tokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config: dict[str, Any] = _read_json(folder / "tokenizer_config.json")
        self.generation: dict[str, Any] = _read_json(folder / "generation_config.json")
        self._hf: Any = None
        self._sp: Any = None
        self._added: dict[str, _Added] = {}
        self._added_text: dict[int, str] = {}
        self._split: re.Pattern[str] | None = None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as exc:  # the Rust library raises its own exception type
                raise LoadFailed(f"{folder / 'tokenizer.json'}: unreadable ({exc})") from exc
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            decoder = self._hf.get_added_tokens_decoder()
            self.specials = {t.content: i for i, t in decoder.items()}
            # The decoder would read a non-special added token's characters as its own
            # symbols (DeepSeek's user-defined "\u00f8": as byte 0xF8): those are written as
            # their text instead, as llama.cpp renders them.
            self._added_text = {i: t.content for i, t in decoder.items() if not t.special
                                and self._hf.decode([i], skip_special_tokens=False) != t.content}
        elif (folder / "tokenizer.model").is_file():
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            try:
                model = (folder / "tokenizer.model").read_bytes()
                self._sp.LoadFromSerializedProto(model)
            except (RuntimeError, OSError) as exc:
                raise LoadFailed(f"{folder / 'tokenizer.model'}: unreadable ({exc})") from exc
            self.vocab_size = self._sp.get_piece_size()
            self._added = self._spm_added(model)
            self.specials = {text: a.id for text, a in self._added.items()}
            # SentencePiece drops control pieces when decoding: every added token is written
            # as its text, between runs decoded alone.
            self._added_text = {a.id: text for text, a in self._added.items()}
            self._split = (re.compile("|".join(
                re.escape(s) for s in sorted(self._added, key=len, reverse=True)))
                if self._added else None)
        else:
            raise LoadFailed(f"{folder}: no tokenizer.json or tokenizer.model")
        self.bos_token = self._token_text("bos_token")
        self.eos_token = self._token_text("eos_token")
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.add_eos = bool(self.config.get("add_eos_token", False))
        self.template_source = self._find_template()
        self._template: Any = None

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        return cls(Path(folder))

    def _spm_added(self, model: bytes) -> dict[str, _Added]:
        """The tokens cut out of text: tokenizer_config's added_tokens_decoder when it has
        one (Strata's GGUF import writes llama.cpp's set there), else the model's control,
        unknown and user-defined pieces."""
        decoder = self.config.get("added_tokens_decoder")
        if isinstance(decoder, dict) and decoder:
            added = {}
            for key, tok in decoder.items():
                if isinstance(tok, dict) and isinstance(tok.get("content"), str) and tok["content"]:
                    added[tok["content"]] = _Added(int(key), bool(tok.get("lstrip")),
                                                   bool(tok.get("rstrip")))
            return added
        user_defined = _spm_user_defined_ids(model)
        sp = self._sp
        return {sp.id_to_piece(i): _Added(i) for i in range(self.vocab_size)
                if sp.is_control(i) or sp.is_unknown(i) or i in user_defined}

    def _token_text(self, key: str) -> str | None:
        value = self.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        return value if isinstance(value, str) else None

    def _find_template(self) -> str | None:
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # named templates: take the default one
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        if tpl is None and (self.folder / "chat_template.jinja").is_file():
            tpl = (self.folder / "chat_template.jinja").read_text()
        return tpl if isinstance(tpl, str) else None

    # -- ids ------------------------------------------------------------------------------
    def token_id(self, text: str) -> int | None:
        if self._hf is not None:
            return self._hf.token_to_id(text)
        if text in self._added:
            return self._added[text].id
        i = self._sp.piece_to_id(text)
        return None if i == self._sp.unk_id() and text != self._sp.id_to_piece(i) else i

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token) if self.eos_token else None

    def eos_ids(self, extra: Sequence[int] = ()) -> set[int]:
        """Ids that end generation: `extra`, EOS, generation_config.json's eos_token_id, and
        the special tokens named in END_MARKERS. As llama.cpp does, a vocabulary with harmony's
        <|return|> and <|call|> (gpt-oss) does not end on <|end|>, which closes each message."""
        ids = {int(i) for i in extra}
        ids.update(_id_list(self.generation.get("eos_token_id")))
        if self.eos_id is not None:
            ids.add(self.eos_id)
        markers = {self.specials[t] for t in END_MARKERS if t in self.specials}
        if "<|end|>" in self.specials and "<|return|>" in self.specials and (
                "<|call|>" in self.specials or "<|calls|>" in self.specials):
            markers.discard(self.specials["<|end|>"])
        return ids | markers

    def encode(self, text: str, add_bos: bool | None = None, add_eos: bool | None = None
               ) -> list[int]:
        add_bos = self.add_bos if add_bos is None else add_bos
        add_eos = self.add_eos if add_eos is None else add_eos
        if self._hf is not None:
            ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = []
            for part in self._pieces(text):
                if isinstance(part, int):
                    ids.append(part)
                else:
                    ids.extend(self._sp.encode(part))
        bos = self.bos_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        eos = self.eos_id
        if add_eos and eos is not None:
            ids.append(eos)
        return ids

    def _pieces(self, text: str) -> list[str | int]:
        """SentencePiece: text split into runs of plain text and added-token ids, each run
        to be encoded alone (so each gets the dummy prefix, as llama.cpp gives it)."""
        if self._split is None:
            return [text] if text else []
        out: list[str | int] = []
        pos, strip_next = 0, False
        for m in self._split.finditer(text):
            added = self._added[m.group()]
            before = text[pos : m.start()]
            if strip_next:
                before = before.lstrip()
            if added.lstrip:
                before = before.rstrip()
            if before:
                out.append(before)
            out.append(added.id)
            pos, strip_next = m.end(), added.rstrip
        rest = text[pos:]
        if strip_next:
            rest = rest.lstrip()
        if rest:
            out.append(rest)
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens included; the added tokens the model's decoder would
        drop or misread as their own text, the runs between them decoded alone."""
        text: list[str] = []
        run: list[int] = []
        for i in ids:
            piece = self._added_text.get(int(i))
            if piece is None:
                run.append(int(i))
                continue
            if run:
                text.append(self._decode_run(run))
                run = []
            text.append(piece)
        if run:
            text.append(self._decode_run(run))
        return "".join(text)

    def _decode_run(self, ids: list[int]) -> str:
        if self._hf is not None:
            return str(self._hf.decode(ids, skip_special_tokens=False))
        return str(self._sp.decode(ids))

    # -- chat -----------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **variables: Any) -> str:
        """Messages to prompt text through the model's template, in a Jinja sandbox with the
        globals Hugging Face gives templates (`variables` adds others: tools, ...)."""
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                       separators: tuple[str, str] | None = None, sort_keys: bool = False
                       ) -> str:
                return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True,
                extensions=["jinja2.ext.loopcontrols", _generation_extension()])
            env.filters["tojson"] = tojson
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.template_source or FALLBACK_TEMPLATE)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   **variables}
        msgs = list(messages)
        try:
            return str(self._template.render(
                messages=msgs, add_generation_prompt=add_generation_prompt, **context))
        except Exception as exc:  # the template's own raise_exception, or a Jinja error
            merged = _system_into_first_user(msgs)
            if merged is None:
                raise
            # Templates that refuse a system role (Gemma's): its text opens the first user
            # turn, as LM Studio and Ollama do.
            try:
                return str(self._template.render(
                    messages=merged, add_generation_prompt=add_generation_prompt, **context))
            except Exception:
                raise exc from None

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (renders a tool list)."""
        return bool(self.template_source) and "tools" in str(self.template_source)

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """Messages (and OpenAI-shaped `tools`, given to the template as its `tools`) to ids."""
        extra = {"tools": list(tools)} if tools else {}
        # Templates write BOS themselves when the model wants it, as Hugging Face assumes.
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra),
                           add_bos=False, add_eos=False)


def _system_into_first_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages with a leading system message folded into the first user one (None when
    there is no such pair)."""
    if not messages or messages[0].get("role") != "system":
        return None
    system, rest = messages[0], messages[1:]
    for i, m in enumerate(rest):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            folded = dict(m, content=f"{system.get('content', '')}\n\n{m['content']}")
            return [*rest[:i], folded, *rest[i + 1:]]
    return None


class StreamingDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window (from a token before the new ones) and emits only what the window
    adds, holding back text that ends in an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens before this are emitted

    def add(self, token: int) -> str:
        self.tokens.append(token)
        decode = self.tokenizer.decode
        prefix_text = decode(self.tokens[self._prefix : self._read])
        new_text = decode(self.tokens[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """What is held back at the end (may contain U+FFFD for a truly broken sequence)."""
        prefix_text = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        new_text = self.tokenizer.decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return new_text[len(prefix_text) :]
