"""llama.cpp (llama-cpp-python) as the reference for what a GGUF file means.

Contract: `reference(path)` opens a GGUF with llama.cpp (2 threads, every position's logits
kept) and returns a `Reference` whose `logits(tokens)` are llama.cpp's next-token logits at
every position (float32, (len(tokens), vocab)), `greedy(tokens, n)` its n greedy tokens after
the prompt, and `tokenize(text)` its token ids. `quantize(src, dst, ftype)` writes `dst` from an
F32/F16 `src` with llama.cpp's own quantizer (`ftype`: a LLAMA_FTYPE_MOSTLY_* suffix, "Q4_K_M").
Tests that need llama.cpp skip with the reason when llama-cpp-python is not installed (the
README's test command installs it).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def llama_cpp() -> Any:
    """The llama_cpp module, or skip the test (with why) where it is not installed."""
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed "
                               "(`make test` installs it)")


@dataclass
class Reference:
    """llama.cpp on one GGUF file."""

    llm: Any

    def logits(self, tokens: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(tokens)
        return np.array(self.llm.scores[: len(tokens)], dtype=np.float32)

    def greedy(self, tokens: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(tokens)
        out: list[int] = []
        for _ in range(n):
            nxt = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            out.append(nxt)
            self.llm.eval([nxt])
        return out

    def tokenize(self, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
        return list(self.llm.tokenize(text.encode(), add_bos=add_bos, special=special))

    def close(self) -> None:
        self.llm.close()


def reference(path: Path, n_ctx: int = 512, vocab_only: bool = False) -> Reference:
    lc = llama_cpp()
    llm = lc.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=2, n_batch=n_ctx,
                   logits_all=True, vocab_only=vocab_only, verbose=False, seed=0)
    return Reference(llm)


def quantize(src: Path, dst: Path, ftype: str) -> None:
    """Quantize `src` into `dst` with llama.cpp (`ftype`: "Q4_K_M", "Q2_K", "IQ4_NL", ...)."""
    lc = llama_cpp()
    params = lc.llama_model_quantize_default_params()
    params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = lc.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (rc {rc})")
