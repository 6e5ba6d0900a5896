#!/usr/bin/env bash
# tests/run.sh BUILD [--c-only] - runs every test binary in BUILD/tests, then
# (unless --c-only) each fuzz harness for a few seconds when $LETHE_FUZZ_BUILD
# names their build (make test sets it) and the Python end-to-end tests; prints PASS/FAIL per test
# and a closing "N passed, N failed" line. Exits non-zero if anything failed.
set -u
build=${1:-build}
c_only=0
[ "${2:-}" = "--c-only" ] && c_only=1
cd "$(dirname "$0")/.." || exit 1
# Tests share 2 cores with servers and clients they start: OpenMP threads that
# spin while waiting starve those processes (measured: 11x slower decode at
# load 10), so waiting threads sleep unless the caller says otherwise.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
# the Python tests run the lethe binary of the build under test
export LETHE_BUILD=${LETHE_BUILD:-$build}
pass=0; fail=0; failed=()
logdir="$build/test-logs"; mkdir -p "$logdir"
for t in "$build"/tests/test_*; do
    [ -x "$t" ] || continue
    name=$(basename "$t")
    start=$(date +%s)
    if timeout 900 "$t" >"$logdir/$name.log" 2>&1; then
        echo "PASS $name ($(( $(date +%s) - start ))s)"; pass=$((pass+1))
    else
        echo "FAIL $name ($(( $(date +%s) - start ))s)"; tail -n 20 "$logdir/$name.log" | sed 's/^/    /'
        fail=$((fail+1)); failed+=("$name")
    fi
done
# a short run of every fuzz harness (make fuzz-build; `make fuzz` for long runs)
fuzz_build=${LETHE_FUZZ_BUILD:-}
if [ $c_only = 0 ] && [ -n "$fuzz_build" ]; then
    for b in "$fuzz_build"/fuzz/fuzz_*; do
        [ -x "$b" ] || continue
        name=$(basename "$b")
        if out=$(bash tests/fuzz/run.sh "$fuzz_build" "${LETHE_FUZZ_SECONDS:-4}" 0 "$name" 2>&1); then
            echo "$out"; pass=$((pass+1))
        else
            echo "$out"; fail=$((fail+1)); failed+=("$name")
        fi
    done
fi
if [ $c_only = 0 ]; then
    for t in tests/e2e/test_*.py tests/ref/test_*.py; do
        [ -f "$t" ] || continue
        name=$(basename "$t" .py)
        start=$(date +%s)
        if timeout 900 python3 -m pytest -x -q "$t" >"$logdir/$name.log" 2>&1; then
            echo "PASS $name ($(( $(date +%s) - start ))s)"; pass=$((pass+1))
        else
            echo "FAIL $name ($(( $(date +%s) - start ))s)"; tail -n 30 "$logdir/$name.log" | sed 's/^/    /'
            fail=$((fail+1)); failed+=("$name")
        fi
    done
fi
[ $fail -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ] && [ $pass -gt 0 ]
