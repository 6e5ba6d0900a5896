#!/usr/bin/env bash
# scripts/gpu-check.sh [PHASES] - everything one GPU-machine call does, in
# one go: build with nvcc (make CUDA=1), `make test-gpu`, the engine
# benchmark (dummy Llama-3.1-8B weights), the HF transformers / torch SDPA
# peers, the plot; logs and JSON under $OUT (default ./gpu-out), a short
# table last (everything packed into $OUT/results.tgz, see pack_out). PHASES: any of pack,build,test,bench,dev,peer,plot,profile,sparse,prefill,prefillprof,compress,stepprof,mmcmp,replay,kvcap,basecmp,hybrid,moe,moeprof,quality,docs,graphs
# (default: build,test,bench,dev,peer,plot,profile; the others only when named).
# LETHE_GPU_TESTS=name,name makes the test phase run only those tests of
# `make test-gpu` (all of them take ~9 min; test_cuda_graph_sparse ~4 of it;
# LETHE_TEST_METHODS=quest,h2o limits that test to the named methods).
#
#   quality every method vs dense on the real SmolLM2-135M (Q4_1 GGUF, 98 MB:
#           more than one call carries, so it travels as models/parts/p1, p2,
#           p3 from `scripts/model-parts.sh split`, carried in consecutive
#           calls, with the speeches in models/parts/sotu): joins the parts
#           (sha256 checked; a missing part stops the phase and names it), then
#           scripts/quality-grid.sh: `lethe eval --device cuda` at 4K and 8K,
#           budgets 512/1024/2048 or two levels per method, 4 windows per cell,
#           KL / top-1 vs dense, the palu / deltakv fits on the CPU cores.
#           <= 9 min (TOTAL_S). QUALITY_ENV adds settings (e.g. "JOBS=12 SAMPLES=8").
#           -> $OUT/quality/*-grid-*.json, summary.txt, one log per job; a
#           "FAIL" line per failed cell. Then on the dev machine:
#           `cat FILES_AT/results.tgz* | tar xz -C /tmp/q`, then
#           scripts/quality-grid.sh docs /tmp/q/quality (docs/results + quality.md).
#   docs    after quality: scripts/gen_docs.py over a scratch copy of docs/ with
#           the grid's result files -> $OUT/quality/quality.md (what the page
#           will say; the repository's docs/ is left as it is).
#
#   basecmp before vs after in one call: the tree of an earlier commit, carried
#           as .deb/base-COMMIT.tar (`git archive -o .deb/base-COMMIT.tar COMMIT`),
#           is built next to this one (in the build phase, in parallel) and
#           `lethe bench engine` (dummy Llama-3.1-8B, $BASECMP_POINTS) runs
#           base, new, base, new; then `bench sparse --parts matched` (dense,
#           quest, omnikv at batch 8 x ${BASECMP_SPARSE_INPUT:-8192}) once each
#           (BASECMP_REPS=N engine repeats, default 2; BASECMP_SPARSE=0 skips sparse).
#           Ratios new/base per point -> $OUT/basecmp.txt. ~4-5 min.
#
#   graphs  sparse methods on the CUDA-graph decode path, dummy Llama-3.1-8B,
#           every engine with LETHE_STEP_TIMES=1: (1) `bench sparse --parts
#           matched` dense, quest, omnikv at batch 8 x each of
#           ${GRAPH_INPUTS:-32768} (decode tok/s vs dense; add 131072 for the
#           8 x 128K row when the device time allows: its 8 real prefills cost
#           ~2 min per engine); (2) host issue vs device time per decode step
#           of every method of ${GRAPH_METHODS} (default dense, quest, omnikv,
#           snapkv, pyramidkv, h2o, streamingllm, fp8_kv, kivi) at batch 8 and
#           64 x ${GRAPH_STEP_INPUT:-2048} (budget 1024, 32 decode steps).
#           The step-time lines (one per engine: host issue ms, graph
#           launch/wait ms, sample/wait ms, host share) -> $OUT/graphs.txt;
#           the JSON -> $OUT/graphs-*.json. ~3 min.
#
#   dev     dev/cuda/attn_bench (built by the build phase): the attention
#           kernel generations v1, v2 and lethe's op against the CPU twin,
#           then v1 vs v2 timed at the Llama-3.1-8B shape (decode b8/b32 x
#           16K/32K, prefill 8K). < 1 min. -> $OUT/dev-attn.{log,json}
#
#   sparse  `lethe bench sparse`: SnapKV 2K largest batch + decode
#           tok/s vs dense at 32K and 128K, Quest / OmniKV vs dense at batch
#           8 x 32K; then RetroInfer (device index, and the host tier as
#           retro_infer) vs dense at ${RETRO_BATCH:-8} x ${RETRO_INPUT:-32768}
#           (RETRO_METHODS, default retroinfer,retro_infer) -> sparse-retroinfer.json.
#           ~3-4 min of GPU time (+ ~3 min RetroInfer). SPARSE_SET=retro runs only the
#           RetroInfer part; SPARSE_SET=evict only kvzip, rkv and skipkv vs dense at matched
#           batch 8 x 32K (decode tok/s, slots kept; -> sparse-evict.json; kvzip alone ~2.5 min;
#           EVICT_METHODS=rkv,skipkv picks them). SPARSE_ARGS adds/overrides flags (e.g.
#           "--matched-input 16384" to halve the matched part).
#           Issue 17's list (compression + RetroInfer host tier at 32K / 128K), ~4-5 min:
#             COMPRESS_INPUTS="2x32768 1x130560" SPARSE_SET=retro RETRO_BATCH=1 \
#             RETRO_INPUT=130560 RETRO_METHODS=retro_infer scripts/gpu-check.sh build,compress,sparse
#           -> $OUT/sparse.json (copy to docs/results/, run gen_docs.py)
#   prefill `lethe bench prefill`: one prompt of 32K and one of 128K alone in
#           the engine, prefill time (submit -> first token) and the next-token
#           KL / top-1 vs dense of flashprefill (threshold 0.002, and 0.01 as
#           flashprefill#t01: dummy weights' block softmax is near uniform,
#           1 / blocks, so 0.002 reads every block below ~500 blocks) and
#           omnikv_prefill, dummy Llama-3.1-8B, 8K chunks; then KVzip at 32K
#           (budget 2048, its context replay: extra prefill cost = 1 / speed-up).
#           ~4 min. PREFILL_ARGS adds/overrides flags of the first run.
#           -> $OUT/prefill.{log,json}, $OUT/prefill-kvzip.{log,json}
#   prefillprof ncu (durations only) over the attention kernels of one 32K
#           prefill, dense then flashprefill (kernel names bsp_* and
#           prefill_v2_kernel<D, true> are flashprefill's, <D, false> both),
#           and over KVzip's scores kernels (sc_*) of its 32K replay: where
#           their time goes. ~3-5 min. -> $OUT/prefillprof.txt
#   compress  the compression methods vs dense, dummy Llama-3.1-8B: first
#           `lethe fit palu` ON THE DUMMY WEIGHTS (rank ratio 0.5; README.md +
#           docs/architecture.md as calibration text; factors of random weights:
#           speed and capacity only, never quality) into /tmp, then `bench
#           sparse --parts matched` of turboquant (4 bit), palu (those
#           factors), deltakv (@random compressor, latent 128: random
#           projections with the real shapes, speed only; s 64, r 512) at
#           batch 8 x 32K and batch 2 x 128K (COMPRESS_INPUTS). Prints KV bytes
#           per token, tokens per GiB, slots, reserve, decode tok/s per method.
#           COMPRESS_METHODS (default turboquant,palu,deltakv) picks the methods
#           (the palu fit runs only when palu is among them), e.g.
#           COMPRESS_METHODS=deltakv COMPRESS_INPUTS="1x130560" scripts/gpu-check.sh compress.
#           -> $OUT/compress-L.{log,json}. COMPRESS_ARGS adds flags.
#   stepprof  ncu over one real decode step (LETHE_PROFILE_STEP=${PROF_STEP:-20})
#           of each engine of `lethe bench sparse --parts matched` (dense,
#           then ${PROF_METHODS:-quest,omnikv}) at batch 8 x 32K: per step the
#           kernel count, summed kernel time and the top kernels
#           (scripts/ncu_steps.py) -> $OUT/stepprof.txt. ~2 min.
#   mmcmp   side by side in one call: `lethe bench engine` decode at batch 1 and
#           4 (dummy Llama-3.1-8B, 4K context, CUDA graphs) with LETHE_MATMUL=cublas
#           and with lethe's own small-batch kernels (auto: GEMV at n <= 4), alternating, 3
#           repeats -> $OUT/mmcmp.txt. ~2 min.
#   kvcap   issue 15's quantized-KV / capacity / long-replay checks in one call:
#           dev/cuda/attn_bench decode attention alone at 8 x 32K for bf16, fp8
#           (tensor-core kernel), kivi4, kivi2 (bytes read, % of copy bandwidth)
#           -> kvcap-attn.{log,json}; `bench sparse --parts matched` dense vs
#           fp8_kv at batch 8 x 32K -> kvcap-fp8.{log,json}; `bench sparse
#           --parts ownpath` SnapKV, PyramidKV, H2O, StreamingLLM (2K budget) at
#           their largest batch of a pool of ${KVCAP_OWN_K:-4} dense requests of
#           ${KVCAP_OWN_INPUT:-8192} + 128 tokens, run for real through each
#           method's engine path, 2 repeats (median) -> kvcap-ownpath.{log,json};
#           the long-agents replay preset -> replay-long.json. Not timed yet
#           (aim: ~5 min). KVCAP_ARGS adds bench-sparse flags.
#   replay  `lethe bench replay` against `lethe serve --device cuda`
#           with dummy Llama-3.1-8B weights and the Llama-3 tokenizer from
#           $REPLAY_TOKENIZER (default .deb/tokenizers/llama3: carry .deb):
#           dense-radix, snapkv-nocache, snapkv-chain on one generated trace
#           (8 agents x 8 turns, tool outputs 500-2000 words, concurrency 8).
#           ~3 min. REPLAY_ARGS adds/overrides flags. -> $OUT/replay.json
#           REPLAY_SET (comma list, default base) picks the runs; prune, branch
#           and host together take ~200 s of GPU time (each line of the summary
#           says its own; each server start is in the logs):
#             base    the run above;
#             prune   4 agents x 12 turns (contexts up to ~20K tokens): dense-radix
#                     vs dense-radix+prune (lag 4, keep 0.2, snapkv_global) vs
#                     snapkv-chain: end-to-end time, resident KV, TTFT
#                     -> $OUT/replay-prune.json;
#             branch  32 agents admitted at once with one ~4K-token system prompt,
#                     2 turns: snapkv-chain vs snapkv-chain+share (branching;
#                     computed prompt tokens and resident KV say whether the
#                     prompt was prefilled and held once) -> $OUT/replay-branch.json;
#             host    8 agents x 6 turns on a 6 GiB KV cache, dense-radix and
#                     snapkv-chain, without and with --host-cache-bytes 64G:
#                     restore and demote bandwidth vs one large host copy
#                     -> $OUT/replay-host.json, replay-host-on.json.
#             long    the long-agents preset (`bench replay --preset long-agents`,
#                     docs/benchmarks.md): 6 agents growing past 64K tokens at
#                     once on a 16 GiB KV pool, dense-radix vs snapkv-chain
#                     -> $OUT/replay-long.json (a few minutes; not yet timed).
#           REPLAY_CPU=1 runs the same sets at toy scale on the CPU (SmolLM2,
#           LETHE_BIN=build-cpu/lethe): a check of the commands, not a benchmark.
#   moe     the mixture-of-experts / latent-attention models with dummy weights,
#           per model of ${MOE_MODELS:-qwen3-30b-a3b glm-4.7-flash} (configs/):
#           `lethe bench engine`: decode at batch 1, 8, 64 x 4K and 32K (+ 32 x
#           512, HF's point) over synthetic contexts (B:I:O:s: random KV rows, no
#           prefill; a point that does not fit is reported and skipped) and a
#           prefill-only point 1 x 8192; latent attention also that prefill with
#           LETHE_MLA_EXPAND_MIN_Q=0 (absorbed) next to the default (expanded);
#           bench/peer_hf.py: HF transformers from the same config (random
#           bf16 weights, full size) at batch 32 x 512, +${MOE_HF_OUT:-32} tokens;
#           `lethe bench sparse --parts capacity`: SnapKV 2K vs dense at 32K.
#           MOE_PARTS (default engine,hf,snapkv) picks parts. Table:
#           scripts/moe_table.py -> $OUT/moe.txt; JSON moe-MODEL*.json.
#           ~2.5-3 min per model (mostly model loads: 3-4 per model).
#   moeprof ncu (durations only) over one eager decode step of each
#           ${MOE_MODELS} model at batch ${MOE_PROF_BATCH:-1} x 4K (synthetic context):
#           kernel count, summed time and top kernels (scripts/ncu_steps.py,
#           one range per model) -> $OUT/moeprof.txt. ~1-2 min per model.
#   profile Nsight Compute (ncu --clock-control none; this GPU machine is a
#           VM) on the decode attention kernels (v1 and v2, dev/cuda/attn_bench)
#           at b8 x 32K, the prefill attention kernels at 8K, and one eager
#           decode step of the dummy Llama-3.1-8B (b8 x 2K); the range is set
#           by --profile (cudaProfilerStart/Stop), kernels outside it run
#           unprofiled. ~1.5-3 min. Summary in $OUT/profile.txt
#           (scripts/ncu_summary.py), reports in $OUT/ncu-*.ncu-rep. A missing
#           or failing ncu is reported and the run goes on.
#
# Libraries lethe links that the GPU image may lack (cJSON, PCRE2, ICU,
# libcurl) are taken from Debian .debs carried in .deb/
# (apt-get download ... on the dev machine): headers and missing libraries
# are unpacked into .deb/root and passed through EXTRA_CFLAGS/EXTRA_LDFLAGS.
set -u
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
# The device machine hands back at most 8 files of $OUT (16 MiB each). On
# exit, also when a TERM (`timeout 500 bash scripts/gpu-check.sh ...`) ends the
# run early, everything under $OUT is packed into results.tgz (split into
# results.tgz.NN parts of 15 MiB when larger) next to a copy of summary.txt:
# here `cat FILES_AT/results.tgz* | tar xz -C DIR`. PACK=1 / PACK=0 force it on
# / off; by default it packs when $OUT is outside this checkout (the device's $OUT).
pack_out() {
    local pack=${PACK:-}
    [ -z "$pack" ] && { case "$OUT" in "$PWD"/*) pack=0 ;; *) pack=1 ;; esac; }
    [ "$pack" = 1 ] || return 0
    local t=/tmp/gpu-check-results.$$
    tar czf "$t.tgz" -C "$OUT" . 2>/dev/null || return 0
    find "$OUT" -mindepth 1 -maxdepth 1 -exec rm -rf {} +
    [ -f "$t.tgz" ] && tar xzf "$t.tgz" -C "$OUT" ./summary.txt 2>/dev/null
    if [ "$(stat -c %s "$t.tgz")" -gt $((15 << 20)) ]; then
        split -b 15M -d "$t.tgz" "$OUT/results.tgz."
    else
        mv "$t.tgz" "$OUT/results.tgz"
    fi
    rm -f "$t.tgz"
}
trap pack_out EXIT
trap 'echo "gpu-check: stopped by a signal; packing what there is"; exit 124' TERM INT
# `gpu-check.sh pack` only packs: for a run cut off by a KILL (the device call's
# own limit) use `timeout -k 5 N bash scripts/gpu-check.sh PHASES; bash scripts/gpu-check.sh pack`
[ "${1:-}" = pack ] && exit 0
phases=${1:-build,test,bench,dev,peer,plot,profile}
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
    R=$PWD/.deb/root; L=$R/usr/lib/x86_64-linux-gnu; LK=$PWD/.deb/link; FB=$PWD/.deb/fallback
    mkdir -p "$R" "$LK" "$FB"
    for f in .deb/*.deb; do dpkg -x "$f" "$R"; done
    # link time: a library the system has is linked from the system; else from the .deb
    for lib in cjson pcre2-8 icuuc curl crypto; do
        sys=$(ldconfig -p | grep -o "/[^ ]*/lib$lib\.so\.[0-9]*$" | head -1)
        # ICU suffixes its symbols with its version: the .deb headers need the .deb library
        [ "$lib" = icuuc ] && sys=
        if [ -n "$sys" ]; then ln -sf "$sys" "$LK/lib$lib.so"; else ln -sf "$(ls "$L"/lib$lib.so.[0-9]* | head -1)" "$LK/lib$lib.so"; echo "lib$lib: from .deb" >>"$OUT/gpu.txt"; fi
    done
    # run time: only the sonames the system lacks come from the .debs (libcurl's
    # own dependencies among them), so no system library is shadowed
    for so in "$L"/lib*.so.*; do
        n=$(basename "$so")
        ldconfig -p | grep -q "^[[:space:]]$n " || ln -sf "$so" "$FB/$n"
    done
    echo "from .deb at run time: $(ls "$FB" | tr '\n' ' ')" >>"$OUT/gpu.txt"
    export EXTRA_CFLAGS="-I$R/usr/include -I$R/usr/include/x86_64-linux-gnu"
    export EXTRA_LDFLAGS="-L$LK -Wl,-rpath-link,$L -Wl,-rpath,$FB"
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$FB"
fi
# xgrammar's C++ core, built on the dev machine (scripts/build-xgrammar.sh) and
# carried: the GPU machine cannot fetch its source distribution
for x in .deb/lethe-deps/xgrammar-*/lib/libxgrammar.a; do
    [ -f "$x" ] && export LETHE_DEPS=$PWD/.deb/lethe-deps
done

# Nsight Compute: on PATH or in the usual install folders (empty when absent)
find_ncu() { command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1; }

BASE_DIR=/tmp/lethe-base
if has basecmp; then
    base_tar=${BASE_TAR:-$(ls .deb/base-*.tar* 2>/dev/null | head -1)}
    rm -rf "$BASE_DIR"; mkdir -p "$BASE_DIR"
    if [ -f "$base_tar" ]; then
        tar xf "$base_tar" -C "$BASE_DIR"
        (cd "$BASE_DIR" && make -j8 CUDA=1 build/lethe >"$OUT/base-build.log" 2>&1; echo "rc=$?" >>"$OUT/base-build.log") &
        base_pid=$!
    else
        log "basecmp: no .deb/base-*.tar*"
    fi
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
        --attn-batch 8,32 --attn-ctx 16384,32768 --attn-prefill 8192 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    log "bench: ($(( $(date +%s) - t0 ))s)"
fi
if has dev; then
    t0=$(date +%s)
    ./build/dev/cuda/attn_bench --json "$OUT/dev-attn.json" 2>&1 | tee "$OUT/dev-attn.log"
    log "dev: rc=${PIPESTATUS[0]} ($(( $(date +%s) - t0 ))s): $(grep '^check:' "$OUT/dev-attn.log" | tail -1)"
fi
if has peer; then
    t0=$(date +%s)
    PYTHONUNBUFFERED=1 python3 bench/peer_hf.py --config configs/llama-3.1-8b-instruct \
        --lethe-json "$OUT/bench.json" --json "$OUT/peer.json" 2>&1 | tee "$OUT/peer.log"
    log "peer: ($(( $(date +%s) - t0 ))s)"
fi
# the GPU's name into a result file (gen_docs.py shows it as the machine)
add_gpu() {
    [ -f "$1" ] && python3 - "$1" "$(sed -n 2p "$OUT/gpu.txt")" <<'EOF2'
import json, sys
r = json.load(open(sys.argv[1]))
r["gpu"] = sys.argv[2]
json.dump(r, open(sys.argv[1], "w"), indent=1)
EOF2
}
if has sparse; then
    t0=$(date +%s)
    if [ "${SPARSE_SET:-all}" = evict ]; then
        # the eviction methods without a graph path of their own yet: decode tok/s vs dense at
        # matched batch 8 x 32K and the slots each keeps after compaction (192 decode steps, past
        # rkv / skipkv's 128-step compaction interval)
        ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
            --parts matched --budget 2048 --matched-methods ${EVICT_METHODS:-kvzip,rkv,skipkv} --matched-batch 8 \
            --matched-input 32768 --matched-output 192 --no-progress \
            --method-config kvzip:kvzip_token_budget=2048 ${SPARSE_ARGS:-} \
            --json "$OUT/sparse-evict.json" 2>&1 | tee "$OUT/sparse-evict.log"
        add_gpu "$OUT/sparse-evict.json"
    fi
    case "${SPARSE_SET:-all}" in retro|evict) ;; *) ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --budget 2048 --capacity-method snapkv --capacity-inputs ${SPARSE_INPUTS:-32768,130560} --capacity-output 256 \
        --engine-tokens 131072 --matched-methods quest,omnikv --matched-batch 8 --matched-input 32768 \
        --matched-output 64 ${SPARSE_ARGS:-} --json "$OUT/sparse.json" 2>&1 | tee "$OUT/sparse.log"
    add_gpu "$OUT/sparse.json" ;; esac
    [ "${SPARSE_SET:-all}" = evict ] || {
    # RetroInfer: decode vs dense at matched batch RETRO_BATCH x RETRO_INPUT (dense, the device
    # index, the host tier through the alias retro_infer), each engine's pool slots per layer and
    # the device slots a request holds after its prompt (capacity)
    ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --parts matched --budget 2048 --matched-methods ${RETRO_METHODS:-retroinfer,retro_infer} \
        --matched-batch ${RETRO_BATCH:-8} --matched-input ${RETRO_INPUT:-32768} --matched-output 64 --no-progress \
        --method-config retro_infer:retroinfer_host_kv=true,retroinfer_host_gib=96 \
        ${SPARSE_ARGS:-} --json "$OUT/sparse-retroinfer.json" 2>&1 | tee "$OUT/sparse-retroinfer.log"
    add_gpu "$OUT/sparse-retroinfer.json"; }
    log "sparse: ($(( $(date +%s) - t0 ))s)"
fi
if has graphs; then
    t0=$(date +%s)
    : >"$OUT/graphs.txt"
    cfg=configs/llama-3.1-8b-instruct/config.json
    for L in $(echo ${GRAPH_INPUTS:-32768} | tr ',' ' '); do
        LETHE_STEP_TIMES=1 ./build/lethe bench sparse -m $cfg --load-format dummy --device cuda --parts matched \
            --budget 2048 --matched-methods quest,omnikv --matched-batch 8 --matched-input "$L" --matched-output 64 \
            --no-progress ${GRAPH_ARGS:-} --json "$OUT/graphs-8x$L.json" >"$OUT/graphs-8x$L.log" 2>&1
        echo "matched 8 x $L (rc $?):" >>"$OUT/graphs.txt"
        grep -E "^[a-z_0-9]+ +\||^method|step times|eagerly" "$OUT/graphs-8x$L.log" >>"$OUT/graphs.txt"
        add_gpu "$OUT/graphs-8x$L.json"
    done
    gm=${GRAPH_METHODS:-quest,omnikv,snapkv,pyramidkv,h2o,streamingllm,fp8_kv,kivi}
    for B in 8 64; do
        LETHE_STEP_TIMES=1 ./build/lethe bench sparse -m $cfg --load-format dummy --device cuda --parts matched \
            --budget 1024 --matched-methods "$gm" --matched-batch $B --matched-input ${GRAPH_STEP_INPUT:-2048} \
            --matched-output 32 --no-progress ${GRAPH_ARGS:-} --json "$OUT/graphs-steps-b$B.json" \
            >"$OUT/graphs-steps-b$B.log" 2>&1
        echo "step times, batch $B x ${GRAPH_STEP_INPUT:-2048} (rc $?):" >>"$OUT/graphs.txt"
        grep -E "^[a-z_0-9]+ +\||step times|eagerly" "$OUT/graphs-steps-b$B.log" >>"$OUT/graphs.txt"
        add_gpu "$OUT/graphs-steps-b$B.json"
    done
    cat "$OUT/graphs.txt"
    log "graphs: ($(( $(date +%s) - t0 ))s) -> graphs.txt"
fi
if has prefill; then
    t0=$(date +%s)
    ./build/lethe bench prefill -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --inputs ${PREFILL_INPUTS:-32768,131070} --methods flashprefill,flashprefill#t01,omnikv_prefill \
        --method-config flashprefill#t01:flashprefill_threshold=0.01 --max-num-batched-tokens 8192 \
        ${PREFILL_ARGS:-} --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log"
    add_gpu "$OUT/prefill.json"
    ./build/lethe bench prefill -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --inputs 32768 --methods kvzip --method-config kvzip:kvzip_token_budget=2048 --max-num-batched-tokens 8192 \
        --json "$OUT/prefill-kvzip.json" 2>&1 | tee "$OUT/prefill-kvzip.log"
    add_gpu "$OUT/prefill-kvzip.json"
    log "prefill: ($(( $(date +%s) - t0 ))s)"
fi
if has prefillprof; then
    t0=$(date +%s)
    NCU=$(find_ncu)
    : >"$OUT/prefillprof.txt"
    for what in flashprefill kvzip; do
        if [ $what = flashprefill ]; then kn='regex:bsp_|prefill_v2'; mc=""; else kn='regex:^sc_'; mc="--method-config kvzip:kvzip_token_budget=2048"; fi
        timeout 400 "$NCU" --clock-control none --force-overwrite --metrics gpu__time_duration.sum \
            --kernel-name "$kn" -o "$OUT/ncu-pf-$what" \
            ./build/lethe bench prefill -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
            --inputs 32768 --warmup 128 --methods $what $mc --max-num-batched-tokens 8192 >"$OUT/ncu-pf-$what.log" 2>&1
        echo "prefillprof $what ncu rc=$?" >>"$OUT/prefillprof.txt"
        "$NCU" --import "$OUT/ncu-pf-$what.ncu-rep" --csv --page raw --print-units base >"$OUT/ncu-pf-$what.csv" \
            2>>"$OUT/ncu-pf-$what.log"
        python3 scripts/ncu_summary.py share "32K prefill, dense + $what ($kn)" "$OUT/ncu-pf-$what.csv" \
            >>"$OUT/prefillprof.txt" 2>&1
        rm -f "$OUT/ncu-pf-$what.ncu-rep"
    done
    log "prefillprof: ($(( $(date +%s) - t0 ))s) -> prefillprof.txt"
fi
if has compress; then
    t0=$(date +%s)
    cfg=configs/llama-3.1-8b-instruct/config.json
    cmethods=${COMPRESS_METHODS:-turboquant,palu,deltakv}
    palu_cfg=()
    if [[ ",$cmethods," == *,palu,* ]]; then
        ./build/lethe fit palu $cfg --load-format dummy --tokenizer .deb/tokenizers/llama3 --device cuda \
            --calib README.md --calib docs/architecture.md --samples 2 --seq-len 1024 --rank-ratio 0.5 \
            --out /tmp/palu-dummy-0.50 >"$OUT/compress-fit.log" 2>&1 || echo "compress: fit palu rc=$?" >>"$OUT/summary.txt"
        palu_cfg=(--method-config palu:palu_factors=/tmp/palu-dummy-0.50)
    fi
    for spec in ${COMPRESS_INPUTS:-8x32768 2x130560}; do
        b=${spec%x*}; L=${spec#*x}
        ./build/lethe bench sparse -m $cfg --load-format dummy --device cuda --parts matched --budget 2048 \
            --matched-methods "$cmethods" --matched-batch "$b" --matched-input "$L" --matched-output 64 \
            --method-config turboquant:turboquant_bits=4 ${palu_cfg[@]+"${palu_cfg[@]}"} \
            --method-config deltakv:deltakv_compressor=@random,deltakv_latent=128 \
            --no-progress ${COMPRESS_ARGS:-} --json "$OUT/compress-$L.json" 2>&1 | tee "$OUT/compress-$L.log"
        add_gpu "$OUT/compress-$L.json"
    done
    log "compress: ($(( $(date +%s) - t0 ))s)"
fi
if has stepprof; then
    t0=$(date +%s)
    NCU=$(find_ncu)
    pm=${PROF_METHODS:-quest,omnikv}
    LETHE_PROFILE_STEP=${PROF_STEP:-20} timeout 400 "$NCU" --clock-control none --profile-from-start off \
        --force-overwrite --metrics gpu__time_duration.sum -o "$OUT/ncu-steps" \
        ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy \
        --device cuda --parts matched --budget 2048 --matched-methods "$pm" --matched-batch 8 \
        --matched-input 32768 --matched-output 32 --no-progress ${SPARSE_ARGS:-} >"$OUT/ncu-steps.log" 2>&1
    echo "stepprof ncu rc=$?" >"$OUT/stepprof.txt"
    "$NCU" --import "$OUT/ncu-steps.ncu-rep" --csv --page raw --print-units base >"$OUT/ncu-steps.csv" 2>>"$OUT/ncu-steps.log"
    python3 scripts/ncu_steps.py "dense,$pm" "$OUT/ncu-steps.csv" ${PROF_TOP:-16} >>"$OUT/stepprof.txt" 2>&1
    rm -f "$OUT/ncu-steps.ncu-rep"
    log "stepprof: ($(( $(date +%s) - t0 ))s) -> stepprof.txt"
fi
if has mmcmp; then
    t0=$(date +%s)
    : >"$OUT/mmcmp.txt"
    for rep in 1 2 3; do
        for mm in cublas auto; do
            LETHE_MATMUL=$mm ./build/lethe bench engine -m configs/llama-3.1-8b-instruct/config.json \
                --load-format dummy --points ${MM_POINTS:-1:4096:64,4:4096:64} \
                --json "$OUT/mm-$mm-$rep.json" >"$OUT/mm-$mm-$rep.log" 2>&1
            python3 - "$OUT/mm-$mm-$rep.json" "$mm" "$rep" >>"$OUT/mmcmp.txt" <<'EOF2'
import json, sys
r = json.load(open(sys.argv[1]))
for p in r.get("points", r.get("results", [])):
    print(sys.argv[2], "rep", sys.argv[3], {k: p[k] for k in p if k in ("batch", "input", "decode_step_ms", "decode_tok_s", "decode_frac_copy_bw")})
EOF2
        done
    done
    rm -f "$OUT"/mm-*.log
    log "mmcmp: ($(( $(date +%s) - t0 ))s) -> mmcmp.txt"
fi
# `lethe bench replay --preset long-agents` (tools/bench_replay.c): 6 agents whose
# contexts grow past 64K tokens (tool outputs of 3000-5000 words), all at once, on a
# 16 GiB KV pool (< 2 agents at full length for dense): dense-radix vs snapkv-chain
replay_long() {
    local tok=${REPLAY_TOKENIZER:-.deb/tokenizers/llama3}
    ./build/lethe bench replay --preset long-agents --model configs/llama-3.1-8b-instruct/config.json \
        --serve-args "--load-format dummy --device cuda --tokenizer $tok" ${REPLAY_ARGS:-} \
        --result-json "$OUT/replay-long.json" 2>&1 | tee "$OUT/replay-long.log"
    add_gpu "$OUT/replay-long.json"
}
if has replay; then
    t0=$(date +%s)
    tok=${REPLAY_TOKENIZER:-.deb/tokenizers/llama3}
    [ -f "$tok/tokenizer.json" ] || [ -n "${REPLAY_CPU:-}" ] ||
        echo "replay: no $tok/tokenizer.json (carry .deb with tokenizers/llama3)"
    rset=",${REPLAY_SET:-base},"
    lethe=${LETHE_BIN:-./build/lethe}
    knobs="--sparse-config sink_keep_tokens=64,recent_keep_tokens=512,decode_keep_tokens=1472"
    model=configs/llama-3.1-8b-instruct/config.json
    serve="--load-format dummy --device cuda --tokenizer $tok --max-model-len 32768"
    # per set: agents, turns, system / task / tool words, host-tier KV cache
    pr="--agents 4 --concurrency 4 --min-turns 12 --max-turns 12 --system-tokens 1000 --task-tokens 500 --tool-min 500 --tool-max 2000 --max-context 30000"
    br="--agents 32 --concurrency 32 --min-turns 2 --max-turns 2 --system-tokens 3000 --task-tokens 200 --tool-min 200 --tool-max 800"
    ho="--agents 8 --concurrency 8 --min-turns 6 --max-turns 6 --system-tokens 1000 --task-tokens 500 --tool-min 500 --tool-max 2000 --max-context 16000"
    hserve="--max-model-len 16384 --kv-cache-bytes 6G"; hbytes=64G
    if [ -n "${REPLAY_CPU:-}" ]; then # the same sets at toy scale on the CPU (checks the commands; no speed)
        knobs="--sparse-config sink_keep_tokens=16,recent_keep_tokens=64,decode_keep_tokens=256"
        model=models/SmolLM2-135M-Instruct.Q4_1.gguf
        serve="--threads 2 --max-model-len 4096"
        pr="--agents 2 --concurrency 2 --min-turns 6 --max-turns 6 --system-tokens 30 --task-tokens 20 --tool-min 60 --tool-max 100 --max-context 2000"
        br="--agents 4 --concurrency 4 --min-turns 2 --max-turns 2 --system-tokens 200 --task-tokens 20 --tool-min 30 --tool-max 60"
        ho="--agents 3 --concurrency 3 --min-turns 3 --max-turns 3 --system-tokens 60 --task-tokens 30 --tool-min 60 --tool-max 120 --max-context 700"
        hserve="--max-model-len 768 --kv-cache-bytes 40M"; hbytes=256M
    fi
    gen="--generate --out-min 20 --out-max 60 --max-wait 1 --seed 42 --model $model"
    rp() { # NAME ARGS...: one replay, its log and JSON under $OUT, timed in the summary
        local name=$1 t1; shift; t1=$(date +%s)
        $lethe bench replay "$@" ${REPLAY_ARGS:-} --result-json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
        add_gpu "$OUT/$name.json"
        log "replay $name: $(( $(date +%s) - t1 ))s"
    }
    if [ "${rset#*,base,}" != "$rset" ]; then
        rp replay $gen --agents 8 --concurrency 8 --min-turns 8 --max-turns 8 --system-tokens 1000 \
            --task-tokens 500 --tool-min 500 --tool-max 2000 --max-context 30000 \
            --configs dense-radix,snapkv-nocache,snapkv-chain $knobs --serve-args "$serve"
    fi
    if [ "${rset#*,prune,}" != "$rset" ]; then # long agent replay: pruning (lag 4, keep 0.2) vs chains vs dense + radix
        rp replay-prune $gen $pr --configs dense-radix,dense-radix+prune,snapkv-chain \
            --prune-lag 4 --prune-keep-ratio 0.2 $knobs --serve-args "$serve"
    fi
    if [ "${rset#*,branch,}" != "$rset" ]; then # 32 agents admitted at once, one ~4K-token system prompt
        rp replay-branch $gen $br --shared-system --configs snapkv-chain,snapkv-chain+share $knobs \
            --serve-args "$serve"
    fi
    if [ "${rset#*,host,}" != "$rset" ]; then # a KV cache too small for the trace: host tier off / on
        rp replay-host $gen $ho --configs dense-radix,snapkv-chain $knobs --serve-args "$serve $hserve"
        rp replay-host-on $gen $ho --configs dense-radix,snapkv-chain $knobs \
            --serve-args "$serve $hserve --host-cache-bytes $hbytes"
    fi
    [ "${rset#*,long,}" != "$rset" ] && replay_long # the long-agents preset
    cp /tmp/lethe-replay-*.log "$OUT/" 2>/dev/null
    log "replay: ${REPLAY_SET:-base} ($(( $(date +%s) - t0 ))s)"
fi
if has hybrid; then
    t0=$(date +%s)
    hcfg=configs/qwen3.6-27b/config.json
    hp=",${HYBRID_PARTS:-gdn,engine,snapkv},"
    if [ "${hp#*,gdn,}" != "$hp" ]; then
        ./build/dev/cuda/gdn_bench --json "$OUT/hybrid-gdn.json" 2>&1 | tee "$OUT/hybrid-gdn.log"
        add_gpu "$OUT/hybrid-gdn.json"
    fi
    if [ "${hp#*,engine,}" != "$hp" ]; then
        ./build/lethe bench engine --model $hcfg --load-format dummy --device cuda --max-num-batched-tokens 8192 \
            --points ${HYBRID_POINTS:-1:32768:64,1:131072:8,8:32768:64:s,32:32768:32:s,64:16384:32:s,64:32768:32:s} \
            --json "$OUT/hybrid-engine.json" 2>&1 | tee "$OUT/hybrid-engine.log"
        add_gpu "$OUT/hybrid-engine.json"
    fi
    if [ "${hp#*,snapkv,}" != "$hp" ]; then
        ./build/lethe bench sparse -m $hcfg --load-format dummy --device cuda --parts capacity \
            --budget 2048 --capacity-method snapkv --capacity-inputs ${HYBRID_SNAPKV_INPUTS:-130560} \
            --capacity-output 256 --engine-tokens 131072 --max-num-seqs 128 --no-progress ${SPARSE_ARGS:-} \
            --json "$OUT/hybrid-snapkv.json" 2>&1 | tee "$OUT/hybrid-snapkv.log"
        add_gpu "$OUT/hybrid-snapkv.json"
    fi
    log "hybrid: ${HYBRID_PARTS:-gdn,engine,snapkv} ($(( $(date +%s) - t0 ))s)"
fi
if has kvcap; then # quantized-KV decode, capacity through the methods' own path, long replay
    t0=$(date +%s)
    ./build/dev/cuda/attn_bench --no-check --batch 8 --ctx 32768 --prefill 8192 --kv bf16,fp8,kivi4,kivi2 \
        --json "$OUT/kvcap-attn.json" 2>&1 | tee "$OUT/kvcap-attn.log"
    ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --parts matched --matched-methods fp8_kv --matched-batch 8 --matched-input 32768 --matched-output 64 \
        --no-progress ${KVCAP_ARGS:-} --json "$OUT/kvcap-fp8.json" 2>&1 | tee "$OUT/kvcap-fp8.log"
    add_gpu "$OUT/kvcap-fp8.json"
    ./build/lethe bench sparse -m configs/llama-3.1-8b-instruct/config.json --load-format dummy --device cuda \
        --parts ownpath --budget 2048 --ownpath-methods snapkv,pyramidkv,h2o,streamingllm \
        --ownpath-inputs ${KVCAP_OWN_INPUT:-8192} --ownpath-pool-requests ${KVCAP_OWN_K:-4} --ownpath-output 128 \
        --repeats 2 --no-progress ${KVCAP_ARGS:-} --json "$OUT/kvcap-ownpath.json" 2>&1 | tee "$OUT/kvcap-ownpath.log"
    add_gpu "$OUT/kvcap-ownpath.json"
    replay_long
    log "kvcap: ($(( $(date +%s) - t0 ))s) -> kvcap-attn.json kvcap-fp8.json kvcap-ownpath.json replay-long.json"
fi
if has basecmp && [ -n "${base_pid:-}" ]; then
    wait "$base_pid"
    log "basecmp: base $(basename "$base_tar") build $(tail -1 "$OUT/base-build.log") ($(( $(date +%s) - t_start ))s)"
    t0=$(date +%s)
    cfg=configs/llama-3.1-8b-instruct/config.json
    pts=${BASECMP_POINTS:-1:4096:64,8:4096:64,32:512:64,64:8192:32}
    for rep in $(seq 1 ${BASECMP_REPS:-2}); do
        for who in base new; do
            bin=./build/lethe; [ $who = base ] && bin=$BASE_DIR/build/lethe
            $bin bench engine -m $cfg --load-format dummy --points "$pts" --attention --attn-batch 8 \
                --attn-ctx 32768 --attn-prefill 8192 --json "$OUT/basecmp-$who-$rep.json" \
                >"$OUT/basecmp-$who-$rep.log" 2>&1 || echo "basecmp $who $rep: rc=$?" >>"$OUT/summary.txt"
        done
    done
    for who in base new; do
        [ "${BASECMP_SPARSE:-1}" = 0 ] && break
        bin=./build/lethe; [ $who = base ] && bin=$BASE_DIR/build/lethe
        $bin bench sparse -m $cfg --load-format dummy --device cuda --parts matched --budget 2048 \
            --matched-methods quest,omnikv --matched-batch 8 --matched-input ${BASECMP_SPARSE_INPUT:-8192} \
            --matched-output 64 --no-progress --json "$OUT/basecmp-sparse-$who.json" \
            >"$OUT/basecmp-sparse-$who.log" 2>&1 || echo "basecmp sparse $who: rc=$?" >>"$OUT/summary.txt"
    done
    python3 - "$OUT" >"$OUT/basecmp.txt" 2>&1 <<'EOF2'
import json, os, statistics, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n)
    return json.load(open(p)) if os.path.exists(p) else None
runs = {w: [r for r in (load(f"basecmp-{w}-{i}.json") for i in range(1, 9)) if r] for w in ("base", "new")}
print(f"engine bench, median of {len(runs['new'])} runs each, alternating base/new (ratio = new / base)")
print(f"{'point':>14} {'metric':>22} {'base':>10} {'new':>10} {'ratio':>7}")
if runs["base"] and runs["new"]:
    for i, p in enumerate(runs["new"][0]["points"]):
        name = f"{p['batch']}x{p['input']}"
        for k in ("prefill_tok_s", "decode_tok_s", "decode_frac_copy_bw"):
            b = statistics.median(r["points"][i][k] for r in runs["base"])
            n = statistics.median(r["points"][i][k] for r in runs["new"])
            print(f"{name:>14} {k:>22} {b:10.4g} {n:10.4g} {n / b:7.3f}")
    for key, f in (("attention", "gb_s"), ("prefill_attention", "tflops")):
        for i, a in enumerate(runs["new"][0].get(key) or []):
            b = statistics.median(r[key][i][f] for r in runs["base"])
            n = statistics.median(r[key][i][f] for r in runs["new"])
            print(f"{key:>14} {f:>22} {b:10.4g} {n:10.4g} {n / b:7.3f}")
sb, sn = load("basecmp-sparse-base.json"), load("basecmp-sparse-new.json")
if sb and sn:
    print("bench sparse --parts matched (one run each)")
    for mb, mn in zip(sb["matched"]["methods"], sn["matched"]["methods"]):
        for k in ("prefill_tok_s", "decode_tok_s", "pool_slots_per_layer"):
            print(f"{mb['method']:>14} {k:>22} {mb[k]:10.4g} {mn[k]:10.4g} {mn[k] / mb[k]:7.3f}")
EOF2
    log "basecmp: ($(( $(date +%s) - t0 ))s) -> basecmp.txt"
fi
if has moe; then
    t0=$(date +%s)
    : >"$OUT/moe.txt"
    mparts=",${MOE_PARTS:-engine,hf,snapkv},"
    for mm in ${MOE_MODELS:-qwen3-30b-a3b glm-4.7-flash}; do
        cfg=configs/$mm/config.json
        latent=$(python3 -c "import json,sys; print(int('kv_lora_rank' in json.load(open(sys.argv[1]))))" "$cfg")
        if [[ $mparts == *,engine,* ]]; then
            ./build/lethe bench engine -m $cfg --load-format dummy \
                --points ${MOE_POINTS:-1:4096:24:s,8:4096:24:s,64:4096:16:s,1:32768:24:s,8:32768:16:s,64:32768:8:s,32:512:24:s,1:8192:0} \
                --json "$OUT/moe-$mm.json" 2>&1 | tee "$OUT/moe-$mm.log"
            [ "$latent" = 1 ] && LETHE_MLA_EXPAND_MIN_Q=0 ./build/lethe bench engine -m $cfg --load-format dummy \
                --points 1:8192:0 --json "$OUT/moe-$mm-absorbed.json" 2>&1 | tee "$OUT/moe-$mm-absorbed.log"
            log "moe $mm engine: ($(( $(date +%s) - t0 ))s)"
        fi
        if [[ $mparts == *,hf,* ]]; then
            PYTHONUNBUFFERED=1 python3 bench/peer_hf.py --config configs/$mm --no-attention --batch 32 \
                --input-len 512 --output-len ${MOE_HF_OUT:-32} --reps 1 --lethe-json "$OUT/moe-$mm.json" \
                --json "$OUT/moe-$mm-hf.json" 2>&1 | tee "$OUT/moe-$mm-hf.log"
            log "moe $mm hf: ($(( $(date +%s) - t0 ))s)"
        fi
        if [[ $mparts == *,snapkv,* ]]; then
            ./build/lethe bench sparse -m $cfg --load-format dummy --device cuda --parts capacity \
                --budget 2048 --capacity-method snapkv --capacity-inputs 32768 --capacity-output 256 \
                --engine-tokens 65536 --no-progress --json "$OUT/moe-$mm-snapkv.json" 2>&1 | tee "$OUT/moe-$mm-snapkv.log"
            add_gpu "$OUT/moe-$mm-snapkv.json"
            log "moe $mm snapkv: ($(( $(date +%s) - t0 ))s)"
        fi
    done
    python3 scripts/moe_table.py "$OUT" ${MOE_MODELS:-qwen3-30b-a3b glm-4.7-flash} >"$OUT/moe.txt" 2>&1
    log "moe: ($(( $(date +%s) - t0 ))s) -> moe.txt"
fi
if has moeprof; then
    t0=$(date +%s)
    NCU=$(find_ncu)
    : >"$OUT/moeprof.txt"
    for mm in ${MOE_MODELS:-qwen3-30b-a3b glm-4.7-flash}; do
        [ -z "$NCU" ] && { echo "ncu not found: no moeprof" >>"$OUT/moeprof.txt"; break; }
        timeout 300 "$NCU" --clock-control none --profile-from-start off --force-overwrite \
            --metrics gpu__time_duration.sum -o "$OUT/ncu-moe-$mm" \
            ./build/lethe bench engine -m configs/$mm/config.json --load-format dummy \
            --no-graph --profile --points ${MOE_PROF_BATCH:-1}:4096:3:s >"$OUT/ncu-moe-$mm.log" 2>&1
        echo "moeprof $mm: ncu rc=$?" >>"$OUT/moeprof.txt"
        "$NCU" --import "$OUT/ncu-moe-$mm.ncu-rep" --csv --page raw --print-units base \
            >"$OUT/ncu-moe-$mm.csv" 2>>"$OUT/ncu-moe-$mm.log"
        python3 scripts/ncu_steps.py "$mm" "$OUT/ncu-moe-$mm.csv" ${PROF_TOP:-24} >>"$OUT/moeprof.txt" 2>&1
        rm -f "$OUT/ncu-moe-$mm.ncu-rep"
    done
    log "moeprof: ($(( $(date +%s) - t0 ))s) -> moeprof.txt"
fi
if has quality; then
    t0=$(date +%s)
    if bash scripts/model-parts.sh join >"$OUT/quality-join.log" 2>&1; then
        cat "$OUT/quality-join.log"
        env OUT="$OUT" ${QUALITY_ENV:-} bash scripts/quality-grid.sh >"$OUT/quality.log" 2>&1
        rc=$?
        for f in "$OUT"/quality/*-grid-*.json; do add_gpu "$f"; done
        grep -E '^(ok|FAIL|quality-grid:)' "$OUT/quality.log"
        log "quality: rc=$rc ($(( $(date +%s) - t0 ))s): $(grep -c '^ok ' "$OUT/quality.log") jobs ok, $(grep -c '^FAIL' "$OUT/quality.log") FAIL lines"
        grep '^FAIL' "$OUT/quality.log" | head -20 | tee -a "$OUT/summary.txt"
    else
        log "quality: model not joined: $(tail -1 "$OUT/quality-join.log")"
    fi
fi
if has docs; then
    if ls "$OUT"/quality/*-grid-*.json >/dev/null 2>&1; then
        d=$(mktemp -d); cp -r docs "$d/docs"; cp "$OUT"/quality/*-grid-*.json "$d/docs/results/"
        python3 scripts/gen_docs.py --no-plots --results "$d/docs/results" --docs "$d/docs" >"$OUT/docs.log" 2>&1
        log "docs: gen_docs rc=$? -> quality/quality.md"
        cp "$d/docs/quality.md" "$OUT/quality/quality.md" 2>/dev/null
        rm -rf "$d"
    else
        log "docs: no $OUT/quality/*-grid-*.json (run the quality phase first)"
    fi
fi
if has plot; then
    python3 scripts/plot_bench.py "$OUT/bench.json" "$OUT/bench.png" >>"$OUT/summary.txt" 2>&1
fi
if has profile; then
    t0=$(date +%s)
    NCU=$(find_ncu)
    : >"$OUT/profile.txt"
    if [ -z "$NCU" ]; then
        echo "ncu not found (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute): no profile" >>"$OUT/profile.txt"
    else
        cfg=configs/llama-3.1-8b-instruct/config.json
        # ncu_run NAME TIMEOUT NCU-ARGS... -- PROGRAM ARGS...: profile, export CSV, never fail the run
        ncu_run() {
            local name=$1 lim=$2; shift 2
            local nargs=() ; while [ "$1" != "--" ]; do nargs+=("$1"); shift; done; shift
            rm -f "$OUT/ncu-$name.ncu-rep"
            timeout "$lim" "$NCU" --clock-control none --profile-from-start off --force-overwrite \
                -o "$OUT/ncu-$name" "${nargs[@]}" "$@" \
                >"$OUT/ncu-$name.log" 2>&1
            local rc=$?
            [ $rc -ne 0 ] && echo "ncu $name: rc=$rc (124 = timed out after ${lim}s); see ncu-$name.log: $(grep -m1 -i 'error' "$OUT/ncu-$name.log")" >>"$OUT/profile.txt"
            if [ -f "$OUT/ncu-$name.ncu-rep" ]; then
                "$NCU" --import "$OUT/ncu-$name.ncu-rep" --csv --page raw --print-units base \
                    >"$OUT/ncu-$name.csv" 2>>"$OUT/ncu-$name.log" ||
                    echo "ncu $name: CSV export failed" >>"$OUT/profile.txt"
            fi
        }
        # attention kernels: one call of each generation in the range (dev/cuda/attn_bench)
        ncu_run attn 120 --section SpeedOfLight --section Occupancy --section LaunchStats \
            --section WarpStateStats --metrics dram__bytes_read.sum -- \
            ./build/dev/cuda/attn_bench --no-check --batch 8 --ctx 32768 --prefill 8192 --reps 1 --profile
        python3 scripts/ncu_summary.py kernels "attention kernels: decode b8 x 32K (v1 split_kernel + merge, v2 decode_v2_kernel [+ merge]), prefill 8K (v1 prefill_kernel, v2 prefill_v2_kernel); lethe runs v2" \
            "$OUT/ncu-attn.csv" >>"$OUT/profile.txt" 2>&1
        # one decode step of the 8B model (eager: every kernel of the step is a launch)
        ncu_run step 150 --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed -- \
            ./build/lethe bench engine -m $cfg --load-format dummy --points 8:2048:3 --no-graph --profile
        python3 scripts/ncu_summary.py share "one decode step, dummy Llama-3.1-8B, batch 8 x 2K context, eager (no graph)" \
            "$OUT/ncu-step.csv" >>"$OUT/profile.txt" 2>&1
    fi
    log "profile: ($(( $(date +%s) - t0 ))s) -> profile.txt"
fi
echo; echo "================ summary ($(( $(date +%s) - t_start ))s) ================"
cat "$OUT/summary.txt"
grep -A12 "^ batch" "$OUT/bench.log" 2>/dev/null | head -14
grep -A10 "decode attention alone" "$OUT/bench.log" 2>/dev/null
grep -A20 "^== side by side" "$OUT/peer.log" 2>/dev/null
grep -B1 -A4 "^   input |" "$OUT/sparse.log" 2>/dev/null
grep -A5 "^matched batch" "$OUT/sparse.log" 2>/dev/null
grep -A8 "^prefill alone" "$OUT/prefill.log" 2>/dev/null
grep -hE "^(dense|snapkv)-[a-z+]+ +[0-9]|host tier:|server healthy" "$OUT"/replay*.log 2>/dev/null
grep -A6 "prefill attention alone" "$OUT/bench.log" 2>/dev/null
[ -s "$OUT/dev-attn.log" ] && { echo; echo "dev/cuda/attn_bench:"; grep -E "^check:|FAIL$" "$OUT/dev-attn.log"; grep -A6 "attention alone" "$OUT/dev-attn.log"; }
[ -s "$OUT/profile.txt" ] && { echo; cat "$OUT/profile.txt"; }
[ -s "$OUT/stepprof.txt" ] && { echo; cat "$OUT/stepprof.txt"; }
[ -s "$OUT/mmcmp.txt" ] && { echo; cat "$OUT/mmcmp.txt"; }
[ -s "$OUT/moe.txt" ] && { echo; cat "$OUT/moe.txt"; }
[ -s "$OUT/moeprof.txt" ] && { echo; cat "$OUT/moeprof.txt"; }
[ -s "$OUT/basecmp.txt" ] && { echo; cat "$OUT/basecmp.txt"; }
[ -s "$OUT/hybrid-gdn.log" ] && { echo; echo "hybrid: dev/cuda/gdn_bench"; grep -E "^(device|shape|prefill|decode| )" "$OUT/hybrid-gdn.log"; }
[ -s "$OUT/hybrid-engine.log" ] && { echo; echo "hybrid: bench engine (Qwen3.6-27B dummy)"; grep -A8 "^ batch" "$OUT/hybrid-engine.log"; grep skipped "$OUT/hybrid-engine.log"; }
[ -s "$OUT/hybrid-snapkv.log" ] && { echo; echo "hybrid: SnapKV 2K vs dense"; grep -B1 -A4 "^   input |" "$OUT/hybrid-snapkv.log"; }
[ -s "$OUT/quality/summary.txt" ] && { echo; cat "$OUT/quality/summary.txt"; }
