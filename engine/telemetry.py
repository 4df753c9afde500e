"""Events and timelines that the CLI, the app and the benchmarks read.

Contract: plain frozen dataclasses and a `Timeline` of (phase, seconds) marks taken with
time.perf_counter(); no I/O, no Qt, no MLX. `Progress` and `CancelFlag` are the two callbacks
every long piece of work takes: progress(done, total), and a flag polled between steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

PROCESS_START = time.perf_counter()

Progress = Callable[[int, int], None]  # progress(done, total) of long work; it never prints
CancelFlag = Callable[[], bool]  # polled between steps: True stops the work


@dataclass
class Timeline:
    """Phases in order, each with its start and end on the perf_counter clock."""

    marks: list[tuple[str, float, float]] = field(default_factory=list)

    def add(self, phase: str, start: float, end: float | None = None) -> None:
        self.marks.append((phase, start, time.perf_counter() if end is None else end))

    def phase(self, name: str) -> _Phase:
        return _Phase(self, name)

    def durations(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self.marks:
            out[name] = out.get(name, 0.0) + (end - start)
        return out


class _Phase:
    def __init__(self, timeline: Timeline, name: str) -> None:
        self.timeline, self.name = timeline, name

    def __enter__(self) -> _Phase:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timeline.add(self.name, self.start)


@dataclass(frozen=True)
class GenerationEvent:
    """One step of a generation: a text delta and the running figures.

    `finish_reason` is None until the last event: 'stop' (EOS or a stop string), 'length'
    (max tokens) or 'cancelled'. `drafted_tokens` / `accepted_tokens`: speculative
    decoding's running counts (0 when it did not run).
    """

    text: str
    token: int | None
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float
    prefill_tps: float
    decode_tps: float
    peak_memory_bytes: int
    finish_reason: str | None = None
    # Speculative decoding: tokens drafted so far in this reply, and how many the target kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
