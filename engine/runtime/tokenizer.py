"""Tokenizers and chat templates, without transformers.

Contract: `Tokenizer.load(folder)` opens tokenizer.json (through `tokenizers`) or
tokenizer.model (through `sentencepiece`) and tokenizer_config.json. It encodes text (special
tokens written in the text become their ids, as Hugging Face does), renders chat messages
through the model's Jinja template in a sandbox, and streams decoded text with correct UTF-8
boundaries (`StreamingDetokenizer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.errors import LoadFailed

# End-of-turn markers of common templates: generation stops at any that is a special token.
END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>",
               "</s>", "<end_of_turn>")
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


class Tokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self._hf: Any = None
        self._sp: Any = None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as HFTokenizer

            try:
                self._hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as exc:  # the Rust library raises its own exception type
                raise LoadFailed(f"{folder / 'tokenizer.json'}: unreadable ({exc})") from exc
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            self.specials = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items()
                             if t.special}
        elif (folder / "tokenizer.model").is_file():
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor()
            try:
                model = (folder / "tokenizer.model").read_bytes()
                self._sp.LoadFromSerializedProto(model)
            except (RuntimeError, OSError) as exc:
                raise LoadFailed(f"{folder / 'tokenizer.model'}: unreadable ({exc})") from exc
            self.vocab_size = self._sp.get_piece_size()
            user_defined = _spm_user_defined_ids(model)
            self.specials = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                             if self._sp.is_control(i) or self._sp.is_unknown(i)
                             or i in user_defined}
            self._split = (re.compile("(" + "|".join(
                re.escape(s) for s in sorted(self.specials, key=len, reverse=True)) + ")")
                if self.specials else None)
        else:
            raise LoadFailed(f"{folder}: no tokenizer.json or tokenizer.model")
        self.bos_token = self._token_text("bos_token")
        self.eos_token = self._token_text("eos_token")
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.template_source = self._find_template()
        self._template: Any = None

    @classmethod
    def load(cls, folder: Path) -> Tokenizer:
        return cls(Path(folder))

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
        i = self._sp.piece_to_id(text)
        return None if i == self._sp.unk_id() and text != self._sp.id_to_piece(i) else i

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token) if self.bos_token else None

    def eos_ids(self, extra: Sequence[int] = ()) -> set[int]:
        """Ids that end generation: EOS, the template's end-of-turn tokens, and `extra`."""
        ids = {int(i) for i in extra}
        for text in (self.eos_token, *END_MARKERS):
            if text and text in self.specials:
                ids.add(self.specials[text])
        return ids

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        add_bos = self.add_bos if add_bos is None else add_bos
        if self._hf is not None:
            ids: list[int] = self._hf.encode(text, add_special_tokens=False).ids
        else:
            ids = []
            parts = self._split.split(text) if self._split else [text]
            for part in parts:
                if not part:
                    continue
                if part in self.specials:
                    ids.append(self.specials[part])
                else:
                    ids.extend(self._sp.encode(part))
        bos = self.bos_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        if self._hf is not None:
            return str(self._hf.decode(list(ids), skip_special_tokens=False))
        return str(self._sp.decode(list(ids)))

    # -- chat -----------------------------------------------------------------------------
    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
                    ) -> str:
        """Messages to prompt text through the model's template, in a Jinja sandbox."""
        if self._template is None:
            from jinja2.exceptions import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, indent=None: json.dumps(
                x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.template_source or FALLBACK_TEMPLATE)
        return str(self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        ))

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
                    ) -> list[int]:
        # Templates write BOS themselves when the model wants it, as Hugging Face assumes.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)


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
