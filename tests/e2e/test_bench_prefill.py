"""`lethe bench prefill` end to end on the CPU with the tiny Llama shape (dummy weights):
dense first, then prefill-axis methods, a second configuration of one method (NAME#LABEL),
KVzip (its context replay adds prefill work) and a PREFILL+DECODE pair, each with the
next-token distribution after the prompt compared with dense's on the same tokens.
Timings are printed, never asserted (a loaded 2-core VM)."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
FP = "flashprefill_min_q=2,flashprefill_block=32"


def test_bench_prefill_kl_and_labels(tmp_path):
    out = tmp_path / "p.json"
    p = subprocess.run(
        [LETHE, "bench", "prefill", "-m", "tests/data/tiny-llama/config.json", "--load-format", "dummy",
         "--device", "cpu", "--threads", "2", "--inputs", "100,64", "--warmup", "16",
         "--max-num-batched-tokens", "48",
         "--methods", "flashprefill,flashprefill#dense,omnikv_prefill,kvzip,flashprefill+snapkv",
         "--method-config", f"flashprefill:{FP},flashprefill_threshold=1,flashprefill_last_q_blocks=0,"
                            "flashprefill_sink_blocks=1,flashprefill_window_blocks=2",
         "--method-config", f"flashprefill#dense:{FP},flashprefill_threshold=0",
         "--method-config", "omnikv_prefill:omnikv_prefill_keep_tokens=8,omnikv_prefill_sink_tokens=2,"
                            "omnikv_prefill_recent_tokens=4,omnikv_full_layers=0",
         "--method-config", "kvzip:kvzip_token_budget=32,kvzip_chunk_size=16",
         "--method-config", f"flashprefill+snapkv:{FP},flashprefill_threshold=0,decode_keep_tokens=100000",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    assert r["schema"] == "lethe-bench-prefill/2"
    for k in ("commit", "date", "machine", "command"):
        assert r[k], k
    rows = {(x["method"], x["input"]): x for x in r["runs"]}
    assert len(rows) == 6 * 2
    for n in (100, 64):
        d = rows[("dense", n)]
        assert d["kl_vs_dense"] == 0 and d["top1_agree"] and d["speedup_vs_dense"] == 1
        # threshold 0 reads every block: dense's distribution bit for bit (the CPU twin)
        same = rows[("flashprefill#dense", n)]
        assert same["kl_vs_dense"] == 0 and same["top1_agree"] and same["knobs"].endswith("threshold=0")
        # the pair at identity budgets is dense too; KVzip's first token precedes its eviction
        assert rows[("flashprefill+snapkv", n)]["kl_vs_dense"] == 0
        assert rows[("kvzip", n)]["kl_vs_dense"] == 0
        for m in ("flashprefill", "omnikv_prefill", "kvzip"):
            x = rows[(m, n)]
            assert x["prefill_s"] > 0 and x["prefill_tok_s"] > 0 and x["speedup_vs_dense"] > 0, x
    # 100 tokens in chunks of 48: the last chunk's query blocks skip key block 1 (threshold 1,
    # one sink block, a window of two), omnikv_prefill reads 2 + 8 + 4 of 96 history tokens
    assert rows[("flashprefill", 100)]["kl_vs_dense"] > 0
    assert rows[("omnikv_prefill", 100)]["kl_vs_dense"] > 0
    assert "KL(dense)" in p.stdout and "flashprefill#dense" in p.stdout
