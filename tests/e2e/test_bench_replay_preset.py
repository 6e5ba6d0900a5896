"""`lethe bench replay --preset long-agents` on the CPU, scaled down: the preset's trace shape,
configurations and serve flags, with small overrides (a 2-layer dummy Llama with the Llama-3
tokenizer, short tool outputs, a KV pool that holds about one agent at full length). Every
configuration must finish every turn; the report carries turns/s, TTFT percentiles, reused vs
computed prompt tokens and preemptions. The full-size run is the GPU check's (scripts/gpu-check.sh)."""
import json
import os
import subprocess

from lethe_server import BIN, ROOT

LLAMA3_TOK = next((d for d in (os.path.join(ROOT, "..", "shared", "data", "tokenizers", "llama3"),
                               "/work/shared/data/tokenizers/llama3") if os.path.exists(os.path.join(d, "tokenizer.json"))),
                  None)


def test_long_agents_preset_small(tmp_path):
    assert LLAMA3_TOK is not None, "Llama-3 tokenizer not found in ../shared/data/tokenizers/llama3"
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2,
           "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "bos_token_id": 128000, "eos_token_id": 128009, "tie_word_embeddings": False, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "replay.json"
    # 3 agents x 6 turns of ~250-word tool outputs, ending before 1800 tokens; 512 B per token on the
    # CPU (2 layers x 2 heads x 16 x K, V x f32): 1 MiB = 2048 slots, about one agent at full length
    p = subprocess.run([BIN, "bench", "replay", "--preset", "long-agents", "--agents", "3", "--min-turns", "6",
                        "--max-turns", "6", "--system-tokens", "40", "--task-tokens", "30", "--tool-min", "200",
                        "--tool-max", "300", "--out-min", "3", "--out-max", "5", "--max-context", "1800",
                        "--wait-scale", "0", "--model", str(tmp_path / "config.json"), "--port", "18783",
                        "--sparse-config", "sink_keep_tokens=4,recent_keep_tokens=32,decode_keep_tokens=64",
                        "--serve-args", f"--load-format dummy --threads 2 --tokenizer {LLAMA3_TOK} --max-model-len 2048 "
                        "--kv-cache-bytes 1M",
                        "--result-json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    j = json.loads(out.read_text())
    assert j["preset"] == "long-agents"
    assert j["serve_args"].startswith("--max-model-len 81920 --kv-cache-bytes 16G ")  # preset first, ours win
    assert j["trace"]["agents"] == 3 and j["trace"]["tool_min"] == 200
    assert 1200 < j["trace"]["longest_context_tokens"] <= 1800
    res = {r["config"]: r for r in j["results"]}
    assert set(res) == {"dense-radix", "snapkv-chain"}  # the preset's configurations
    for r in res.values():
        assert r["turns_ok"] == r["turns"] and "first_error" not in r
        # forced replies: the same work (chain turns render the appended messages alone: a few
        # tokens of template whitespace differ from the full render under the Llama-3 template)
        assert abs(r["prompt_tokens"] - res["dense-radix"]["prompt_tokens"]) <= 0.01 * r["prompt_tokens"]
        assert r["output_tokens"] == res["dense-radix"]["output_tokens"]
        assert r["turns_per_s"] > 0 and r["preemptions"] >= 0
        assert r["p99_ttft_ms"] >= r["p50_ttft_ms"] > 0
        assert r["reused_tokens"] + r["computed_prompt_tokens"] == r["prompt_tokens"]
    # chains prefill only what each turn appends; radix at best the same, more after evictions
    assert res["snapkv-chain"]["computed_prompt_tokens"] <= res["dense-radix"]["computed_prompt_tokens"]
    assert res["snapkv-chain"]["chains_resumed"] > 0
    assert "turns/s" in p.stdout and "preemptions" in p.stdout


def test_unknown_preset():
    p = subprocess.run([BIN, "bench", "replay", "--preset", "nope"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "unknown" in p.stderr
