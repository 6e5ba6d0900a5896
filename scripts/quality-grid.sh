#!/usr/bin/env bash
# scripts/quality-grid.sh [docs DIR] - every method of `lethe methods` against
# dense on SmolLM2-135M, KL(dense || method) and top-1 agreement of the
# next-token distributions over teacher-forced windows (`lethe eval --tasks
# ppl`), at 4K and 8K, in one call of the GPU machine (not yet timed there: every
# process is bounded so that it all ends by TOTAL_S = 540 s).
#
# One `lethe eval` process per method and level, $JOBS at a time (the GPU is
# idle most of a step of this small model: processes share it well); each runs
# its own dense reference first on the same windows (both lengths in one
# process, so the windows end at the same tokens at 4K and 8K), and writes
#   $GRID_OUT/smollm2-135m-q4_1-grid-NAME-$TAG.json   (docs/results/ names)
#   $GRID_OUT/NAME.log                                (the eval's stderr)
# Token-budget methods run at budgets $BUDGETS (512, 1024, 2048) of their own
# budget knob (the table in docs/quality.md "What a budget B sets"); the
# quantization and compression methods at two levels of their size knob
# (bits, rank, latent dims), each row with the KV bytes per token its pool
# keeps (configs[].kv_token_bytes); the prefill methods at budgets or two
# thresholds. palu's factors and deltakv's compressor are fitted first by
# `lethe fit` on the CPU ($FIT_THREADS threads) from speeches that are not in
# the ppl windows.
#
# Every cell (method, level, context) is checked when its process ends: a
# process that fails or times out, a missing row, a row with an error, fewer
# than $SAMPLES windows, no KL: each is a FAIL line naming the cell, and the
# script exits 1 after the others finished. The summary table
# ($GRID_OUT/summary.txt) lists every cell, failed ones included.
#
#   docs DIR   copy DIR/*-grid-*.json into docs/results/ and regenerate
#              docs/quality.md (scripts/gen_docs.py)
#
# Environment (defaults for the H200): LETHE (build/lethe), DEVICE (cuda),
# MODEL, CORPUS (../shared/data/sotu, else models/parts/sotu), CTX
# (4096,8000), SAMPLES (4), FORCED (64), BUDGETS (512,1024,2048), TASKS (ppl),
# JOBS (10), JOB_TIMEOUT (s per process, 420), TOTAL_S (every process ends by
# then, 540), THREADS (per eval, 1), FIT_THREADS (3), GPU_UTIL (share of free device memory per process, 0.04),
# ONLY (comma list of job names), TAG (h200 on cuda, else cpu), GRID_OUT
# ($OUT/quality), EXTRA (flags added to every eval).
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = docs ]; then
    src=${2:?usage: scripts/quality-grid.sh docs DIR}
    ls "$src"/*-grid-*.json >/dev/null 2>&1 || { echo "quality-grid: no *-grid-*.json in $src" >&2; exit 1; }
    cp "$src"/*-grid-*.json docs/results/ && python3 scripts/gen_docs.py && \
        echo "quality-grid: $(ls "$src"/*-grid-*.json | wc -l) result files -> docs/results, docs/quality.md regenerated"
    exit $?
fi

LETHE=${LETHE:-build/lethe}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -z "${CORPUS:-}" ]; then
    CORPUS=../shared/data/sotu; [ -d "$CORPUS" ] || CORPUS=models/parts/sotu
fi
CTX=${CTX:-4096,8000}
SAMPLES=${SAMPLES:-4}
FORCED=${FORCED:-64}
BUDGETS=${BUDGETS:-512,1024,2048}
TASKS=${TASKS:-ppl}
JOBS=${JOBS:-10}
JOB_TIMEOUT=${JOB_TIMEOUT:-420}
TOTAL_S=${TOTAL_S:-540}
THREADS=${THREADS:-1}
FIT_THREADS=${FIT_THREADS:-3}
GPU_UTIL=${GPU_UTIL:-0.04}
TAG=${TAG:-$([ "$DEVICE" = cuda ] && echo h200 || echo cpu)}
GRID_OUT=${GRID_OUT:-${OUT:-$PWD/gpu-out}/quality}
mkdir -p "$GRID_OUT"
FITS=$GRID_OUT/fits
t_start=$(date +%s)

die() { echo "quality-grid: $*" >&2; exit 1; }
[ -x "$LETHE" ] || die "no $LETHE (build first: make CUDA=1 all, or LETHE=build-cpu/lethe DEVICE=cpu)"
[ -f "$MODEL" ] || die "no $MODEL (scripts/fetch-model.sh, or scripts/model-parts.sh join on the GPU machine)"
[ -d "$CORPUS" ] || die "no corpus $CORPUS (../shared/data/sotu, or models/parts/sotu from scripts/model-parts.sh split)"
# calibration text of the fits: speeches 12-18 of the corpus in the loader's
# order; the ppl windows of seed 0 read from the first ones (~40 KB at 8K)
CALIB=()
while read -r f; do CALIB+=(--calib "$CORPUS/$f"); done < <(ls "$CORPUS" | grep -E '\.(txt|md)$' | LC_ALL=C sort | sed -n 12,18p)
[ ${#CALIB[@]} -ge 14 ] || die "corpus $CORPUS has fewer than 18 documents (the fits calibrate on documents 12-18)"

# NAME | methods | budgets (- = none) | budget knob | sparse config | extra flags | fit it needs (-: none)
# (the jobs that wait for a fit come last: the fits run first, beside the others)
SPECS=$(cat <<EOF
kvzip|kvzip|$BUDGETS|kvzip:kvzip_token_budget|||-
rkv|rkv|$BUDGETS|rkv:decode_keep_tokens|||-
skipkv|skipkv|$BUDGETS|skipkv:decode_keep_tokens|||-
streamingllm|streamingllm|$BUDGETS|streamingllm:recent_keep_tokens|||-
snapkv|snapkv|$BUDGETS|snapkv:decode_keep_tokens|||-
pyramidkv|pyramidkv|$BUDGETS|pyramidkv:decode_keep_tokens|||-
h2o|h2o|$BUDGETS|h2o:h2o_decode_budget|||-
quest|quest|$BUDGETS|quest:decode_keep_tokens|||-
quest_head|quest|$BUDGETS|quest:decode_keep_tokens|quest_granularity=head||-
omnikv|omnikv|$BUDGETS|omnikv:decode_keep_tokens|||-
omnikv_prefill|omnikv_prefill|$BUDGETS|omnikv_prefill:omnikv_prefill_keep_tokens||--max-num-batched-tokens 1024|-
retroinfer-r018|retroinfer|-||retroinfer_min_tokens=1024||-
retroinfer-r050|retroinfer|-||retroinfer_min_tokens=1024,retroinfer_retrieve=0.05||-
flashprefill-t002|flashprefill|-||flashprefill_min_q=2048|--max-num-batched-tokens 8192|-
flashprefill-t010|flashprefill|-||flashprefill_min_q=2048,flashprefill_threshold=0.01|--max-num-batched-tokens 8192|-
flashprefill-snapkv|flashprefill+snapkv|$BUDGETS|flashprefill+snapkv:decode_keep_tokens|flashprefill_min_q=2048|--max-num-batched-tokens 8192|-
omnikv_prefill-quest|omnikv_prefill+quest|$BUDGETS|omnikv_prefill+quest:decode_keep_tokens|omnikv_prefill_keep_tokens=1024|--max-num-batched-tokens 1024|-
kivi|kivi|2,4|kivi:kivi_bits|||-
turboquant|turboquant|2,4|turboquant:turboquant_bits|||-
fp8_kv|fp8_kv|-||||-
palu|palu|32,48|palu:palu_rank|palu_factors=$FITS/palu-full||palu
deltakv-l96|deltakv|$BUDGETS|deltakv:decode_keep_tokens|deltakv_compressor=$FITS/deltakv-full,deltakv_latent=96||deltakv
deltakv-l192|deltakv|$BUDGETS|deltakv:decode_keep_tokens|deltakv_compressor=$FITS/deltakv-full,deltakv_latent=192||deltakv
EOF
)

# fit NAME: one full-size asset per method into $FITS; the levels cut it (palu_rank
# keeps the first ranks of the full-rank factors, deltakv_latent the first latent
# dims of the 384-dim compressor: both are ordered by the energy they keep).
# Writes $FITS/NAME.rc when done (0 = ok) and its output to $FITS/NAME.log.
fit() {
    local common=(--samples "${FIT_SAMPLES:-8}" --seq-len "${FIT_SEQ:-512}" --device cpu --threads "$FIT_THREADS" "${CALIB[@]}")
    local t=(timeout -k 10 "$JOB_TIMEOUT") rc
    case $1 in
    palu) "${t[@]}" "$LETHE" fit palu "$MODEL" --rank-ratio 1 "${common[@]}" -o "$FITS/palu-full" ;;
    deltakv) "${t[@]}" "$LETHE" fit deltakv "$MODEL" --latent 384 "${common[@]}" -o "$FITS/deltakv-full" ;;
    esac >"$FITS/$1.log" 2>&1
    rc=$?
    echo $rc >"$FITS/$1.rc"
}

# job LINE: one eval process (after its fit), then the check of its cells
job() {
    IFS='|' read -r name methods budgets knob cfg extra fitname <<<"$1"
    local log=$GRID_OUT/$name.log json=$GRID_OUT/smollm2-135m-q4_1-grid-$name-$TAG.json t0
    t0=$(date +%s)
    rm -f "$json"
    : >"$log"
    if [ "$fitname" != - ]; then
        while [ ! -f "$FITS/$fitname.rc" ]; do sleep 1; done
        cat "$FITS/$fitname.log" >>"$log"
        if [ "$(cat "$FITS/$fitname.rc")" != 0 ]; then
            echo "FAIL $name: lethe fit $fitname failed, rc $(cat "$FITS/$fitname.rc") ($(tail -1 "$FITS/$fitname.log" | cut -c1-200)): no cell" >"$GRID_OUT/$name.status"
            return
        fi
    fi
    # every process ends by TOTAL_S after the start, so that the summary is written
    # inside one device call (600 s); a job that cannot start in time says so
    local left=$(( t_start + TOTAL_S - $(date +%s) )) lim
    lim=$(( left < JOB_TIMEOUT ? left : JOB_TIMEOUT ))
    if [ "$lim" -lt 20 ]; then
        echo "FAIL $name: not started: ${left} s left of TOTAL_S=$TOTAL_S (raise JOBS or TOTAL_S): no cell" >"$GRID_OUT/$name.status"
        return
    fi
    local args=(eval --device "$DEVICE" --model "$MODEL" --corpus "$CORPUS" --context-lengths "$CTX"
        --samples "$SAMPLES" --ppl-windows "$SAMPLES" --forced-tokens "$FORCED" --tasks "$TASKS"
        --threads "$THREADS" --methods "$methods" --no-progress --result-json "$json")
    [ "$DEVICE" = cuda ] && args+=(--gpu-memory-utilization "$GPU_UTIL")
    [ "$budgets" != - ] && args+=(--budgets "$budgets" --budget-knob "$knob")
    [ -n "$cfg" ] && args+=(--sparse-config "$cfg")
    # shellcheck disable=SC2206
    [ -n "$extra" ] && args+=($extra)
    # shellcheck disable=SC2206
    [ -n "${EXTRA:-}" ] && args+=($EXTRA)
    echo "== $LETHE ${args[*]}" >>"$log"
    OMP_WAIT_POLICY=passive timeout -k 10 "$lim" "$LETHE" "${args[@]}" >>"$log" 2>&1
    local rc=$?
    python3 - "$json" "$name" "$methods" "$budgets" "$CTX" "$SAMPLES" "$rc" "$(( $(date +%s) - t0 ))" "$log" \
        >"$GRID_OUT/$name.status" 2>&1 <<'PY'
import json, math, sys
path, name, methods, budgets, ctx, samples, rc, secs, log = sys.argv[1:]
rc, samples = int(rc), int(samples)
why = {124: "timed out", 137: "killed (timeout or memory)"}.get(rc, f"exit status {rc}")
cells = [("dense", None)] + [(m, None if budgets == "-" else int(b)) for m in methods.split(",")
                             for b in (["-"] if budgets == "-" else budgets.split(","))]
lengths = [int(x.replace("k", "000")) for x in ctx.split(",")]
try:
    rows = json.load(open(path))["rows"]
except Exception as e:
    tail = open(log, errors="replace").read().strip().splitlines()[-3:]
    for m, b in cells:
        for L in lengths:
            print(f"FAIL {name}: {m} budget {b} ctx {L}: no result ({why}; {e.__class__.__name__}); log: {' | '.join(tail)[:300]}")
    sys.exit(0)
bad = 0
for m, b in cells:
    for L in lengths:
        r = [x for x in rows if x["method"] == m and x.get("budget") == b and x["context_length"] == L and x["task"] == "ppl"]
        cell = f"{m} budget {b} ctx {L}"
        if not r:
            print(f"FAIL {name}: {cell}: no ppl row ({why})"); bad += 1; continue
        r = r[0]
        if r.get("error"):
            print(f"FAIL {name}: {cell}: {r['error']}"); bad += 1
        elif (r.get("n") or 0) < samples:
            print(f"FAIL {name}: {cell}: {r.get('n')} windows < {samples}"); bad += 1
        elif m != "dense" and not (isinstance(r.get("kl_mean"), (int, float)) and math.isfinite(r["kl_mean"])
                                   and r.get("top1_agree") is not None):
            print(f"FAIL {name}: {cell}: no KL / top-1"); bad += 1
if rc != 0 and not bad:
    print(f"FAIL {name}: lethe eval {why} although every cell has a row (see {log})"); bad += 1
if not bad:
    print(f"ok {name}: {len(cells) * len(lengths)} cells in {secs} s")
PY
}

echo "quality-grid: $DEVICE, $MODEL, corpus $CORPUS, ctx $CTX, $SAMPLES windows x $FORCED tokens," \
    "$JOBS processes, results in $GRID_OUT"
rm -rf "$FITS"; mkdir -p "$FITS"
wanted() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]]; }
fit_pids=" "
for f in palu deltakv; do # only the fits that some wanted job needs
    need=
    while IFS='|' read -r n _ _ _ _ _ fn; do [ "$fn" = $f ] && wanted "$n" && need=1; done <<<"$SPECS"
    [ -n "$need" ] || continue
    fit $f &
    fit_pids+="$! "
done
running_evals() { local n=0 p; for p in $(jobs -rp); do [[ "$fit_pids" == *" $p "* ]] || n=$((n + 1)); done; echo $n; }
n_jobs=0
while IFS= read -r line; do
    [ -z "$line" ] && continue
    name=${line%%|*}
    wanted "$name" || continue
    rm -f "$GRID_OUT/$name.status"
    while [ "$(running_evals)" -ge "$JOBS" ]; do wait -n; done
    job "$line" &
    n_jobs=$((n_jobs + 1))
done <<<"$SPECS"
wait
[ "$n_jobs" -gt 0 ] || die "ONLY=$ONLY matches no job (names: $(echo "$SPECS" | cut -d'|' -f1 | tr '\n' ' '))"

fail=0
while IFS= read -r line; do
    [ -z "$line" ] && continue
    name=${line%%|*}
    wanted "$name" || continue
    st=$GRID_OUT/$name.status
    if [ ! -s "$st" ]; then echo "FAIL $name: no status (the job did not finish its check)"; fail=1; continue; fi
    cat "$st"
    grep -q '^FAIL' "$st" && fail=1
done <<<"$SPECS"

# every cell, failed ones with their error: one line per method and level,
# KL mean / top-1 at each context; dense once (its ppl, the reference of all)
python3 - "$GRID_OUT" "$TAG" >"$GRID_OUT/summary.txt" 2>&1 <<'PY'
import glob, json, os, sys
out, tag = sys.argv[1:]
lines, dense = [], {}
for p in sorted(glob.glob(os.path.join(out, f"*-grid-*-{tag}.json"))):
    job = os.path.basename(p).split("-grid-")[1].rsplit(f"-{tag}.json", 1)[0]
    try:
        r = json.load(open(p))
    except Exception as e:
        lines.append(f"{job}: unreadable ({e})"); continue
    tb = {(c["method"], c["knobs"]): c.get("kv_token_bytes") for c in r.get("configs", [])}
    cfgs = {}
    for x in r["rows"]:
        if x["task"] != "ppl":
            continue
        if x["method"] == "dense":
            dense.setdefault(x["context_length"], set()).add(round(x.get("ppl") or 0, 3)); continue
        k = x.get("knobs") or "-"
        k = ",".join(kv.split("=")[0] + "=" + os.path.basename(kv.split("=", 1)[1]) if "=" in kv else kv for kv in k.split(","))
        c = (f"{x['kl_mean']:.5f} {x['top1_agree']:.3f} n{x.get('n')}" if x.get("kl_mean") is not None
             and x.get("top1_agree") is not None else f"ERROR {x.get('error', 'no KL')[:60]}")
        cfgs.setdefault((x["method"], k, tb.get((x["method"], x.get("knobs", "")))), []).append(f"{x['context_length']}: {c}")
    for (m, k, b), cs in cfgs.items():
        lines.append(f"{m:<14} {k[-44:]:<44} {b or '-':>6} | " + " | ".join(cs))
print("dense ppl per context (each job's reference; one value = the same in every job): "
      + "; ".join(f"{L}: {sorted(v)}" for L, v in sorted(dense.items())))
print(f"{'method':<14} {'knobs':<44} {'B/tok':>6} | ctx: KL mean, top-1, windows")
print("\n".join(lines))
PY
echo; cat "$GRID_OUT/summary.txt"
echo "quality-grid: $n_jobs jobs in $(( $(date +%s) - t_start )) s; $([ $fail = 0 ] && echo 'every cell ok' || echo 'FAILED cells above')"
echo "quality-grid: docs: cp $GRID_OUT/*-grid-*.json docs/results/ && python3 scripts/gen_docs.py" \
    " (or scripts/quality-grid.sh docs $GRID_OUT)"
exit $fail
