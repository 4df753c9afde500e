#!/bin/sh
# Install llama.cpp's Python binding (llama-cpp-python, the reference the tests compare GGUF
# imports against and a peer in `strata bench`) into the virtual environment, and unpack
# llama.cpp's real vocabulary files and chat templates (models/ggml-vocab-*.gguf,
# models/templates/*.jinja: the tokenizer tests' inputs).
# PyPI has only its source: it is built once (2.5 to 7 minutes on 2 cores) into a wheel kept
# in the user cache, so later installs take seconds. Usage: scripts/llama-cpp.sh VENV_PYTHON
# The build targets AVX2 (GGML_NATIVE=OFF), not the build machine: a native build on a Xeon
# that reports AMX compiles llama.cpp's AMX kernels in, and on these VMs every Q8_0/Q4_K
# decode through them segfaults (exit -11; F32 files are unaffected). The wheel folder is
# named by that flavour so a native wheel cached by an older script is never reused.
set -e
PY="${1:?usage: scripts/llama-cpp.sh VENV_PYTHON}"
VERSION=0.3.36
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/strata"
SRC="$CACHE/src"
FLAVOUR=avx2
WHEELS="$CACHE/wheels/$FLAVOUR"
VOCAB="$CACHE/llama.cpp/models"
SDIST="$SRC/llama_cpp_python-$VERSION.tar.gz"
mkdir -p "$SRC" "$WHEELS" "$VOCAB"
if [ ! -f "$SDIST" ]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
fi
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "llama-cpp: building llama-cpp-python $VERSION from source (once; a few minutes)" >&2
  # AVX2/FMA/F16C code (every x86-64 CI and developer machine has it); no examples, tools or
  # multimodal library: the binding needs only libllama and ggml.
  CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    "$PY" -m pip wheel -q --no-deps "$SDIST" -w "$WHEELS"
fi
# --force-reinstall: the same version built by an older script (native) must be replaced.
"$PY" -m pip install -q --no-deps --force-reinstall --find-links "$WHEELS" "llama-cpp-python==$VERSION"
# llama-cpp-python's own dependencies (small, pure Python wheels).
"$PY" -m pip install -q "diskcache>=5.6.1" "typing-extensions>=4.5.0" >/dev/null
if ! ls "$VOCAB"/ggml-vocab-*.gguf "$VOCAB"/templates/*.jinja >/dev/null 2>&1; then
  tar -xzf "$SDIST" -C "$VOCAB" --strip-components=4 --wildcards \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/models/ggml-vocab-*" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/models/templates/*"
fi
