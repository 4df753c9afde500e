#!/bin/sh
# Build Strata with PyInstaller (what `make app` runs).
#   macOS arm64: dist/Strata.app, ad-hoc signed (packaging/sign_and_notarize.sh signs for real)
#   Linux:       dist/Strata/ (one folder; run dist/Strata/Strata)
# PY names the virtual environment's python (default .venv/bin/python).
set -eu
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

"$PY" -c "import PyInstaller" 2>/dev/null || "$PY" -m pip install -q -e ".[package]"

if [ "$(uname -s)" = "Darwin" ]; then
  # mlx-metal ships one wheel per macOS release, each with a metallib built for it; a
  # metallib built for a newer macOS does not load on an older one. Bundle the oldest
  # (Strata's minimum, macOS 14) so the app runs everywhere it says it does.
  MIN_TAG=macosx_14_0_arm64
  VER=$("$PY" -c "from importlib.metadata import version; print(version('mlx-metal'))")
  TAG=$("$PY" -c "from importlib.metadata import distribution as d; \
print([l.split(': ')[1] for l in d('mlx-metal').read_text('WHEEL').splitlines() \
if l.startswith('Tag: ')][0])")
  case "$TAG" in
    *"$MIN_TAG") ;;
    *)
      echo "build: replacing mlx-metal $VER ($TAG) with its $MIN_TAG wheel" >&2
      tmp=$(mktemp -d)
      "$PY" -m pip download -q --no-deps --only-binary=:all: --platform "$MIN_TAG" \
        -d "$tmp" "mlx-metal==$VER"
      "$PY" -m pip install -q --no-deps --force-reinstall "$tmp"/mlx_metal-*.whl
      rm -rf "$tmp"
      ;;
  esac
fi

"$PY" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath dist --workpath build packaging/strata.spec

if [ "$(uname -s)" = "Darwin" ]; then
  # PyInstaller signs each binary ad hoc; sign the bundle as a whole so its seal is valid.
  codesign --force --deep -s - dist/Strata.app
  codesign --verify --deep --strict dist/Strata.app
  echo "build: dist/Strata.app ($(du -sh dist/Strata.app | cut -f1))"
else
  echo "build: dist/Strata/ ($(du -sh dist/Strata | cut -f1)); run dist/Strata/Strata"
fi
