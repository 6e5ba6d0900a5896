"""scripts/gen_docs.py: tables and plots from result JSON, hand-written text left intact.

Builds a scratch docs/ folder with result files shaped like the ones
`lethe eval` and `lethe bench serve` write, then checks that regeneration
only touches the text between gen markers (a hand-written CUDA section and
the preamble survive byte for byte), that every row carries its method and
knobs and every result its commit / date / machine / model, that rows with
an error keep score 0 and the reason, that the PNGs are real PNGs, that
--check tells up-to-date from stale, and that missing docs / markers are
created (and not created when there is nothing to show), and that the
repository's own docs match its result files.
"""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEN = os.path.join(ROOT, "scripts", "gen_docs.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def eval_result(methods=("dense", "snapkv"), budgets=(512, 1024)):
    rows = []
    cfgs = [("dense", None, "")] + [(m, b, f"decode_keep_tokens={b}") for m in methods if m != "dense" for b in budgets]
    for m, b, k in cfgs:
        for L in (2048, 4096):
            for i, t in enumerate(["passkey", "niah_multikey", "vt", "cwe"]):
                row = {"method": m, "budget": b, "knobs": k, "context_length": L, "task": t, "n": 2,
                       "score": round(0.5 + 0.1 * i - (0.2 if b == 512 else 0), 3), "exact": 0.5}
                if L == 4096 and t == "cwe" and m == "dense":
                    row.update(score=0.0, error="context length 4096 exceeds the model's max_model_len 2048")
                rows.append(row)
            pr = {"method": m, "budget": b, "knobs": k, "context_length": L, "task": "ppl", "n": 2, "ppl": 9.5 + L / 4096}
            if m != "dense":
                pr.update(kl_mean=0.01 * (2048 / b), kl_p99=0.1, top1_agree=0.9 + b / 20480)
            rows.append(pr)
    return {"schema": "lethe-eval/1", "date": "2025-01-02T03:04:05Z", "commit": "abc123def456",
            "machine": "testhost: Test CPU, 2 cores", "device": "cpu", "threads": 2,
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "max_model_len": 2048, "corpus": "../shared/data/sotu",
            "ppl_corpus": "../shared/data/sotu", "seed": 0, "samples": 2, "forced_tokens": 64,
            "context_lengths": [2048, 4096], "prompt_format": "chat template", "command": "lethe eval ...",
            "rows": rows}


def serve_result(rate):
    return {"schema": "lethe-bench-serve/1", "date": "2025-01-03T00:00:00Z", "commit": "fedcba987654",
            "machine": "testhost: Test CPU, 2 cores", "model_id": "smol", "method": "dense", "knobs": "",
            "endpoint": "/v1/completions", "random_input_len": 512, "random_output_len": 64,
            "random_range_ratio": 0.0, "shared_prefix_len": 0, "request_rate": rate, "max_concurrency": None,
            "completed": 10, "failed": 0, "request_throughput": 1.5 * rate, "output_throughput": 96.0 * rate,
            "mean_ttft_ms": 100.0 * rate, "p99_ttft_ms": 180.0, "mean_tpot_ms": 12.5, "p99_tpot_ms": 20.0,
            "mean_itl_ms": 12.4, "p99_itl_ms": 25.0, "mean_e2el_ms": 900.0,
            "server_metrics": {"mean_ttft_ms": 98.0 * rate}}


def run(*args):
    return subprocess.run([sys.executable, GEN, *args], capture_output=True, text=True, timeout=300)


def setup(tmp_path):
    docs = tmp_path / "docs"
    res = docs / "results"
    res.mkdir(parents=True)
    (res / "eval-a.json").write_text(json.dumps(eval_result()))
    (res / "serve-1.json").write_text(json.dumps(serve_result(1)))
    (res / "serve-2.json").write_text(json.dumps(serve_result(2)))
    (res / "unrelated.json").write_text(json.dumps({"schema": "something-else"}))
    return docs, res


def test_regenerates_between_markers_only(tmp_path):
    docs, res = setup(tmp_path)
    hand_top = "# Benchmarks\n\nHand-written intro.\n\n"
    cuda = "## CUDA (written by hand)\n\n| kernel | GB/s |\n|---|---|\n| attn | 3000 |\n"
    (docs / "benchmarks.md").write_text(
        hand_top + "<!-- gen:begin serve -->\nstale table\n<!-- gen:end serve -->\n\n" + cuda)
    p = run("--results", str(res), "--docs", str(docs))
    assert p.returncode == 0, p.stderr
    b = (docs / "benchmarks.md").read_text()
    assert b.startswith(hand_top) and b.endswith(cuda)
    assert "stale table" not in b
    assert "`fedcba987654`" in b and "testhost: Test CPU, 2 cores" in b and "| smol | dense |" in b
    assert "in 512 / out 64" in b and "100.0 / 180.0" in b and "98.0" in b
    assert "![serving latency vs throughput](img/serve.png)" in b
    # quality.md did not exist: created with the preamble and the generated section
    q = (docs / "quality.md").read_text()
    assert q.startswith("# Quality") and "<!-- gen:begin quality -->" in q
    assert "`abc123def456`" in q and "2025-01-02T03:04:05Z" in q and "SmolLM2-135M-Instruct.Q4_1.gguf" in q
    assert "| snapkv | 512 | `decode_keep_tokens=512` | 2048 | 2 |" in q
    assert "| dense | full (reference) | — | 4096 | 2 |" in q
    assert "exceeds the model's max_model_len 2048" in q  # the reason is kept, the row is not dropped
    assert "0.00 [1]" in q
    for png in ("img/quality-eval-a.png", "img/serve.png"):
        data = (docs / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000
    # up to date now; a changed result makes --check fail without touching the file
    assert run("--results", str(res), "--docs", str(docs), "--check").returncode == 0
    (res / "serve-3.json").write_text(json.dumps(serve_result(4)))
    before = (docs / "benchmarks.md").read_text()
    c = run("--results", str(res), "--docs", str(docs), "--check")
    assert c.returncode == 1 and "out of date" in c.stderr
    assert (docs / "benchmarks.md").read_text() == before
    # edits outside the markers survive a regeneration
    q2 = q.replace("# Quality\n", "# Quality\n\nA hand-written note.\n", 1)
    (docs / "quality.md").write_text(q2)
    assert run("--results", str(res), "--docs", str(docs), "--no-plots").returncode == 0
    assert "A hand-written note." in (docs / "quality.md").read_text()


def test_appends_markers_when_missing(tmp_path):
    docs, res = setup(tmp_path)
    (docs / "quality.md").write_text("# Quality\n\nOnly prose here.\n")
    assert run("--results", str(res), "--docs", str(docs), "--no-plots").returncode == 0
    q = (docs / "quality.md").read_text()
    assert q.startswith("# Quality\n\nOnly prose here.\n")
    assert q.count("<!-- gen:begin quality -->") == 1 and q.rstrip().endswith("<!-- gen:end quality -->")


def test_method_without_budget_says_so(tmp_path):
    """A quantization method run without a token budget is labelled as such, not given a number."""
    r = eval_result(methods=("dense",))
    for L in (2048, 4096):
        r["rows"].append({"method": "kivi", "budget": None, "knobs": "", "context_length": L, "task": "ppl",
                          "n": 1, "ppl": 9.7, "kl_mean": 0.002, "kl_p99": 0.02, "top1_agree": 0.99})
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "results" / "q.json").write_text(json.dumps(r))
    assert run("--results", str(docs / "results"), "--docs", str(docs), "--no-plots").returncode == 0
    q = (docs / "quality.md").read_text()
    assert "| kivi | none (no token budget) | — | 2048 | 1 |" in q
    assert "| dense | full (reference) | — | 2048 | 2 |" in q


def test_plot_eval_dense_only_and_budgets(tmp_path):
    for name, r in (("dense", eval_result(methods=("dense",))), ("budgets", eval_result())):
        j = tmp_path / f"{name}.json"
        j.write_text(json.dumps(r))
        png = tmp_path / f"{name}.png"
        p = run("plot-eval", str(j), str(png))
        assert p.returncode == 0, p.stderr
        assert png.read_bytes().startswith(PNG_MAGIC)


def test_repo_docs_are_up_to_date():
    """docs/quality.md and docs/benchmarks.md match docs/results/*.json (regenerate with gen_docs.py)."""
    p = run("--check")
    assert p.returncode == 0, p.stderr


def test_no_results_no_page(tmp_path):
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    assert run("--results", str(docs / "results"), "--docs", str(docs)).returncode == 0
    assert not (docs / "quality.md").exists() and not (docs / "benchmarks.md").exists()
    (docs / "benchmarks.md").write_text("# Benchmarks\n\nSomeone else's section.\n")
    assert run("--results", str(docs / "results"), "--docs", str(docs), "--check").returncode == 0
    assert run("--results", str(docs / "results"), "--docs", str(docs)).returncode == 0
    assert (docs / "benchmarks.md").read_text() == "# Benchmarks\n\nSomeone else's section.\n"


def test_sparse_capped_batch_and_notes(tmp_path):
    """A capacity point whose method batch hit max_num_seqs also shows the pool-limited batch and its
    ratio; the attention kernel and the result's notes are rendered with its conditions."""
    with open(os.path.join(ROOT, "docs", "results", "sparse-h200-llama8b-snapkv-32k.json")) as f:
        r = json.load(f)
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "results" / "s.json").write_text(json.dumps(r))
    assert run("--results", str(docs / "results"), "--docs", str(docs), "--no-plots").returncode == 0
    b = (docs / "benchmarks.md").read_text()
    assert "| 256 (381) |" in b and "Batch capped by max_num_seqs 256" in b
    assert "the pool alone holds 381 snapkv sequences (14.1x the dense batch of 27; timed batch 256 = 9.5x)" in b
    assert "attention kernel v2" in b and "Notes: device copy of the working tree" in b


def grid_result(method, budgets, knob, extra="", tok_bytes=46080, error_at=None):
    """one scripts/quality-grid.sh file: dense + one method at each budget / level, ppl rows only"""
    cfgs = [("dense", None, "")] + [(method, b, ",".join(x for x in (extra, f"{knob}={b}" if b is not None else "") if x))
                                    for b in budgets]
    rows, configs = [], []
    for m, b, k in cfgs:
        configs.append({"method": m, "budget": b, "knobs": k, "kv_token_bytes": 46080 if m == "dense" else tok_bytes,
                        "kv_slot_overhead_bytes": 0})
        for L in (4096, 8000):
            r = {"method": m, "budget": b, "knobs": k, "context_length": L, "task": "ppl", "n": 4, "ppl": 30.0}
            if m != "dense":
                r.update(kl_mean=0.01 + (b or 0) / 1e5, kl_p99=0.1, top1_agree=0.95)
                if error_at == (b, L):
                    r = {**r, "kl_mean": None, "top1_agree": None, "error": "engine: out of memory"}
            rows.append(r)
    return {"schema": "lethe-eval/1", "date": "2026-12-03T09:00:00Z", "commit": "0123456789ab",
            "machine": "gpuhost: Xeon, 16 cores", "gpu": "NVIDIA H200", "device": "cuda", "threads": 1,
            "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "max_model_len": 8192, "corpus": "models/parts/sotu",
            "ppl_corpus": "models/parts/sotu", "ppl_documents": "1790_a.txt,1791_b.txt", "seed": 0, "samples": 4,
            "ppl_windows": 4, "forced_tokens": 64, "context_lengths": [4096, 8000], "command": "lethe eval ...",
            "configs": configs, "rows": rows}


def test_grid_tables(tmp_path):
    """quality-grid.sh files render as one table per context (method x budget, KL / top-1) and
    one of the size levels with bytes per token, not one table per file; an error is a cell."""
    docs = tmp_path / "docs"
    res = docs / "results"
    res.mkdir(parents=True)
    (docs / "quality.md").write_text("# Quality\n\n<!-- gen:begin quality-grid -->\n<!-- gen:end quality-grid -->\n")
    files = {"snapkv": grid_result("snapkv", (512, 1024, 2048), "decode_keep_tokens", error_at=(1024, 8000)),
             "kivi": grid_result("kivi", (2, 4), "kivi_bits", tok_bytes=6120),
             "deltakv-l96": grid_result("deltakv", (512, 1024, 2048), "decode_keep_tokens",
                                        "deltakv_compressor=/tmp/x/fits/deltakv-full,deltakv_latent=96", 21520),
             "fp8_kv": grid_result("fp8_kv", (None,), "")}
    for name, r in files.items():
        (res / f"smollm2-135m-q4_1-grid-{name}-h200.json").write_text(json.dumps(r))
    p = run("--results", str(res), "--docs", str(docs), "--no-plots")
    assert p.returncode == 0, p.stderr
    q = (docs / "quality.md").read_text()
    assert q.count("#### 4096 tokens") == 1 and q.count("#### 8000 tokens") == 1
    assert "commit `0123456789ab`" in q and "GPU: NVIDIA H200" in q and "(h200, 4 result files)" in q
    assert "| snapkv | eviction | `decode_keep_tokens` | — | 46080 | 0.0151 / 0.950 | 0.0202 / 0.950 | 0.0305 / 0.950 | 4 |" in q
    assert "| snapkv | eviction | `decode_keep_tokens` | — | 46080 | 0.0151 / 0.950 | error [1] | 0.0305 / 0.950 | 4 |" in q
    assert "[1] snapkv `decode_keep_tokens=1024` ctx 8000: engine: out of memory" in q
    assert "`deltakv_compressor=deltakv-full,deltakv_latent=96` | 21520 |" in q
    assert "| kivi | quantization | `kivi_bits=2` | 6120 | 7.53x | 0.0100 | 0.1000 | 0.950 | 30.00 | 4 |" in q
    assert "| fp8_kv | quantization | `defaults` | 46080 | 1.00x |" in q
    assert "Dense: ppl 30.00 over 4 windows (the same in all 4 processes), 46080 KV bytes per token." in q
    assert "### SmolLM2" not in q  # no per-file tables for grid files
