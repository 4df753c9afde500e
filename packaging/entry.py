"""The packaged app's entry point: Strata.app/Contents/MacOS/Strata and dist/Strata/Strata.

Contract: with no arguments it opens the window, as `strata` does; with arguments it is the
`strata` command line (`--smoke`, `generate`, `serve`, ...). `Strata -m MODULE ARGS...` runs
a bundled module as `python -m` would, because the engine re-runs itself that way
(`sys.executable -m engine.bench.worker`) and a frozen sys.executable is this program. On
macOS it first checks that MLX can run Metal kernels and, if not, exits 1 with one line on
stderr (and a dialog when the window was wanted) rather than running on the CPU unnoticed;
STRATA_DEVICE=cpu skips the check and runs on the CPU on purpose.
"""

from __future__ import annotations

import sys


def _alert(message: str) -> None:
    """Show the start-up failure in a dialog: a double-clicked app has no visible stderr."""
    try:
        from PySide6.QtWidgets import QApplication, QMessageBox

        qapp = QApplication.instance() or QApplication(sys.argv[:1])
        QMessageBox.critical(None, "Strata cannot start", message)
        del qapp
    except Exception:  # noqa: BLE001  (the line on stderr is the report; this is a courtesy)
        pass


def main() -> int:
    # Finder on older macOS adds -psn_0_NNN (a process serial number) to argv.
    argv = [a for a in sys.argv[1:] if not a.startswith("-psn_")]
    if len(argv) >= 2 and argv[0] == "-m":
        import runpy

        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return 0
    import engine  # noqa: F401  (loads the Linux BLAS shim before anything imports MLX)
    from engine.errors import StrataError

    if sys.platform == "darwin" and "--help" not in argv and "-h" not in argv:
        from engine.platform import check_gpu

        try:
            check_gpu()
        except StrataError as exc:
            print(f"strata: error: {exc}", file=sys.stderr, flush=True)
            if not argv:
                _alert(str(exc))
            return 1
    from app.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
