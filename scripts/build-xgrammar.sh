#!/usr/bin/env bash
# scripts/build-xgrammar.sh DEST - builds xgrammar's C++ core (the
# constrained-decoding library behind response_format and forced tool calls)
# from its PyPI source distribution into DEST (include/ + lib/libxgrammar.a),
# once: an existing DEST/lib/libxgrammar.a is reused. The Makefile passes a
# DEST inside the git common directory, so every worktree and every build
# folder of a clone share one build (several minutes on 2 cores).
# Needs pip (PyPI), cmake and g++ (scripts/setup.sh installs cmake).
set -euo pipefail
VERSION=0.2.8
SHA256=8305646fd2b319d6c3003f51a1665e54cbbe9cba1fb636bc41d0b46434ccbb80
dest=${1:?usage: build-xgrammar.sh DEST}
[ -f "$dest/lib/libxgrammar.a" ] && exit 0
mkdir -p "$(dirname "$dest")"
exec 9>"$dest.lock"
flock 9 # one builder at a time; the others wait and then find it built
[ -f "$dest/lib/libxgrammar.a" ] && exit 0
command -v cmake >/dev/null || { echo "build-xgrammar: cmake is missing (run scripts/setup.sh)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/lethe-xgrammar.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "build-xgrammar: fetching xgrammar $VERSION (source distribution, PyPI)" >&2
python3 -m pip download -q --no-deps --no-binary xgrammar "xgrammar==$VERSION" -d "$work/dl"
tarball="$work/dl/xgrammar-$VERSION.tar.gz"
echo "$SHA256  $tarball" | sha256sum -c --quiet - || { echo "build-xgrammar: sha256 mismatch for $tarball" >&2; exit 1; }
tar xzf "$tarball" -C "$work"
src="$work/xgrammar-$VERSION"
mkdir -p "$work/build"
# the C++ core only: no Python bindings (they need tvm_ffi), no tests, no LTO
# objects (lethe links with plain gcc), no debug info (smaller, faster)
cat > "$work/build/config.cmake" <<'EOF'
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
EOF
jobs=$(nproc 2>/dev/null || echo 2)
echo "build-xgrammar: building the C++ core with $jobs jobs (a few minutes, once)" >&2
start=$(date +%s)
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-fno-lto -g0" \
    -DCMAKE_INSTALL_PREFIX="$work/install" >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
nice -n 10 cmake --build "$work/build" -j"$jobs" >>"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --install "$work/build" >>"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
lib=$(find "$work/install" -name libxgrammar.a | head -1)
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/lib"
cp -r "$work/install/include" "$dest.tmp/include"
cp "$lib" "$dest.tmp/lib/"
cp "$src/LICENSE" "$dest.tmp/LICENSE"
mv "$dest.tmp" "$dest"
echo "build-xgrammar: done in $(( $(date +%s) - start ))s -> $dest" >&2
