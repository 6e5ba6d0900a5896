"""`lethe eval` end to end on SmolLM2-135M at a short context (CPU, ~a minute on 2 cores).

One invocation with dense, SnapKV at a tiny budget and at a budget larger
than the context (which must equal dense: KL 0, top-1 agreement 1, same
perplexity), an unknown method (its rows carry the engine's error, score 0),
and a length above --max-model-len (its rows say so, score 0; never dropped).
Also checks the JSON's conditions (commit, date, machine, model, command),
the PNG plot, the stdout table, and flag errors.
"""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
CORPUS = os.path.join(ROOT, "tests", "data", "eval_corpus")
# OpenMP threads sleep instead of spinning at barriers: on a shared 2-core machine spinning
# workers of concurrent test processes cost several times the run time
ENV = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))


def test_eval_dense_vs_snapkv(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    p = subprocess.run(
        [LETHE, "eval", "--model", MODEL, "--corpus", CORPUS, "--context-lengths", "256,512",
         "--max-model-len", "300", "--samples", "1", "--forced-tokens", "8", "--tasks", "passkey,ppl",
         "--methods", "dense,snapkv,nosuch", "--budgets", "16,4096",
         "--sparse-config", "sink_keep_tokens=8,recent_keep_tokens=16", "--threads", "2",
         "--no-progress", "--result-json", str(out), "--plot", str(png)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stderr  # the unknown method fails its configurations
    assert "unknown method" in p.stderr
    r = json.loads(out.read_text())
    for k in ("commit", "date", "machine", "model", "command", "max_model_len"):
        assert r[k], k
    assert r["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and r["max_model_len"] == 300
    rows = {(x["method"], x["budget"], x["context_length"], x["task"]): x for x in r["rows"]}
    # dense + snapkv x 2 + nosuch x 2 configurations, 2 lengths, 2 tasks: nothing dropped
    assert len(r["rows"]) == 5 * 2 * 2
    d = rows[("dense", None, 256, "passkey")]
    assert d["prompt_tokens_mean"] <= 256 - 64 and "error" not in d
    assert d["score"] == 1.0, d["samples"]  # the model finds a pass key in 190 tokens
    dp = rows[("dense", None, 256, "ppl")]
    assert dp["scored_tokens"] == 8 and 1 < dp["ppl"] < 1e4 and "kl_mean" not in dp
    # a budget above the context keeps everything: identical to dense
    same = rows[("snapkv", 4096, 256, "ppl")]
    assert same["knobs"] == "sink_keep_tokens=8,recent_keep_tokens=16,decode_keep_tokens=4096"
    assert same["kl_mean"] < 1e-4 and same["top1_agree"] == 1.0
    assert abs(same["ppl"] - dp["ppl"]) <= 1e-3 * dp["ppl"]
    assert rows[("snapkv", 4096, 256, "passkey")]["score"] == d["score"]
    # 40 of ~250 tokens kept: the distributions move
    small = rows[("snapkv", 16, 256, "ppl")]
    assert small["kl_mean"] > 1e-3 and small["kl_p99"] >= small["kl_median"] >= 0
    assert len(small["kl_by_position"]) == 8
    # lengths the model cannot take and configurations that cannot start are rows with the reason
    for m, b in (("dense", None), ("snapkv", 16), ("snapkv", 4096)):
        for t in ("passkey", "ppl"):
            x = rows[(m, b, 512, t)]
            assert "exceeds the model's max_model_len 300" in x["error"]
            assert x.get("score", 0) == 0
    for b in (16, 4096):
        x = rows[("nosuch", b, 256, "passkey")]
        assert "unknown method" in x["error"] and x["score"] == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert "snapkv" in p.stdout and "passkey" in p.stdout


def test_eval_prefill_decode_pair(tmp_path):
    """A PREFILL+DECODE pair runs like any method, the knobs of both in one --sparse-config:
    with flashprefill reading every block and a budget above the context it equals dense."""
    out = tmp_path / "r.json"
    p = subprocess.run(
        [LETHE, "eval", "--model", MODEL, "--corpus", CORPUS, "--context-lengths", "256",
         "--samples", "1", "--forced-tokens", "8", "--tasks", "ppl", "--methods", "dense,flashprefill+snapkv",
         "--budgets", "16,4096", "--sparse-config",
         "sink_keep_tokens=8,recent_keep_tokens=16,flashprefill_threshold=0,flashprefill_min_q=2",
         "--threads", "2", "--no-progress", "--result-json", str(out)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = {(x["method"], x["budget"]): x for x in json.loads(out.read_text())["rows"]}
    same = rows[("flashprefill+snapkv", 4096)]
    assert "error" not in same and same["kl_mean"] < 1e-4 and same["top1_agree"] == 1.0
    assert rows[("flashprefill+snapkv", 16)]["kl_mean"] > 1e-3


def test_eval_flag_errors():
    p = subprocess.run([LETHE, "eval", "--model", MODEL], capture_output=True, text=True)
    assert p.returncode == 2 and "--corpus" in p.stderr
    p = subprocess.run([LETHE, "eval", "--model", MODEL, "--corpus", CORPUS, "--tasks", "passkey,nope"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "unknown task 'nope'" in p.stderr
    p = subprocess.run([LETHE, "eval", "--model", MODEL, "--corpus", "/nonexistent"], capture_output=True, text=True)
    assert p.returncode == 2 and "/nonexistent" in p.stderr
    p = subprocess.run([LETHE, "eval", "--model", MODEL, "--corpus", CORPUS, "--context-lengths", "2k,x"],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--context-lengths" in p.stderr
