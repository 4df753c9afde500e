"""The prompt's partial last page and its logits on the SSD (engine.kv.tail), on the real
starter model and real files: a stored prompt restores whole in mlx-lm's cache and in the
paged modes (16 and 4 bits), so its first token needs no forward pass and the greedy reply
is the uncached one; a prompt with another question reuses the shared part of the tail; a
damaged tail record is never used; a restart through the real command line restores the
whole prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from engine.kv import KVSettings
from engine.kv.prefix import PrefixCache, PrefixSettings
from engine.kv.tail import SUFFIX
from engine.runtime.generate import LoadedModel, generate
from engine.runtime.sampling import SamplingParams
from engine.telemetry import Timeline
from tests.helpers import run_strata

GREEDY = SamplingParams(temperature=0)
PAGE = 128
SYSTEM = ("You keep the logbook of a lighthouse on a rocky island. Every night you write "
          "down the weather, the ships that passed and the state of the lamp. " * 9)


def _ids(lm: LoadedModel, question: str) -> list[int]:
    return lm.tokenizer.encode_chat([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": question}])


@contextmanager
def _mode(lm: LoadedModel, settings: KVSettings | None, folder: Path
          ) -> Iterator[PrefixCache]:
    old = lm.kv_settings
    if settings is not None:
        lm.kv_settings = settings
    pc = lm.enable_prefix_cache(PrefixSettings(folder=folder))
    try:
        yield pc
    finally:
        lm.disable_prefix_cache()
        lm.kv_settings = old


def _reply(lm: LoadedModel, ids: list[int], **kw: Any) -> tuple[list[int], Any]:
    tokens, last = [], None
    for ev in generate(lm, ids, GREEDY, 8, **kw):
        if ev.token is not None:
            tokens.append(ev.token)
        last = ev
    return tokens, last


MODES = {"mlx": None, "exact16": ("exact", 16), "sparse4": ("sparse", 4)}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_stored_prompt_restores_whole_and_answers_alike(
        mode: str, starter_lm: LoadedModel, tmp_path: Path) -> None:
    spec = MODES[mode]
    settings = None if spec is None else KVSettings(mode=spec[0], bits=spec[1],
                                                    ssd_dir=tmp_path / "kv")
    ids = _ids(starter_lm, "What did you write down last night?")
    assert len(ids) % PAGE and len(ids) > 2 * PAGE
    with _mode(starter_lm, settings, tmp_path / "px") as pc:
        want, first = _reply(starter_lm, ids)
        assert first.cached_tokens == 0
        pc.flush()
        assert len(list((tmp_path / "px").glob("*" + SUFFIX))) == 1
        timeline = Timeline()
        got, ev = _reply(starter_lm, ids, timeline=timeline)
        assert ev.cached_tokens == len(ids) and got == want
        assert ev.prefill_tps == 0.0  # no forward pass before the first token
        # Another question after the same system prompt: the shared part of the tail too.
        other = _ids(starter_lm, "Which ships passed the island?")
        shared = next(i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b)
        plain, _ = _reply(starter_lm, other, prefix_cache=False)
        got, ev = _reply(starter_lm, other)
        assert ev.cached_tokens == shared > (len(ids) // PAGE) * PAGE
        assert got == plain


@pytest.mark.parametrize("bits", [16, 8])
def test_a_prompt_ending_on_a_page_boundary_restores_whole(
        bits: int, starter_lm: LoadedModel, tmp_path: Path) -> None:
    # The prefill commits the prompt's last page (quantized at 8 bits): it is the tail.
    ids = _ids(starter_lm, "What did you write down last night?")
    ids = (ids * 3)[:3 * PAGE]
    settings = KVSettings(mode="exact", bits=bits, ssd_dir=tmp_path / "kv")
    with _mode(starter_lm, settings, tmp_path / "px") as pc:
        want, first = _reply(starter_lm, ids)
        assert first.cached_tokens == 0
        pc.flush()
        got, ev = _reply(starter_lm, ids)
        assert ev.cached_tokens == len(ids) and ev.prefill_tps == 0.0
        assert got == want


def test_a_damaged_tail_is_not_used(starter_lm: LoadedModel, tmp_path: Path) -> None:
    ids = _ids(starter_lm, "Was the lamp lit?")
    folder = tmp_path / "px"
    with _mode(starter_lm, None, folder) as pc:
        want, _ = _reply(starter_lm, ids)
        pc.flush()
        (path,) = folder.glob("*" + SUFFIX)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01  # a logit
        path.write_bytes(bytes(data))
        got, ev = _reply(starter_lm, ids)
        assert got == want and ev.cached_tokens == (len(ids) // PAGE) * PAGE
        pc.flush()  # removed when it failed, written again by that reply
        assert pc.lookup(ids) is not None and path.is_file()
        got, ev = _reply(starter_lm, ids)
        assert got == want and ev.cached_tokens == len(ids)


def test_a_restart_restores_the_whole_prompt(starter: dict[str, Any], strata_home: Path,
                                             tmp_path: Path) -> None:
    env = {"STRATA_PREFIX_DIR": str(tmp_path / "px")}
    args = ("generate", "--model", "starter", "--kv-mode", "exact", "--system", SYSTEM,
            "--prompt", "Was the sea calm?", "--temp", "0", "--max-tokens", "6", "--json")
    outs = []
    for _ in range(2):
        r = run_strata(*args, home=strata_home, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(json.loads(r.stdout))
    assert outs[0]["cached_tokens"] == 0
    assert outs[1]["cached_tokens"] == outs[1]["prompt_tokens"]
    assert outs[1]["text"] == outs[0]["text"]
