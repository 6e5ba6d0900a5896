#!/usr/bin/env bash
# scripts/run.sh - what `make run` runs: serves the default model
# (models/SmolLM2-135M-Instruct.Q4_1.gguf) with `lethe serve` on
# 127.0.0.1:8000 and first prints a curl command to paste into a second
# terminal. HOST, PORT and MODEL override the defaults; extra arguments go
# to `lethe serve` (e.g. `bash scripts/run.sh --device cuda`).
set -euo pipefail
cd "$(dirname "$0")/.."
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
BIN=${LETHE_BIN:-build/lethe}
if [ ! -x "$BIN" ]; then echo "run: $BIN is missing; run 'make' first" >&2; exit 1; fi
if [ ! -f "$MODEL" ]; then echo "run: $MODEL is missing; run 'make model' first" >&2; exit 1; fi
name=$(basename "$MODEL")
cat <<MSG

lethe is starting on http://$HOST:$PORT (model $name). In another terminal, try:

curl http://$HOST:$PORT/v1/chat/completions -H 'Content-Type: application/json' -d '{
  "model": "$name",
  "messages": [{"role": "user", "content": "What is the capital of France?"}],
  "max_tokens": 64, "temperature": 0
}'

Streaming: add "stream": true. Health: curl -i http://$HOST:$PORT/health   Metrics: curl http://$HOST:$PORT/metrics
Stop the server with Ctrl-C.

MSG
exec "$BIN" serve --model "$MODEL" --host "$HOST" --port "$PORT" "$@"
