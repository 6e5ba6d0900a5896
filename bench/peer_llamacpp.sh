#!/usr/bin/env bash
# bench/peer_llamacpp.sh - lethe's CPU backend and llama.cpp side by side.
#
#   bash bench/peer_llamacpp.sh [--threads N] [--reps R] [--quants "q8_0 q4_k_m"] [MODEL.gguf]
#
# 1. Builds llama.cpp's llama-bench and llama-quantize, once, from the source
#    distribution of the PyPI package llama-cpp-python (vendor/llama.cpp),
#    with CMake: a portable AVX2 build (GGML_NATIVE=OFF, AVX2 + FMA + F16C, no
#    AVX-512), cached in the git common directory (lethe-deps/), never in the
#    tree.
# 2. For MODEL (default: the default model, SmolLM2-135M-Instruct Q4_1) and
#    each of --quants (made from MODEL by llama-quantize --allow-requantize
#    into the same cache; requantizing a Q4_1 file changes the weights'
#    values, not their shapes: a speed comparison of the formats, not of
#    quality): alternates R times
#      llama-bench -p 512 -n 128 -t N -r 1              (pp512, tg128)
#      lethe bench engine --device cpu -t N --points 1:512:0,1:1:128
#    and prints the medians and the ratios lethe / llama.cpp. Both sides
#    run at normal priority; the load average is printed before and after
#    (other processes share the machine: state it with the numbers).
# Needs cmake, g++, pip (scripts/setup.sh) and a built lethe (BUILD, default build).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
threads=2
reps=5
quants="q8_0 q4_k_m"
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
while [ $# -gt 0 ]; do
    case "$1" in
    --threads) threads=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --quants) quants=$2; shift 2 ;;
    -h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "peer_llamacpp: unknown option $1" >&2; exit 2 ;;
    *) model=$1; shift ;;
    esac
done
build=${BUILD:-build}
lethe=$build/lethe
[ -x "$lethe" ] || { echo "peer_llamacpp: $lethe missing (make first, or BUILD=...)" >&2; exit 1; }
[ -f "$model" ] || { echo "peer_llamacpp: $model missing (make model)" >&2; exit 1; }
deps=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null)/lethe-deps
dest=$deps/llama.cpp-$VERSION
bin=$dest/build/bin

# ---- 1. llama-bench + llama-quantize, once ----
if [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/llama-quantize" ]; then
    mkdir -p "$deps"
    exec 9>"$dest.lock"
    flock 9
    if [ ! -x "$bin/llama-bench" ] || [ ! -x "$bin/llama-quantize" ]; then
        command -v cmake >/dev/null || { echo "peer_llamacpp: cmake is missing (scripts/setup.sh)" >&2; exit 1; }
        dl=$(mktemp -d "${TMPDIR:-/tmp}/lethe-llamacpp.XXXXXX")
        echo "peer_llamacpp: fetching llama-cpp-python $VERSION (source distribution, PyPI)" >&2
        python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$dl"
        tarball=$dl/llama_cpp_python-$VERSION.tar.gz
        echo "$SHA256  $tarball" | sha256sum -c --quiet - ||
            { echo "peer_llamacpp: sha256 mismatch for $tarball" >&2; exit 1; }
        rm -rf "$dest"
        mkdir -p "$dest"
        tar xzf "$tarball" -C "$dest" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
        rm -rf "$dl"
        echo "peer_llamacpp: building llama-bench + llama-quantize (portable AVX2, once)" >&2
        cmake -S "$dest" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
            -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
            -DGGML_OPENMP=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$dest/cmake.log" 2>&1 ||
            { tail -20 "$dest/cmake.log" >&2; exit 1; }
        cmake --build "$dest/build" --target llama-bench llama-quantize -j "$(nproc)" \
            >"$dest/build.log" 2>&1 || { tail -20 "$dest/build.log" >&2; exit 1; }
    fi
    exec 9>&-
fi

# ---- 2. the files: MODEL and its requantized variants ----
files=("$model")
base=$(basename "$model" .gguf)
for q in $quants; do
    out=$dest/models/${base%.*}.${q^^}.gguf
    if [ ! -f "$out" ]; then
        mkdir -p "$dest/models"
        "$bin/llama-quantize" --allow-requantize "$model" "$out.part" "${q^^}" "$threads" \
            >"$dest/models/quantize-$q.log" 2>&1 || { tail -5 "$dest/models/quantize-$q.log" >&2; exit 1; }
        mv "$out.part" "$out"
    fi
    files+=("$out")
done

# ---- 3. side by side ----
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
echo "lethe $(git rev-parse --short HEAD), llama.cpp from llama-cpp-python $VERSION, $threads threads, $reps reps"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for f in "${files[@]}"; do
    for r in $(seq "$reps"); do
        "$bin/llama-bench" -m "$f" -t "$threads" -p 512 -n 128 \
            -r 1 -o json >"$tmp/llama.$r.json" 2>"$tmp/llama.err" ||
            { tail -5 "$tmp/llama.err" >&2; exit 1; }
        "$lethe" bench engine --device cpu -m "$f" -t "$threads" --points 1:512:0,1:1:128 \
            --json "$tmp/lethe.$r.json" >"$tmp/lethe.out" 2>&1 || { tail -5 "$tmp/lethe.out" >&2; exit 1; }
    done
    python3 - "$f" "$tmp" "$reps" <<'PY'
import json, os, statistics, sys
f, tmp, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
pp, tg, lp, ld = [], [], [], []
for r in range(1, reps + 1):
    for e in json.load(open(f"{tmp}/llama.{r}.json")):
        (pp if e["n_prompt"] else tg).append(e["avg_ts"])
    pts = json.load(open(f"{tmp}/lethe.{r}.json"))["points"]
    lp.append(next(p["prefill_tok_s"] for p in pts if p["input"] == 512))
    ld.append(next(p["decode_tok_s"] for p in pts if p["output"] == 128))
m = statistics.median
print(f"{os.path.basename(f)}")
print(f"  prefill 512: llama.cpp pp512 {m(pp):7.1f} tok/s, lethe {m(lp):7.1f} tok/s, "
      f"ratio {m(lp) / m(pp):.2f}x   (runs: llama.cpp {min(pp):.0f}-{max(pp):.0f}, lethe {min(lp):.0f}-{max(lp):.0f})")
print(f"  decode:      llama.cpp tg128 {m(tg):7.1f} tok/s, lethe {m(ld):7.1f} tok/s, "
      f"ratio {m(ld) / m(tg):.2f}x   (runs: llama.cpp {min(tg):.0f}-{max(tg):.0f}, lethe {min(ld):.0f}-{max(ld):.0f})")
PY
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
