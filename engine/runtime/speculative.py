"""Speculative decoding: a drafter proposes the next tokens, the target checks them in one pass.

Contract: a drafter (`LookupDrafter`: n-gram matches against the prompt and the reply so far;
`ModelDrafter`: a library model with the target's vocabulary, greedy) proposes token ids;
`Speculator.step(tok, history, room)` feeds `tok` plus the drafts to the target in one
forward pass, samples every position with the reply's own sampler and keeps the drafts up to
the first one the target's sample disagrees with, then the target's token there. Drafts are
point masses, so "accept x when the target's sample is x, else emit that sample" is standard
speculative sampling (accept with p(x); on rejection a draw from p without x, renormalized):
greedy text is the plain decode's, sampled text keeps the target's distribution. Rejected
positions are trimmed from the cache (mlx-lm's KVCache trim, the paged cache's trim).
`for_reply` decides per reply whether speculation runs at all ("off", logits processors or a
repetition penalty: never), and the speculator decides per step how many tokens to draft
from the acceptance rate it has seen for that kind of proposal (a lookup continuing a copy
that has held for HELD tokens or a younger one, counting the tokens that copy has matched; a
fresh n-gram match; a draft model's) and the measured cost of a verify pass of each length
against a plain step (per model, timed once by `Speculator.calibrate` the first time a
reply could draft, after its first token, over a short cache of its own plus one plain step
at the reply's depth, then kept up to date by every pass), resting
(plain, pipelined decode) when drafting would be slower. The speculator reads a `CacheView`
(a prompt cache, or a row of the server's decode batch: alone it verifies through `step`;
beside other rows the batch runs one pass for all, the speculator choosing each row's
drafts and counting their outcome, `draft` and `settle`). Counts go to the reply's
stats (`drafted_tokens`, `accepted_tokens`).
`DraftModels` turns a setting ("auto", "off", "lookup" or a library model's name) into what
`generate` takes, loading a draft model once and keeping it while the target stays.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np

from engine.errors import StrataError
from engine.kv import SPARSE_MAX_L, trimmable
from engine.platform import blas_threads, set_blas_threads
from engine.runtime.sampling import LogitsProcessor, Sampler, SamplingParams
from engine.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:  # generate.py imports this module: the types only, for the checker
    from engine.runtime.generate import LoadedModel, PromptCache

K_MAX = 16  # draft tokens per verify pass, at most
# A verify pass of L tokens is assumed to cost 1 + SLOPE * (L - 1) plain steps until measured.
PRIOR_SLOPE = 0.25
PRIOR_ACCEPT = (1.0, 2.0)  # (accepted, reached) before any draft: acceptance 0.5
DECAY = 0.9  # per verify pass: the acceptance follows the reply as it goes on
MARGIN = 1.05  # drafting must promise this much over a plain step
PROBE_EVERY = 32  # plain tokens between two probes while resting
# A probe drafts this many: one token, always accepted, would raise the acceptance too slowly
# to ever pay where a verify pass costs much more than a plain step (this CPU under load).
PROBE_K = 4
# OpenBLAS threads for a verify pass (0: the process's own), unless the calibration finds the
# process's own count faster. A few-row matmul is too small to split on a few cores, and on a
# busy machine the spinning workers made a 9-token pass cost 8.8 plain steps on two threads
# against 2.1 on one (docs/benchmarks.md, issue 23); an idle machine may split it well.
VERIFY_BLAS_THREADS = 1
EMA = 0.3  # weight of a new timing
# Every RECHECK_EVERY verify passes one runs on the other BLAS thread count (the one the
# calibration did not pick), and verify passes move to it when it ran that length in under
# SWITCH x the time: the calibration picks from two 5-token passes in one moment, which on a
# shared machine can be a busy one (docs/benchmarks.md, issue 23's sixth pass: the idle
# summary's 1.71x and 2.27x runs kept the same drafts at different verify speeds). A recheck
# that loses doubles the interval, up to RECHECK_MAX, so a loaded machine pays little for it.
RECHECK_EVERY = 16
RECHECK_MAX = 256
SWITCH = 0.85
# A copy is "held" (priced by the long copies' acceptance) once it has matched this many
# tokens since a fresh search picked it; younger copies fail far more often (a summary's
# fresh matches into the wrong sentence hold for a few tokens, then part).
HELD = 8
# Each token a young copy has matched counts as this many accepted drafts in its price while
# the reply's young copies keep at least YOUNG_TRUST of their drafts (one each after that): a
# copy that has matched its first few tokens (it has never missed: a miss ends it) is, in an
# edit, nearly always a long one and should earn long drafts within a pass or two, while a
# summary's young copies (fresh matches into another sentence) part after a few tokens.
YOUNG_WEIGHT = 2
YOUNG_TRUST = 0.5
# Pass lengths timed once per model before its first draft, so the first reply drafts on
# measured costs, not a prior; each twice, the faster kept (a busy moment, or a shape's first
# call, is no cost). Longer passes are priced on the line through these until they run.
CALIBRATE = (1, 5, 9, 1, 5, 9)
# The calibration runs over a cache of its own holding this many of the reply's last tokens,
# not over the reply's: each timed pass reads the whole cache, and at an edit's 5.4k-token
# depth the ten passes cost 2-4 s of the first drafting reply. Its figures are ratios to a
# plain step at that short depth, the prior of each length until the reply's own passes and
# plain steps are timed (then the live figures price it, at the reply's depth).
CALIBRATE_DEPTH = 16
DRAFT_SETTINGS = ("auto", "off", "lookup")


class CacheView(Protocol):
    """What a speculator reads and trims: the target's layer caches and the ids they hold (a
    PromptCache, or one row of a decode batch)."""

    cache: Any  # the layer caches, in order
    tokens: list[int]


class DraftRefused(StrataError):
    """A draft model that cannot draft for this target (another vocabulary)."""


class Drafter(Protocol):
    """Proposes up to k token ids that follow `history` (prompt and reply so far)."""

    name: str

    def propose(self, history: Sequence[int], k: int) -> list[int]: ...

    def may_propose(self, history: Sequence[int]) -> bool:
        """Whether a proposal is possible once one more token follows `history` (False:
        the next step is a plain, pipelined one)."""
        ...

    def cost_per_token(self) -> float:
        """Seconds one drafted token costs (0 for lookup)."""
        ...


# -- drafters ----------------------------------------------------------------------------

class LookupDrafter:
    """Prompt lookup: the tokens that followed an earlier occurrence of the last n tokens
    (the latest one, n from max_n down to min_n), from the prompt or the reply itself. Once
    a draft is found, the copy it came from is followed: while the reply keeps matching the
    source, the next draft continues there without a new search (a copy stays on its line
    instead of jumping to the latest place a short n-gram occurs).

    The history is held as one numpy array and searched when asked, not indexed: an index of
    every n-gram cost 0.8 s and a dict entry per token per n at 128k tokens, paid on a
    reply's second token; a vectorized search of the last token's earlier places costs well
    under a millisecond there (docs/benchmarks.md). A history is taken as the one held when
    its first token and its last common tokens agree; were one to differ only in between,
    its drafts would come from the old text, and verification rejects what the target would
    not have said (drafts never change the reply)."""

    name = "lookup"
    CHECK = 64  # trailing tokens compared to tell a grown history from another one

    def __init__(self, min_n: int = 3, max_n: int = 8) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._buf = np.zeros(0, np.int64)
        self._h = 0  # tokens of _buf that are the history
        # The copy followed: token src was predicted to be the one at position at; it was
        # picked (by a fresh search) when the history ended at `_picked`.
        self._src: int | None = None
        self._at = 0
        self._picked = 0

    def _extend(self, history: Sequence[int]) -> None:
        n = len(history)
        c = min(self._h, n)
        lo = max(0, c - self.CHECK)
        if c and (history[0] != self._buf[0]
                  or not np.array_equal(self._buf[lo:c], np.asarray(history[lo:c]))):
            c = 0  # another history (a new prompt): taken afresh, no copy followed
            self._src = None
        if n > len(self._buf):
            buf = np.zeros(max(n, 2 * len(self._buf), 256), np.int64)
            buf[:c] = self._buf[:c]
            self._buf = buf
        if n > c:
            self._buf[c:n] = np.asarray(history[c:n])
        self._h = n

    def _latest(self, lo_n: int, hi_n: int) -> int | None:
        """The latest end (exclusive, before the history's last position) of an earlier
        occurrence of the history's last n tokens, for the largest n in [lo_n, hi_n] that
        has one; None if none has."""
        a, h = self._buf, self._h
        if h < max(lo_n, 1) + 1:
            return None
        at = np.flatnonzero(a[:h - 1] == a[h - 1])  # the n-grams' last tokens: ends at + 1
        found = None
        for j in range(1, hi_n + 1):
            if j >= lo_n and len(at):
                found = int(at[-1]) + 1
            if j == hi_n or not len(at) or h - 1 - j < 0:
                break
            at = at[at >= j]
            at = at[a[at - j] == a[h - 1 - j]]
        return found

    def _aligned(self) -> int | None:
        """Where the followed copy continues, if every token since it was picked matched."""
        src, at, a, h = self._src, self._at, self._buf, self._h
        if src is None:
            return None
        n = h - at
        if n < 0 or src + n >= at or not np.array_equal(a[src:src + n], a[at:h]):
            return None
        return src + n

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(history) <= self.min_n:
            return []
        self._extend(history)
        h = self._h
        src = self._aligned()
        if src is None:
            src = self._latest(self.min_n, self.max_n)
            self._picked = h
        if src is None:
            self._src = None
            return []
        self._src, self._at = src, h
        return [int(t) for t in self._buf[src:min(src + k, h)]]

    def following(self, history: Sequence[int]) -> bool:
        """Whether a proposal after `history` continues the copy followed so far (every
        token since it was picked matched) rather than starting from a fresh search: the two
        are kept apart by the speculator, a fresh n-gram match being right far less often."""
        return self.held(history) >= 0

    def held(self, history: Sequence[int]) -> int:
        """How many tokens the copy followed has matched since a fresh search picked it
        (-1: the reply left it, the next proposal searches afresh)."""
        self._extend(history)
        return self._h - self._picked if self._aligned() is not None else -1

    def may_propose(self, history: Sequence[int]) -> bool:
        m = self.min_n - 1
        if len(history) < max(m, 1) + 1:
            return False
        if m == 0:
            return True
        self._extend(history)
        return self._aligned() is not None or self._latest(m, m) is not None

    def cost_per_token(self) -> float:
        return 0.0


def vocabulary_key(tok: Tokenizer) -> str:
    """A digest of a tokenizer's vocabulary (pieces, ids, added tokens): equal keys, same ids
    for the same text."""
    folder = tok.folder
    h = hashlib.sha256()
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = (data.get("model") or {}).get("vocab")
        h.update(json.dumps(vocab, sort_keys=True).encode())
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
        h.update(json.dumps(added).encode())
    elif (folder / "tokenizer.model").is_file():
        h.update((folder / "tokenizer.model").read_bytes())
    h.update(str(tok.vocab_size).encode())
    return h.hexdigest()


class ModelDrafter:
    """A smaller (or lower-bit) library model with the target's vocabulary drafts greedily
    over its own prompt cache, trimmed to the history it is asked about."""

    def __init__(self, target: LoadedModel, draft: LoadedModel) -> None:
        if vocabulary_key(draft.tokenizer) != vocabulary_key(target.tokenizer):
            raise DraftRefused(
                f"draft model {draft.manifest['name']}: its vocabulary "
                f"({draft.tokenizer.vocab_size} tokens) is not the vocabulary of "
                f"{target.manifest['name']} ({target.tokenizer.vocab_size} tokens)")
        self.name = str(draft.manifest["name"])
        self.lm = draft
        self.pc: PromptCache = draft.new_cache()
        self._limit = target.tokenizer.vocab_size
        self._cost = 0.0

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        t0 = time.perf_counter()
        pc, model = self.pc, self.lm.model
        common = pc.reuse(history)
        todo = list(history[common:])
        logits = None
        for i in range(0, len(todo), 512):
            logits = model(mx.array(todo[i:i + 512])[None], cache=pc.cache)
            if i + 512 < len(todo):
                mx.eval([c.state for c in pc.cache])
        pc.tokens.extend(todo)
        assert logits is not None  # reuse leaves at least one token to run
        out: list[int] = []
        y: Any = mx.argmax(logits[:, -1, :], axis=-1)
        for _ in range(k):
            d = int(y.item())
            if d >= self._limit:
                break  # a padded row of the draft's embedding: no token of the target's
            out.append(d)
            if len(out) == k:
                break
            y = mx.argmax(model(mx.array([[d]]), cache=pc.cache)[:, -1, :], axis=-1)
            pc.tokens.append(d)
        n = max(len(out), 1)
        dt = (time.perf_counter() - t0) / n
        self._cost = dt if self._cost == 0 else (1 - EMA) * self._cost + EMA * dt
        return out

    def cost_per_token(self) -> float:
        return self._cost

    def may_propose(self, history: Sequence[int]) -> bool:
        return True

    def close(self) -> None:
        self.pc.close()


class DraftModels:
    """A draft setting resolved for a target: "auto", "off" and "lookup" pass through; a
    library model's name becomes a ModelDrafter, loaded by `load` once and kept while the
    target and the name stay (another target, name or setting closes it)."""

    def __init__(self, load: Callable[[str], LoadedModel]) -> None:
        self._load = load
        self._held: tuple[weakref.ref[Any], str, ModelDrafter] | None = None

    def drafter(self, target: LoadedModel, setting: str) -> str | Drafter:
        """What `generate(drafter=...)` takes for `setting`; DraftRefused (one line) for a
        draft model of another vocabulary, the library's error for an unknown name."""
        if setting in DRAFT_SETTINGS:
            self.close()  # a draft model no longer chosen gives its memory back
            return setting
        held = self._held
        if held is not None and held[0]() is target and held[1] == setting:
            return held[2]
        self.close()
        d = ModelDrafter(target, self._load(setting))
        self._held = (weakref.ref(target), setting, d)
        return d

    def close(self) -> None:
        """Drop the draft model held (its prompt cache with it)."""
        if self._held is not None:
            self._held[2].close()
            self._held = None


# -- costs and policy --------------------------------------------------------------------

@dataclass
class StepCosts:
    """Seconds of a target forward pass (plus sampling) of L tokens, measured per model."""

    seconds: dict[int, float] = field(default_factory=dict)  # timed in replies' decodes
    threads: int = VERIFY_BLAS_THREADS  # BLAS threads of a verify pass (0: the process's)
    calibrated: bool = False  # whether `Speculator.calibrate` has timed this model
    # Plain steps a pass of L tokens cost in the calibration (at CALIBRATE_DEPTH): a length's
    # price until a reply's own passes and plain steps have both been timed.
    prior: dict[int, float] = field(default_factory=dict)
    prior_one: float = 0.0  # seconds of the calibration's plain step
    # Verify passes on the other thread count (RECHECK_EVERY), by length; passes since the
    # last of them, and the passes between two of them now.
    other: dict[int, float] = field(default_factory=dict)
    since_recheck: int = 0
    recheck_every: int = RECHECK_EVERY

    def add(self, length: int, seconds: float) -> None:
        old = self.seconds.get(length)
        self.seconds[length] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def verify_threads(self, own: int | None) -> tuple[int, bool]:
        """(BLAS threads for the next verify pass, 0 the process's own; whether it rechecks
        the other count) for a process whose own count is `own` (None: not OpenBLAS)."""
        if own is None or VERIFY_BLAS_THREADS <= 0 or own == VERIFY_BLAS_THREADS:
            return self.threads, False
        self.since_recheck += 1
        if self.since_recheck < self.recheck_every:
            return self.threads, False
        self.since_recheck = 0
        return (0 if self.threads > 0 else VERIFY_BLAS_THREADS), True

    def add_other(self, length: int, seconds: float) -> None:
        """A verify pass of `length` timed on the other thread count: switch to it when it
        beats this count's running figure for that length by SWITCH."""
        old = self.other.get(length)
        self.other[length] = seconds if old is None else (1 - EMA) * old + EMA * seconds
        mine = self.seconds.get(length)
        if mine is None:
            return
        if self.other[length] >= SWITCH * mine:
            self.recheck_every = min(2 * self.recheck_every, RECHECK_MAX)
            return
        self.threads = 0 if self.threads > 0 else VERIFY_BLAS_THREADS
        # Each count's pass timings go with it (plain steps stay: their count is unchanged).
        mine_now = {n: t for n, t in self.seconds.items() if n > 1}
        self.seconds = {n: t for n, t in self.seconds.items() if n == 1} | self.other
        self.other = mine_now
        self.recheck_every = RECHECK_EVERY

    def one(self) -> float | None:
        """Seconds of a plain step: timed in a reply, else the calibration's (None: neither)."""
        return self.seconds.get(1) or self.prior_one or None

    def ratio(self, length: int) -> float:
        """Cost of a pass of `length` tokens in plain steps: measured in replies, else the
        calibration's, else on the line through the lengths priced so far (the prior slope
        before any)."""
        one, this = self.seconds.get(1), self.seconds.get(length)
        if one is not None and this is not None:
            # Never below one step: a lower figure is a plain step timed in a busy moment,
            # and it would price failing drafts as free.
            return max(this / one, 1.0)
        if length in self.prior:
            return max(self.prior[length], 1.0)
        slope = PRIOR_SLOPE
        # Least squares through (1, 1): a length never tried is priced by the others.
        pts = [(n - 1, t / one - 1) for n, t in self.seconds.items() if n > 1] if one else []
        pts += [(n - 1, r - 1) for n, r in self.prior.items()
                if n > 1 and (one is None or n not in self.seconds)]
        if pts:
            slope = max(sum(x * y for x, y in pts) / sum(x * x for x, _ in pts), 0.0)
        return 1 + slope * (length - 1)


_COSTS: weakref.WeakKeyDictionary[Any, StepCosts] = weakref.WeakKeyDictionary()


def costs_of(lm: LoadedModel) -> StepCosts:
    """The model's measured step costs (kept across replies while the model is loaded)."""
    c = _COSTS.get(lm)
    if c is None:
        c = _COSTS[lm] = StepCosts()
    return c


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a verify pass yields with k drafts, each accepted with `alpha` after the last."""
    return sum(alpha ** i for i in range(k + 1))


class Speculator:
    """One reply's speculation over the target's cache: drafts, verifies, trims, decides."""

    def __init__(self, lm: LoadedModel, drafter: Drafter, sampler: Sampler, pc: CacheView,
                 forward: Callable[[Any], Any], stats: dict[str, Any], forced: bool,
                 k_max: int = K_MAX) -> None:
        self.lm, self.drafter, self.sampler, self.pc = lm, drafter, sampler, pc
        self.forward, self.stats, self.forced, self.k_max = forward, stats, forced, k_max
        self.costs = costs_of(lm)
        # (accepted, reached) per kind of proposal: "follow" (a lookup continuing a copy that
        # has held for HELD tokens, which a summary keeps for dozens), "young" (one that has
        # held for fewer), "fresh" (a new n-gram match, often wrong once the reply
        # paraphrases) and "model".
        self.acceptance = {kind: list(PRIOR_ACCEPT)
                           for kind in ("follow", "young", "fresh", "model")}
        self._since_probe = 0
        self._probe = False
        self.calibrated_s = 0.0  # what `calibrate` took for this reply (0: measured before)
        self._plain: list[float] = []  # the last two plain steps the decode loop timed
        self._held = 0  # tokens the copy of the latest `kind` call has matched
        stats.setdefault("drafted_tokens", 0)
        stats.setdefault("accepted_tokens", 0)

    @staticmethod
    def _timed(lm: LoadedModel, cache: list[Any], n: int, tok: int, threads: int) -> float:
        """Seconds of one forward pass of n tokens over `cache` on `threads` BLAS threads
        (0: the process's own), trimmed from the cache at once."""
        old = blas_threads() if threads > 0 else None
        if old is not None and old != threads:
            set_blas_threads(threads)
        try:
            t0 = time.perf_counter()
            mx.eval(lm.model(mx.array([[tok] * n]), cache=cache)[:, -1, :])
            dt = time.perf_counter() - t0
        finally:
            if old is not None and old != threads:
                set_blas_threads(old)
        for c in cache:
            c.trim(n)
        return dt

    def calibrate(self, at_depth: bool = True) -> float:
        """Time forward passes of the CALIBRATE lengths, once per model, over a cache of its
        own holding the reply's last CALIBRATE_DEPTH tokens (what a pass costs at the reply's
        depth is timed by the reply's own passes): plain length on the process's BLAS threads,
        longer ones on the verify passes' (VERIFY_BLAS_THREADS or the process's own, whichever
        ran a 5-token pass faster here). `at_depth`: also time a plain step over the reply's
        own cache (False for a row of a decode batch of several, whose cache a one-row pass
        cannot run over). The seconds it took (0 when already measured)."""
        if self.costs.calibrated:
            return 0.0
        self.costs.calibrated = True
        t_start = time.perf_counter()
        tokens = list(self.pc.tokens[-CALIBRATE_DEPTH:]) or [0]
        own_cache = self.lm.new_cache()
        try:
            cache = own_cache.cache
            mx.eval(self.lm.model(mx.array(tokens)[None], cache=cache))
            self._calibrate_over(cache, tokens[-1])
        finally:
            own_cache.close()
        # The one point at the reply's depth: a plain step over its own cache, twice (the
        # faster kept), so the ratios above scale from the step this reply really takes
        # (a reply that drafts every step times no plain step of its own). The reply's own
        # last two plain steps when it has taken them (`plain_timed`): at 128k restored
        # tokens two more steps held its first draft back 1.4 s (docs/benchmarks.md).
        if at_depth and all(trimmable(c, 1) for c in self.pc.cache):
            one = (min(self._plain) if len(self._plain) == 2
                   else min(self._timed_here(tokens[-1]) for _ in range(2)))
            self.costs.add(1, one)
        return time.perf_counter() - t_start

    def plain_timed(self, seconds: float) -> None:
        """A plain step the decode loop ran (not through `step`) took `seconds` from its
        build to its token, nothing else queued meanwhile: kept for `calibrate`."""
        self._plain = [*self._plain[-1:], seconds]

    def _timed_here(self, tok: int) -> float:
        """Seconds of one plain step over the reply's cache, trimmed from it at once."""
        t0 = time.perf_counter()
        mx.eval(self.forward(mx.array([[tok]]))[:, -1, :])
        dt = time.perf_counter() - t0
        for c in self.pc.cache:
            c.trim(1)
        return dt

    def _calibrate_over(self, cache: list[Any], tok: int) -> None:
        lm = self.lm
        lengths = [n for n in CALIBRATE if n - 1 <= self.k_max
                   and all(trimmable(c, n) for c in cache)]
        if not lengths:
            return
        choices = [VERIFY_BLAS_THREADS]
        own = blas_threads()
        if VERIFY_BLAS_THREADS > 0 and own is not None and own != VERIFY_BLAS_THREADS:
            choices.append(0)
        probe = min(lengths[-1], 5)
        if len(choices) > 1:
            best: dict[int, float] = {}
            for _ in range(2):  # interleaved: a busy moment hits both
                for th in choices:
                    dt = self._timed(lm, cache, probe, tok, th)
                    best[th] = min(best.get(th, dt), dt)
            self.costs.threads = min(choices, key=lambda th: best[th])
        seconds: dict[int, float] = {}
        for n in lengths:
            dt = self._timed(lm, cache, n, tok, self.costs.threads if n > 1 else 0)
            seconds[n] = min(seconds.get(n, dt), dt)
        # A plain step never costs more than a longer pass: a higher figure is a busy moment
        # (seen: 1.0 s twice at load 12, against 0.28 s for 5 tokens), and it would price
        # every pass as free.
        one = min(seconds.values()) if seconds else None
        if one:
            self.costs.prior_one = one
            self.costs.prior.update({n: dt / one for n, dt in seconds.items()})

    def kind(self, history: Sequence[int]) -> str:
        """Which acceptance prices the proposal that follows `history`."""
        held = getattr(self.drafter, "held", None)
        if held is None:
            return "model"
        m = held(history)
        self._held = max(m, 0)
        return "fresh" if m < 0 else "follow" if m >= HELD else "young"

    def alpha(self, kind: str = "model") -> float:
        """The acceptance a proposal of `kind` is priced at: the kind's running rate, and for
        a copy the tokens it has matched so far too (the latest `kind` call's copy), as that
        many accepted drafts (a young copy's YOUNG_WEIGHT times as many while young copies
        keep YOUNG_TRUST of their drafts): a copy that has held for 30 tokens drafts long at
        once."""
        accepted, reached = self.acceptance[kind]
        if kind in ("follow", "young"):
            trusted = kind == "young" and accepted >= YOUNG_TRUST * reached
            held = self._held * (YOUNG_WEIGHT if trusted else 1)
            return (accepted + held) / (reached + held)
        return accepted / reached

    def best_k(self, limit: int, kind: str = "model") -> int:
        """The draft length with the most tokens per second for a proposal of `kind` (0: a
        plain step is faster)."""
        if limit <= 0:
            return 0
        alpha = self.alpha(kind)
        one = self.costs.one()
        per_draft = self.drafter.cost_per_token() / one if one else 0.0
        best, best_gain = 0, MARGIN if not self.forced else 0.0
        for k in range(1, limit + 1):
            gain = expected_tokens(alpha, k) / (self.costs.ratio(k + 1) + k * per_draft)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def rest(self, history: Sequence[int]) -> bool:
        """Whether the next step is a plain (pipelined) one: no draft is possible after the
        next token, or drafting would not pay. Called once per token before that token is
        known; every PROBE_EVERY resting tokens a draft of PROBE_K is tried again."""
        if not self.drafter.may_propose(history):
            return True
        if (self.forced or not self.costs.calibrated
                or self.best_k(self.k_max, self.kind(history)) > 0):
            return False
        self._since_probe += 1
        if self._since_probe >= PROBE_EVERY:
            self._since_probe = 0
            self._probe = True
            return False
        return True

    def step(self, tok: int, history: list[int], room: int) -> tuple[list[int], Any]:
        """Feed `tok` (the history's last token) and drafts; (accepted drafts, now in the
        cache and in pc.tokens, and the lazy next token, which is not)."""
        cache = self.pc.cache
        drafts, kind = self.draft(history, room)
        t0 = time.perf_counter()
        if not drafts:
            ys = self.sampler(self.forward(mx.array([[tok]]))[0], history)
            mx.eval(ys)
            self.costs.add(1, time.perf_counter() - t0)
            self.pc.tokens.append(tok)
            return [], ys
        # Nothing is in flight here (a verify step follows a known token): the thread count
        # changes between passes, never during one.
        own = blas_threads()
        want, recheck = self.costs.verify_threads(own)
        threads = own if want > 0 else None
        if threads is not None and threads != want:
            set_blas_threads(want)
        try:
            out = self.sampler(self.forward(mx.array([[tok, *drafts]]))[0], history).tolist()
        finally:
            if threads is not None and threads != want:
                set_blas_threads(threads)
        dt = time.perf_counter() - t0
        (self.costs.add_other if recheck else self.costs.add)(len(drafts) + 1, dt)
        a = 0
        while a < len(drafts) and out[a] == drafts[a]:
            a += 1
        reject = len(drafts) - a
        if reject:
            for c in cache:
                c.trim(reject)
        self.pc.tokens.extend([tok, *drafts[:a]])
        self.settle(kind, len(drafts), a)
        return drafts[:a], mx.array(out[a:a + 1], dtype=mx.uint32)

    def draft(self, history: Sequence[int], room: int, at_depth: bool = True
              ) -> tuple[list[int], str]:
        """The drafts to verify after `history` (its last token the one fed next; none: a
        plain step pays more) and the kind of proposal they are, with at most room - 1 of
        them; calibrates first the first time a draft is possible (`at_depth` as there)."""
        if not self.costs.calibrated and self.drafter.may_propose(history):
            # Here, the first time a draft is possible, not before the first token: a
            # reply that never repeats anything never pays it, and no first token waits.
            self.calibrated_s += self.calibrate(at_depth)
        k = 0
        kind = self.kind(history)
        if ((self.forced or self.costs.one() is not None)
                and all(trimmable(c, self.k_max) for c in self.pc.cache)):
            k = (min(PROBE_K, self.k_max, room - 1) if self._probe
                 else self.best_k(min(self.k_max, room - 1), kind))
            self._probe = False
        return (self.drafter.propose(history, k) if k else []), kind

    def settle(self, kind: str, drafted: int, accepted: int) -> None:
        """Count a verify pass's outcome: `accepted` of `drafted` drafts of `kind` kept."""
        acc = self.acceptance[kind]
        acc[0] = acc[0] * DECAY + accepted
        acc[1] = acc[1] * DECAY + min(accepted + 1, drafted)
        self.stats["drafted_tokens"] += drafted
        self.stats["accepted_tokens"] += accepted


def for_reply(lm: LoadedModel, drafter: str | Drafter | None, params: SamplingParams,
              processors: Sequence[LogitsProcessor], sampler: Sampler, pc: CacheView,
              forward: Callable[[Any], Any], stats: dict[str, Any]) -> Speculator | None:
    """The reply's speculator, or None for plain decoding: drafter "off" (or None), logits
    processors or a repetition penalty (they need each token before the next is drafted), or
    a cache that cannot trim. "auto" drafts by prompt lookup when it pays; "lookup" or a
    Drafter (a ModelDrafter) always drafts."""
    if drafter is None or drafter == "off" or processors or params.repetition_penalty != 1.0:
        return None
    if isinstance(drafter, str):
        if drafter not in DRAFT_SETTINGS:
            raise StrataError(f"draft setting {drafter!r}: expected one of "
                              f"{', '.join(DRAFT_SETTINGS)} or a draft model")
        forced = drafter == "lookup"
        drafter = LookupDrafter()
    else:
        forced = True
    if not all(trimmable(c, 1) for c in pc.cache):
        return None
    k_max = K_MAX
    if lm.paged and lm.kv_settings is not None and lm.kv_settings.mode == "sparse":
        k_max = SPARSE_MAX_L - 1  # the sparse attention takes at most this many queries
    return Speculator(lm, drafter, sampler, pc, forward, stats, forced, k_max)
