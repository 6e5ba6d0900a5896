"""`lethe bench engine` points with a synthetic context (B:I:O:s) on the CPU
over the tiny MoE, latent-attention, dense and hybrid checkpoints' configs
(dummy weights).

A synthetic point skips the prefill and decodes over I slots per sequence
whose KV rows are tiled with one random block (finite values, so attention
and MoE routing behave as after a prefill). The tests check that such a
point reports no prefill, decodes finitely, and has the same roofline bytes
per step as the prefilled point (the roofline is a function of the point,
not of how the KV was made); and that prefilled and synthetic points mix in
one run (one model load measures both).
"""
import json
import math
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
DATA = os.path.join(ROOT, "tests", "data")


def bench(tmp_path, model, points):
    out = tmp_path / f"{model}-{points.count(':s')}.json"
    r = subprocess.run([LETHE, "bench", "engine", "-m", os.path.join(DATA, model, "config.json"),
                        "--load-format", "dummy", "--device", "cpu", "-t", "2", "--points", points,
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(out.read_text()), r.stderr


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-glm4-moe-lite", "tiny-qwen3",
                                   "tiny-qwen3_5"])
def test_synthetic_context_decodes_with_the_same_roofline(tmp_path, model):
    if not os.path.exists(LETHE):
        pytest.fail(f"{LETHE} is not built")
    full, _ = bench(tmp_path, model, "1:200:6,3:700:6")
    syn, err = bench(tmp_path, model, "1:200:6:s,3:700:6:s,2:64:0")
    assert len(syn["points"]) == 3 and len(full["points"]) == 2, err
    prefill_only = syn["points"].pop()
    assert not prefill_only["synthetic_context"] and prefill_only["prefill_tok_s"] > 0
    for a, b in zip(full["points"], syn["points"]):
        assert (a["batch"], a["input"]) == (b["batch"], b["input"])
        assert not a["synthetic_context"] and b["synthetic_context"]
        assert a["prefill_s"] > 0 and b["prefill_s"] == 0 and b["prefill_tok_s"] == 0
        assert b["decode_tok_s"] > 0 and math.isfinite(b["decode_step_ms"])
        assert b["decode_bytes_per_step"] == pytest.approx(a["decode_bytes_per_step"], rel=1e-12)
