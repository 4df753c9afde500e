#!/bin/sh
# Install llama.cpp's Python binding (llama-cpp-python, the reference the tests compare GGUF
# imports against and a peer in `strata bench`) into the virtual environment, and unpack
# llama.cpp's real vocabulary files and chat templates (models/ggml-vocab-*.gguf,
# models/templates/*.jinja: the tokenizer tests' inputs).
# PyPI has only its source: it is built once (about 2.5 minutes on 2 cores) into a wheel kept
# in the user cache, so later installs take seconds. Usage: scripts/llama-cpp.sh VENV_PYTHON
set -e
PY="${1:?usage: scripts/llama-cpp.sh VENV_PYTHON}"
VERSION=0.3.36
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/strata"
SRC="$CACHE/src"
WHEELS="$CACHE/wheels"
VOCAB="$CACHE/llama.cpp/models"
SDIST="$SRC/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$SRC" "$WHEELS" "$VOCAB"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
fi
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "llama-cpp: building llama-cpp-python $VERSION from source (once; a few minutes)" >&2
  # Native CPU code for this machine (the wheel stays in this machine's cache); no examples,
  # tools or multimodal library: the binding needs only libllama and ggml.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    "$PY" -m pip wheel -q --no-deps "$SDIST" -w "$WHEELS"
fi
"$PY" -m pip install -q --no-deps --find-links "$WHEELS" "llama-cpp-python==$VERSION"
# llama-cpp-python's own dependencies (small, pure Python wheels).
"$PY" -m pip install -q "diskcache>=5.6.1" "typing-extensions>=4.5.0" >/dev/null
if ! ls "$VOCAB"/ggml-vocab-*.gguf "$VOCAB"/templates/*.jinja >/dev/null 2>&1; then
  tar -xzf "$SDIST" -C "$VOCAB" --strip-components=4 --wildcards \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/models/ggml-vocab-*" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates/*"
fi
