"""Say whether MLX can compute on this Mac's GPU: the CI's first step, and a diagnosis aid.

Contract: `python packaging/metal_check.py` prints the GPU, macOS and MLX versions and the
metallib path, then one JSON line from engine.platform.check_gpu() and exits 0; when Metal does
not work it prints `strata: error: ...` (one line, last) and exits 1.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's engine


def main() -> int:
    import mlx.core as mx

    from engine.errors import StrataError
    from engine.platform import check_gpu, metallib_path

    if sys.platform == "darwin":
        gpu = subprocess.run(["system_profiler", "SPDisplaysDataType"], capture_output=True,
                             text=True).stdout
        chips = [line.strip() for line in gpu.splitlines() if "Chipset" in line or "Metal" in line]
        print("gpu:", "; ".join(chips) or "none reported")
        print("macOS", platform.mac_ver()[0], "| mlx", getattr(mx, "__version__", "?"), "|",
              metallib_path())
    try:
        print(json.dumps(check_gpu()))
    except StrataError as exc:
        print(f"strata: error: {exc}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
