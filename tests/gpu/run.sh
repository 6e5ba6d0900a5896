#!/usr/bin/env bash
# tests/gpu/run.sh BUILD - runs every CUDA test binary in BUILD/tests/gpu
# (`make test-gpu`, on a machine with a CUDA device; never part of `make
# test`), then the Python checks tests/gpu/test_*.py BUILD against
# transformers on the GPU (they FAIL, not skip, when torch sees no GPU).
# Prints PASS/FAIL per test and "N passed, N failed".
# LETHE_GPU_TESTS=name,name runs only the named tests (a short check of what
# changed when the device time is short; `make test-gpu` without it runs all).
set -u
build=${1:-build}
cd "$(dirname "$0")/../.." || exit 1
pass=0; fail=0; failed=()
logdir="$build/test-logs/gpu"; mkdir -p "$logdir"
only=",${LETHE_GPU_TESTS:-},"
run() { # name, command...
    local name=$1; shift
    [ "$only" = ",," ] || [ "${only#*,$name,}" != "$only" ] || return 0
    local start=$(date +%s)
    if timeout 900 "$@" >"$logdir/$name.log" 2>&1; then
        echo "PASS $name ($(( $(date +%s) - start ))s)"; pass=$((pass+1))
    else
        echo "FAIL $name ($(( $(date +%s) - start ))s)"; tail -n 25 "$logdir/$name.log" | sed 's/^/    /'
        fail=$((fail+1)); failed+=("$name")
    fi
}
for t in "$build"/tests/gpu/test_*; do
    [ -x "$t" ] || continue
    run "$(basename "$t")" "$t"
done
# the engine-level CPU suites that also take LETHE_TEST_DEVICE: the same
# expectations on the CUDA backend
run test_sparse_pairs_cuda env LETHE_TEST_DEVICE=cuda "$build/tests/test_sparse_pairs"
for t in tests/gpu/test_*.py; do
    [ -f "$t" ] || continue
    run "$(basename "$t" .py)" python3 "$t" "$build"
done
[ $fail -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ] && [ $pass -gt 0 ]
