"""`lethe bench sparse --parts ownpath` on the CPU backend at tiny sizes (a dummy 2-layer llama):
dense and each eviction method (SnapKV, PyramidKV, H2O, StreamingLLM) at the largest batch of a
pool planned for K dense requests, run for real through the method's own engine path with
repeats and the median; the batch follows the capacity arithmetic from the measured resident
slots, nothing preempts, max_tokens is what was requested."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")

SINK, RECENT, BUDGET, OUT, L, K = 8, 24, 96, 24, 512, 2
METHODS = ["snapkv", "pyramidkv", "h2o", "streamingllm"]


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    d = tmp_path_factory.mktemp("ownpath")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (d / "config.json").write_text(json.dumps(cfg))
    js = d / "ownpath.json"
    p = subprocess.run([LETHE, "bench", "sparse", "-m", str(d / "config.json"), "--load-format", "dummy",
                        "--device", "cpu", "--threads", "2", "--kv-cache-bytes", "4M",
                        "--max-num-batched-tokens", "256", "--budget", str(BUDGET), "--sink", str(SINK),
                        "--recent", str(RECENT), "--parts", "ownpath", "--ownpath-methods", ",".join(METHODS),
                        "--ownpath-inputs", str(L), "--ownpath-pool-requests", str(K), "--ownpath-output", str(OUT),
                        "--repeats", "2", "--no-progress", "--json", str(js)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(js.read_text()), p.stdout


def test_ownpath_batches_and_runs(result):
    r, out = result
    own = r["ownpath"]
    assert own["pool_requests"] == K and own["max_tokens"] == OUT and own["repeats"] == 2
    rows = {m["method"]: m for m in own["methods"]}
    assert list(rows) == ["dense"] + METHODS
    Sv = K * (L + OUT)
    for name, m in rows.items():
        assert "error" not in m, m
        (pt,) = m["points"]
        assert "error" not in pt, pt
        assert pt["input"] == L and pt["pool_slots_per_layer"] == Sv
        B, R, P = pt["batch"], pt["resident_R"], pt["prefill_peak_P"]
        if name == "dense":
            assert B == K
        else:
            assert R <= BUDGET + 3 and P <= L + OUT  # the budget (+ 3 decoded tokens); the prompt at most
            steady = R + OUT
            assert B == min(1 + (Sv - P) // steady, Sv // steady, r["max_num_seqs"])
            assert B > K  # the point of the method: more requests in the same pool
        assert len(pt["runs"]) == 2
        for run in pt["runs"]:
            assert run["requests"] == B and run["input"] == L and run["max_tokens"] == OUT  # as requested
            assert run["preemptions"] == 0 and "error" not in run
        toks = sorted(run["decode_tok_s"] for run in pt["runs"])
        assert pt["decode_tok_s_median"] == pytest.approx(sum(toks) / 2)
        assert pt["preemptions"] == 0
        assert pt["batch_vs_dense"] == pytest.approx(B / K)
    assert "own engine path" in out


def test_matched_repeats_median(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 256,
                               "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                               "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}))
    js = tmp_path / "m.json"
    p = subprocess.run([LETHE, "bench", "sparse", "-m", str(cfg), "--load-format", "dummy", "--device", "cpu",
                        "--threads", "2", "--kv-cache-bytes", "4M", "--max-num-batched-tokens", "256",
                        "--budget", str(BUDGET), "--sink", str(SINK), "--recent", str(RECENT), "--parts", "matched",
                        "--matched-methods", "snapkv", "--matched-batch", "2", "--matched-input", "256",
                        "--matched-output", "6", "--repeats", "3", "--no-progress", "--json", str(js)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    mt = json.loads(js.read_text())["matched"]
    assert mt["matched_output_requested"] == 6 and mt["repeats"] == 3
    for m in mt["methods"]:
        runs = m["decode_tok_s_runs"]
        assert len(runs) == 3 and m["decode_tok_s"] == pytest.approx(sorted(runs)[1])
