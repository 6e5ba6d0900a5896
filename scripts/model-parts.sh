#!/usr/bin/env bash
# scripts/model-parts.sh split|join - moves the default model to a machine
# that takes at most 64 MiB per transfer (the GPU machine: one call carries
# at most 64 MiB, the model is 98 MB).
#
#   split  cuts models/SmolLM2-135M-Instruct.Q4_1.gguf into three byte ranges
#          models/parts/p1 (18 MB), p2 (45 MB), p3 (the rest, ~35 MB), and
#          copies the first $CORPUS_FILES (20) speeches of ../shared/data/sotu
#          to models/parts/sotu (271 KB: the ppl windows and haystacks of
#          scripts/quality-grid.sh, the calibration text of its fits).
#          Carry models/parts/p1 + models/parts/sotu in one call,
#          models/parts/p2 in the next, models/parts/p3 in the one that runs.
#   join   concatenates p1 p2 p3 back into the .gguf and checks the sha256 of
#          scripts/fetch-model.sh; a missing part or a wrong checksum is an
#          error (exit 1) that names it, and nothing is left at the model path.
#          A model already there with the right checksum is kept as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
parts=models/parts
sha=$(sed -n 's/^sha=\([0-9a-f]\{64\}\)$/\1/p' scripts/fetch-model.sh)
[ ${#sha} -eq 64 ] || { echo "model-parts: no sha256 in scripts/fetch-model.sh" >&2; exit 1; }
MB=1000000
P1=$((18 * MB)) P2=$((45 * MB))

case "${1:-}" in
split)
    bash scripts/fetch-model.sh # checks the sha256 (downloads only if the model is missing)
    mkdir -p "$parts"
    size=$(stat -c %s "$model")
    [ "$size" -gt $((P1 + P2)) ] || { echo "model-parts: $model has only $size bytes" >&2; exit 1; }
    dd if="$model" of="$parts/p1" bs=1M iflag=count_bytes count=$P1 status=none
    dd if="$model" of="$parts/p2" bs=1M iflag=skip_bytes,count_bytes skip=$P1 count=$P2 status=none
    dd if="$model" of="$parts/p3" bs=1M iflag=skip_bytes skip=$((P1 + P2)) status=none
    src=${CORPUS_SRC:-../shared/data/sotu}
    [ -d "$src" ] || src=/work/shared/data/sotu
    if [ -d "$src" ]; then
        rm -rf "$parts/sotu"; mkdir -p "$parts/sotu"
        # sorted like lethe's corpus loader: the ppl stream of seed 0 starts at the first file
        ls "$src" | grep -E '\.(txt|md)$' | LC_ALL=C sort | head -n "${CORPUS_FILES:-20}" |
            while read -r f; do cp "$src/$f" "$parts/sotu/"; done
    else
        echo "model-parts: no corpus at $src: models/parts/sotu not written" >&2
    fi
    ls -l "$parts"/p1 "$parts"/p2 "$parts"/p3
    [ -d "$parts/sotu" ] && echo "$parts/sotu: $(ls "$parts/sotu" | wc -l) files, $(du -sh "$parts/sotu" | cut -f1)"
    echo "model-parts: carry $parts/p1 + $parts/sotu, then $parts/p2, then $parts/p3 (one call each)"
    ;;
join)
    if [ -f "$model" ] && echo "$sha  $model" | sha256sum -c --status; then
        echo "model-parts: $model already there (sha256 ok)"; exit 0
    fi
    missing=
    for p in p1 p2 p3; do [ -s "$parts/$p" ] || missing="$missing $parts/$p"; done
    if [ -n "$missing" ]; then
        echo "model-parts: missing:$missing (carry models/parts/p1, p2 and p3 in consecutive calls;" \
            "made by scripts/model-parts.sh split)" >&2
        exit 1
    fi
    mkdir -p models
    cat "$parts/p1" "$parts/p2" "$parts/p3" >"$model.part"
    if ! echo "$sha  $model.part" | sha256sum -c --status; then
        echo "model-parts: sha256 mismatch after joining $(stat -c %s "$model.part") bytes from" \
            "p1 $(stat -c %s "$parts/p1"), p2 $(stat -c %s "$parts/p2"), p3 $(stat -c %s "$parts/p3")" \
            "(expected $sha); a part is stale or truncated" >&2
        rm -f "$model.part"; exit 1
    fi
    mv "$model.part" "$model"
    echo "model-parts: $model joined (sha256 ok)"
    ;;
*)
    echo "usage: scripts/model-parts.sh split|join" >&2; exit 2 ;;
esac
