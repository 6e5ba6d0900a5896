#!/usr/bin/env bash
# scripts/gpu-check.sh [PHASES] - everything one GPU-machine call does, in
# one go: build with nvcc (make CUDA=1), `make test-gpu`, the engine
# benchmark (dummy Llama-3.1-8B weights), the HF transformers / torch SDPA
# peers, the plot; logs and JSON under $OUT (default ./gpu-out), a short
# table last. PHASES: any of build,test,bench,peer,plot (default: all).
#
# Libraries lethe links that the GPU image may lack (cJSON, PCRE2, ICU,
# libmicrohttpd, libcurl) are taken from Debian .debs carried in .deb/
# (apt-get download ... on the dev machine): headers and missing libraries
# are unpacked into .deb/root and passed through EXTRA_CFLAGS/EXTRA_LDFLAGS.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
phases=${1:-build,test,bench,peer,plot}
has() { [[ ",$phases," == *",$1,"* ]]; }
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
t_start=$(date +%s)

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
    >"$OUT/gpu.txt" 2>&1
python3 -c 'import torch,transformers;print("torch",torch.__version__,"transformers",transformers.__version__)' \
    >>"$OUT/gpu.txt" 2>&1
log "machine: $(head -2 "$OUT/gpu.txt" | tail -1) | $(tail -1 "$OUT/gpu.txt") | commit $(git rev-parse --short HEAD 2>/dev/null)"

# ---- libraries ----
if [ -d .deb ]; then
    R=$PWD/.deb/root; L=$R/usr/lib/x86_64-linux-gnu; LK=$PWD/.deb/link
    mkdir -p "$R" "$LK"
    for f in .deb/*.deb; do dpkg -x "$f" "$R"; done
    # a library the system has is linked from the system; else from the .deb
    for lib in cjson pcre2-8 icuuc microhttpd curl crypto; do
        sys=$(ldconfig -p | grep -o "/[^ ]*/lib$lib\.so\.[0-9]*$" | head -1)
        # ICU suffixes its symbols with its version: the .deb headers need the .deb library
        [ "$lib" = icuuc ] && sys=
        if [ -n "$sys" ]; then ln -sf "$sys" "$LK/lib$lib.so"; else ln -sf "$(ls "$L"/lib$lib.so.[0-9]* | head -1)" "$LK/lib$lib.so"; echo "lib$lib: from .deb" >>"$OUT/gpu.txt"; fi
    done
    export EXTRA_CFLAGS="-I$R/usr/include -I$R/usr/include/x86_64-linux-gnu"
    export EXTRA_LDFLAGS="-L$LK -Wl,-rpath-link,$L -Wl,-rpath,$L"
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$L"
fi

if has build; then
    make -j16 CUDA=1 all >"$OUT/build.log" 2>&1; rc=$?
    log "build: rc=$rc ($(( $(date +%s) - t_start ))s)"
    [ $rc -ne 0 ] && { tail -30 "$OUT/build.log"; exit 1; }
    grep -i "warning" "$OUT/build.log" | grep -v "^cc \|^nvcc " | head -5
fi
# tiny checkpoints not yet committed can travel in .deb/tiny (carried, ignored)
for d in .deb/tiny/tiny-*; do
    [ -d "$d" ] && [ ! -d "tests/data/$(basename "$d")" ] && cp -r "$d" tests/data/ &&
        echo "tests/data/$(basename "$d"): from .deb/tiny" >>"$OUT/gpu.txt"
done
if has test; then
    t0=$(date +%s)
    make CUDA=1 test-gpu >"$OUT/test-gpu.log" 2>&1; rc=$?
    cp build/test-logs/gpu/*.log "$OUT/" 2>/dev/null
    log "test-gpu: rc=$rc ($(( $(date +%s) - t0 ))s): $(tail -1 "$OUT/test-gpu.log")"
    cat "$OUT/test-gpu.log"
fi
if has bench; then
    t0=$(date +%s)
    ./build/lethe bench engine -m configs/llama-3.1-8b-instruct/config.json --load-format dummy \
        --points ${BENCH_POINTS:-1:4096:64,32:512:64,64:8192:32,1:8192:8} --attention \
        --attn-batch 8,32 --attn-ctx 16384,32768 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    log "bench: ($(( $(date +%s) - t0 ))s)"
fi
if has peer; then
    t0=$(date +%s)
    PYTHONUNBUFFERED=1 python3 bench/peer_hf.py --config configs/llama-3.1-8b-instruct \
        --lethe-json "$OUT/bench.json" --json "$OUT/peer.json" 2>&1 | tee "$OUT/peer.log"
    log "peer: ($(( $(date +%s) - t0 ))s)"
fi
if has plot; then
    python3 scripts/plot_bench.py "$OUT/bench.json" "$OUT/bench.png" >>"$OUT/summary.txt" 2>&1
fi
echo; echo "================ summary ($(( $(date +%s) - t_start ))s) ================"
cat "$OUT/summary.txt"
grep -A12 "^ batch" "$OUT/bench.log" 2>/dev/null | head -14
grep -A10 "decode attention alone" "$OUT/bench.log" 2>/dev/null
grep -A20 "^== side by side" "$OUT/peer.log" 2>/dev/null
