"""`lethe bench sparse` on the CPU backend at tiny sizes (a dummy 2-layer llama):
the JSON fields, the capacity arithmetic against the pool the engine sized,
SnapKV's resident slots after compaction (= its budget), the matched-batch
runs, and the docs section gen_docs.py renders from the result. Plus
`--tokenizer` (a dummy model served with text through another model's
tokenizer), which the GPU replay needs."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_config(path, vocab=256):
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "vocab_size": vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32"}
    path.write_text(json.dumps(cfg))
    return str(path)


SINK, RECENT, BUDGET, OUT = 8, 24, 96, 32


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("sparse")
    cfg = tiny_config(d / "config.json")
    js = d / "sparse.json"
    p = subprocess.run([LETHE, "bench", "sparse", "-m", cfg, "--load-format", "dummy", "--device", "cpu",
                        "--threads", "2", "--kv-cache-bytes", "4M", "--max-num-batched-tokens", "256",
                        "--budget", str(BUDGET), "--sink", str(SINK), "--recent", str(RECENT),
                        "--capacity-inputs", "512,1024", "--capacity-output", str(OUT), "--engine-tokens", "1024",
                        "--engine-output", "4", "--decode-steps", "8", "--matched-methods", "quest,omnikv",
                        "--matched-batch", "2", "--matched-input", "256", "--matched-output", "4",
                        "--no-progress", "--json", str(js)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(js.read_text()), p.stdout, d


def test_capacity_arithmetic(result):
    r, out, _ = result
    assert r["schema"] == "lethe-bench-sparse/1" and r["device"] == "cpu" and r["commit"] and r["date"]
    cap = r["capacity"]
    assert cap["method"] == "snapkv" and "decode_keep_tokens=64" in cap["knobs"]
    S = cap["pool_slots_per_layer"]
    # the engine sizes the pool from the budget: 2 layers x 2 KV heads x 16 x (K + V) x f32 = 512 bytes a token
    assert cap["kv_bytes_per_token"] == 512 and S == (4 << 20) // 512
    assert [p["input"] for p in cap["points"]] == [512, 1024]
    for p in cap["points"]:
        L = p["input"]
        run = p["engine_run"]
        assert run["requests"] == max(1, 1024 // L) and "error" not in run and run["preemptions"] == 0
        assert run["prefill_s"] > 0
        # SnapKV keeps exactly sink + decode_keep + recent slots in every layer after the prompt
        res = p["resident_after_compaction"]
        assert res["min"] == res["max"] == BUDGET
        a = p["arithmetic"]
        R, P = a["resident_R"], a["prefill_peak_P"]
        assert R == BUDGET and P == L  # SnapKV holds the whole prompt until its final chunk
        steady = R + OUT
        b_pool = min(1 + (S - P) // steady, S // steady)
        assert a["method_batch_pool_limit"] == b_pool and a["dense_batch_pool_limit"] == S // (L + OUT)
        assert a["method_batch"] == min(b_pool, r["max_num_seqs"]) and a["dense_batch"] == S // (L + OUT)
        # the largest batch fits and one more does not (while the last one prefills)
        B = a["method_batch"]
        assert (B - 1) * steady + P <= S and B * steady <= S
        assert B * steady + P > S or B == r["max_num_seqs"]
        md, dd = p["method_decode"], p["dense_decode"]
        assert md["batch"] == B and dd["batch"] == a["dense_batch"]
        assert md["context_start"] == R + (OUT - 8) // 2 and dd["context_start"] == L + (OUT - 8) // 2
        assert md["tok_s"] > 0 and dd["tok_s"] > 0 and md["eager_steps"] == 8  # CPU: no graphs
        assert p["tok_s_ratio"] == pytest.approx(md["tok_s"] / dd["tok_s"])
    assert "   input |" in out


def test_matched_batch(result):
    r, out, _ = result
    mt = r["matched"]
    assert [m["method"] for m in mt["methods"]] == ["dense", "quest", "omnikv"]
    assert mt["max_tokens"] == 4 + (2 * 256 + 255) // 256 + 1
    dense = mt["methods"][0]
    for m in mt["methods"]:
        assert "error" not in m, m
        assert m["requests"] == 2 and m["input"] == 256 and m["preemptions"] == 0
        assert m["decode_window_steps"] >= 4 and m["decode_window_tokens"] == 2 * m["decode_window_steps"]
        assert m["decode_tok_s"] > 0
        assert m["decode_vs_dense"] == pytest.approx(m["decode_tok_s"] / dense["decode_tok_s"])
        # the window's median step and slowest step, and the rate of the median step
        assert 0 < m["decode_step_p50_ms"] <= m["decode_step_max_ms"]
        per_step = m["decode_window_tokens"] / m["decode_window_steps"]
        assert m["decode_tok_s_p50_step"] == pytest.approx(per_step / (m["decode_step_p50_ms"] / 1e3))
        assert m["decode_step_max_ms"] / 1e3 <= m["decode_window_s"] + 1e-9
    assert mt["methods"][0]["knobs"] == "" and "decode_keep_tokens=64" in mt["methods"][1]["knobs"]


def test_docs_section(result, tmp_path):
    r, _, _ = result
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "results" / "sparse-cpu.json").write_text(json.dumps(r))
    gen = os.path.join(ROOT, "scripts", "gen_docs.py")
    p = subprocess.run([sys.executable, gen, "--results", str(docs / "results"), "--docs", str(docs), "--no-plots"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    b = (docs / "benchmarks.md").read_text()
    assert "<!-- gen:begin sparse -->" in b and "## Sparse methods vs dense" in b
    assert "**sparse-cpu.json**: commit" in b and "budget T = 96" in b
    a = r["capacity"]["points"][1]["arithmetic"]
    assert f"| 1024 | 1, " in b and f"| {a['method_batch']} ({a['method_batch_pool_limit']}) |" in b
    assert "| quest | `sink_keep_tokens=8" in b and "Command: `lethe bench sparse" in b
    assert "| vs dense | median-step tok/s | slowest step ms |" in b
    p = subprocess.run([sys.executable, gen, "--results", str(docs / "results"), "--docs", str(docs), "--no-plots",
                        "--check"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_help_and_bad_parts():
    p = subprocess.run([LETHE, "bench", "sparse", "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "--capacity-inputs" in p.stdout and "--matched-methods" in p.stdout
    p = subprocess.run([LETHE, "bench", "sparse", "--parts", "nothing"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "--parts" in p.stderr


def test_tokenizer_option_gives_a_dummy_model_text(tmp_path):
    """--tokenizer: dummy weights (no tokenizer beside config.json) take text through another model's tokenizer."""
    assert os.path.exists(SMOL), f"{SMOL} missing: `make test` fetches it (make model)"
    cfg = tiny_config(tmp_path / "config.json", vocab=49152)
    base = [LETHE, "generate", "-m", cfg, "--load-format", "dummy", "--threads", "2", "-n", "3", "--temperature", "0",
            "--ignore-eos"]
    p = subprocess.run(base + ["-p", "hello there"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0  # text without a tokenizer
    p = subprocess.run(base + ["--tokenizer", SMOL, "-p", "hello there"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    p = subprocess.run(base + ["--tokenizer", str(tmp_path / "none"), "-p", "hello"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode != 0 and "none" in p.stderr
