#!/usr/bin/env bash
# tests/fuzz/run.sh FUZZ_BUILD SECONDS [RUNS] [NAME...] - runs each libFuzzer
# harness (FUZZ_BUILD/fuzz/fuzz_*, or the NAMEs given) for SECONDS (or RUNS
# executions when RUNS > 0) on a scratch copy of its seed corpus
# (tests/fuzz/corpus/NAME) plus its regression inputs (tests/fuzz/regress/NAME:
# every crash found is kept there and replayed on every run). Prints one
# PASS/FAIL line per harness with executions and coverage; a crash, leak,
# timeout or out-of-memory fails it and leaves the input in
# FUZZ_BUILD/fuzz/artifacts/. Exits non-zero if any harness failed.
set -u
build=${1:?usage: run.sh FUZZ_BUILD SECONDS [RUNS] [NAME...]}
secs=${2:-60}
runs=${3:-0}
shift 3 2>/dev/null || shift $#
cd "$(dirname "$0")/../.." || exit 1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# leaks fail the run; UBSan reports abort (and so are saved as crashes)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
    for b in "$build"/fuzz/fuzz_*; do [ -x "$b" ] && names+=("$(basename "$b")"); done
fi
[ ${#names[@]} -gt 0 ] || { echo "run.sh: no harnesses in $build/fuzz (make fuzz-build)"; exit 1; }
art="$build/fuzz/artifacts"; mkdir -p "$art"
# input size caps: larger inputs reach no new code, they only slow each execution
max_len() {
    case $1 in
        fuzz_tokenize) echo 4096 ;;
        fuzz_chat_template) echo 8192 ;;
        fuzz_openai|fuzz_tokenizer_json) echo 16384 ;;
        *) echo 65536 ;;
    esac
}
fail=0
for name in "${names[@]}"; do
    bin="$build/fuzz/$name"
    work=$(mktemp -d "${TMPDIR:-/tmp}/lethe-$name.XXXXXX")
    dirs=("$work")
    [ -d "tests/fuzz/corpus/$name" ] && dirs+=("tests/fuzz/corpus/$name")
    [ -d "tests/fuzz/regress/$name" ] && dirs+=("tests/fuzz/regress/$name")
    limit=(-max_total_time="$secs"); [ "$runs" -gt 0 ] && limit=(-runs="$runs")
    log="$build/fuzz/$name.log"
    start=$(date +%s)
    "$bin" "${limit[@]}" -timeout=10 -rss_limit_mb=3072 -max_len="$(max_len "$name")" -print_final_stats=1 \
        -artifact_prefix="$art/$name-" "${dirs[@]}" >"$log" 2>&1
    rc=$?
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1)
    rm -rf "$work"
    t=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        echo "PASS $name (${t}s, ${execs:-?} execs, ${cov:-cov: ?})"
    else
        echo "FAIL $name (${t}s, ${execs:-?} execs, rc $rc; log $log)"
        grep -E "ERROR|SUMMARY|FUZZ_CHECK|runtime error|Test unit written" "$log" | head -8 | sed 's/^/    /'
        fail=1
    fi
done
exit $fail
