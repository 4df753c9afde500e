"""Shared by the speculative-decoding tests (test_speculative.py, test_spec_batch.py): the copy
prompt (greedy text copies it), one reply's tokens and last event, and a prompt's plain greedy
reply, decoded once per process for each model, KV mode and prompt (the longest asked so far;
a shorter one is its start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.runtime.generate import LoadedModel, PromptCache, generate
from engine.runtime.sampling import SamplingParams
from engine.telemetry import GenerationEvent

GREEDY = SamplingParams(temperature=0.0)
SOURCE = Path(__file__).resolve().parents[3] / "engine" / "runtime" / "sampling.py"

_plain: dict[tuple[int, str, tuple[int, ...]], list[int]] = {}


def copy_prompt(lm: LoadedModel, lines: int = 30) -> list[int]:
    """The start of a source file, then a header asking for it again: greedy text copies."""
    src = "\n".join(SOURCE.read_text().splitlines()[:lines]) + "\n"
    first = src.splitlines()[0] + "\n"
    return lm.tokenizer.encode(f"# sampling.py\n{src}\n# sampling.py, once more\n{first}",
                               add_bos=False)


def run(lm: LoadedModel, ids: list[int], drafter: Any, n: int,
        params: SamplingParams = GREEDY, cache: PromptCache | None = None
        ) -> tuple[list[int], GenerationEvent]:
    """A reply's tokens and its last event."""
    toks: list[int] = []
    last = None
    for ev in generate(lm, ids, params, n, drafter=drafter, prompt_cache=cache):
        if ev.token is not None:
            toks.append(ev.token)
        last = ev
    assert last is not None
    return toks, last


def plain(lm: LoadedModel, ids: list[int], n: int, cache: PromptCache | None = None
          ) -> list[int]:
    """The first n tokens of the plain (undrafted) greedy reply to `ids` in the model's KV
    mode; decoded (into `cache` when given: its prompt then stays for the next reply) only
    the first time a reply this long is asked for."""
    mode = lm.kv_settings.mode if lm.paged and lm.kv_settings is not None else "mlx"
    key = (id(lm), mode, tuple(ids))
    held = _plain.get(key)
    if held is None or len(held) < n:
        held, last = run(lm, ids, "off", n, cache=cache)
        assert last.drafted_tokens == 0
        _plain[key] = held
    return held[:n]
