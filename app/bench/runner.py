"""Runs `strata bench` in a child process for the benchmark tab, and keeps its results.

Contract: `BenchRunner.start(models, suite, options)` runs `python -m app bench ... --json
STRATA_HOME/bench/<time>.json` in a QProcess (the bench already runs each subject in its own
process, so the engine thread stays free for chat). It emits `progressed(percent, label)`
from the bench's progress lines and `finished(path, result)` when the child ends, with the
partial result after `cancel()` (SIGTERM: the bench keeps what finished). `history(home)`
lists earlier results, newest first.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal, Slot

REPO = Path(__file__).resolve().parents[2]
PROGRESS = re.compile(r"^bench:\s+(\d+)% (.*)$")


def bench_dir(home: Path) -> Path:
    return Path(home) / "bench"


def history(home: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Readable results under STRATA_HOME/bench, newest first (unreadable files skipped)."""
    out: list[tuple[Path, dict[str, Any]]] = []
    for path in sorted(bench_dir(home).glob("*.json"), reverse=True):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        schema = str(doc.get("schema", "")) if isinstance(doc, dict) else ""
        # strata-bench/2: the quick and full suites; strata-bench-spec/1: bench spec's.
        if schema.startswith(("strata-bench/2", "strata-bench-spec/1")):
            out.append((path, doc))
    return out


def command_args(models: list[str], suite: str, out: Path, trials: int | None = None,
                 peers: list[str] | None = None, extra: list[str] | None = None) -> list[str]:
    """Arguments after `python`, the same as `strata bench` on the command line."""
    args = ["-m", "app", "bench", suite, "--model", ",".join(models), "--json", str(out)]
    if trials:
        args += ["--trials", str(trials)]
    args += ["--peers", ",".join(peers) if peers else "none"]
    return args + list(extra or [])


class BenchRunner(QObject):
    started = Signal(str)  # the output path
    progressed = Signal(int, str)  # percent, what runs now
    finished = Signal(str, object)  # path, result dict (None if the bench wrote nothing)
    failed = Signal(str)  # one line: why the bench could not run

    def __init__(self, home: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.home = Path(home)
        self.process: QProcess | None = None
        self.out: Path | None = None
        self._errors: list[str] = []

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, models: list[str], suite: str, trials: int | None = None,
              peers: list[str] | None = None, extra: list[str] | None = None) -> Path:
        if self.process is not None:
            raise RuntimeError("a benchmark is already running")
        bench_dir(self.home).mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = bench_dir(self.home) / f"{stamp}-{suite}.json"
        n = 1
        while self.out.exists():
            n += 1
            self.out = bench_dir(self.home) / f"{stamp}-{suite}-{n}.json"
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        env.insert("STRATA_HOME", str(self.home))  # the app's library, not the default one
        proc.setProcessEnvironment(env)
        proc.setWorkingDirectory(str(REPO))
        proc.readyReadStandardError.connect(self._on_stderr_ready)
        proc.finished.connect(self._on_process_finished)
        self.process, self._errors = proc, []
        proc.start(sys.executable, command_args(models, suite, self.out, trials, peers, extra))
        self.started.emit(str(self.out))
        return self.out

    def cancel(self) -> None:
        """Stop at once, keeping what finished (the bench handles SIGTERM like Ctrl-C)."""
        if self.process is not None:
            self.process.terminate()

    def shutdown(self, timeout_ms: int = 10_000) -> None:
        if self.process is not None:
            self.process.terminate()
            if not self.process.waitForFinished(timeout_ms):
                self.process.kill()
                self.process.waitForFinished(timeout_ms)

    @Slot()
    def _on_stderr_ready(self) -> None:
        assert self.process is not None
        text = bytes(self.process.readAllStandardError().data()).decode(errors="replace")
        for line in text.splitlines():
            m = PROGRESS.match(line.strip())
            if m:
                self.progressed.emit(int(m.group(1)), m.group(2))
            elif line.strip():
                self._errors.append(line.strip())

    @Slot(int, QProcess.ExitStatus)
    def _on_process_finished(self, code: int, _status: QProcess.ExitStatus) -> None:
        proc, out = self.process, self.out
        self.process = None
        if proc is not None:
            proc.deleteLater()
        result = None
        if out is not None and out.is_file():
            try:
                result = json.loads(out.read_text())
            except (OSError, ValueError):
                result = None
        if result is None:
            errors = [e for e in self._errors if e.startswith("strata: error:")]
            line = (errors or self._errors or [f"the benchmark exited with code {code}"])[-1]
            self.failed.emit(line.removeprefix("strata: error: "))
            return
        self.finished.emit(str(out), result)
