"""`lethe bench serve` against the real `lethe serve`: the client agrees with the server's /metrics.

Starts the server on SmolLM2-135M (CPU), runs a small closed-loop workload
(fixed lengths, ignore_eos, 4 in flight) on both endpoints, and checks that
over the same run the client's numbers match the server's own Prometheus
counters: request and token counts exactly, mean TTFT within 5% (the
client's TTFT also contains the HTTP round trip, which is small next to a
prefill on this machine).
"""
import json
import os
import subprocess

from lethe_server import BIN, ROOT, Server


def run_bench(srv, tmp_path, *args):
    out = tmp_path / "bench.json"
    p = subprocess.run([BIN, "bench", "serve", "--base-url", srv.url, "--result-json", str(out),
                        "--no-progress", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


def check_against_server(r, n, out_len):
    assert r["completed"] == n and r["failed"] == 0
    assert r["total_output_tokens"] == n * out_len  # ignore_eos + max_tokens: exact
    s = r["server_metrics"]
    assert s["requests"] == n
    assert s["generation_tokens"] == r["total_output_tokens"]
    assert s["prompt_tokens"] == r["total_input_tokens"]
    assert abs(r["mean_ttft_ms"] - s["mean_ttft_ms"]) <= 0.05 * s["mean_ttft_ms"], (r["mean_ttft_ms"], s)
    assert r["mean_tpot_ms"] > 0 and r["p99_itl_ms"] >= r["median_itl_ms"] > 0


def test_client_matches_server_metrics(tmp_path):
    srv = Server("--max-num-seqs", "8")
    try:
        r = run_bench(srv, tmp_path, "--num-prompts", "8", "--max-concurrency", "4", "--random-input-len", "96",
                      "--random-output-len", "12", "--random-range-ratio", "0", "--seed", "3")
        assert r["model_id"]  # discovered from /v1/models
        check_against_server(r, 8, 12)
        # every prompt is ~96 single-token words (+ BOS if the model adds one)
        assert 8 * 96 <= r["total_input_tokens"] <= 8 * 100
        c = run_bench(srv, tmp_path, "--endpoint", "/v1/chat/completions", "--num-prompts", "4",
                      "--max-concurrency", "2", "--random-input-len", "48", "--random-output-len", "8",
                      "--shared-prefix-len", "32")
        check_against_server(c, 4, 8)
    finally:
        srv.stop()
