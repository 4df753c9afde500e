#!/bin/sh
# Install the system libraries Strata needs on Debian/Ubuntu: OpenBLAS (fast float32 matmul for
# MLX on CPU) and the libraries Qt's offscreen and xcb platforms load. No-op elsewhere, and
# silent when everything is installed already.
set -e
[ "$(uname -s)" = "Linux" ] || exit 0
command -v apt-get >/dev/null 2>&1 || { echo "system-deps: not Debian; install OpenBLAS and Qt's libraries yourself" >&2; exit 0; }
# g++ and cmake build llama-cpp-python (the tests' GGUF reference; scripts/llama-cpp.sh); the
# C compiler g++ brings builds engine/matvec.c (MLX's one-row products as sgemv) on first use.
PKGS="libopenblas0-pthread libgl1 libegl1 libxkbcommon0 libfontconfig1 libdbus-1-3 libglib2.0-0 g++ cmake"
# Qt's xcb platform plugin (a desktop window): what `ldd` on PySide6's plugins/platforms/
# libqxcb.so and lib/libQt6XcbQpa.so.6 needs beyond the above (Qt 6.5+ requires xcb-cursor).
PKGS="$PKGS libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1 libxcb-image0 libxcb-randr0
  libxcb-render-util0 libxcb-shape0 libxcb-shm0 libxcb-sync1 libxcb-util1 libxcb-xfixes0
  libxcb-xkb1 libxkbcommon-x11-0 libx11-xcb1"
# and its wayland plugin, which Qt 6 picks first in a Wayland session.
PKGS="$PKGS libwayland-client0 libwayland-cursor0 libwayland-egl1"
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0
SUDO=""
[ "$(id -u)" = "0" ] || SUDO="sudo"
echo "system-deps: installing$missing" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
