"""`lethe fit palu` on SmolLM2-135M with a small calibration text (two State of
the Union speeches), then `--sparse-method palu` with the factors it wrote:

- the fit writes palu.json (ranks from the ratio) + palu.safetensors;
- the factors load; the pool holds 2x the slots of dense at rank ratio 0.5
  (latents of 32 of 64 dims), read from the engine's start-up line;
- full rank (ratio 1): the logits of a forced continuation equal dense's up to
  float rounding (the factors are a rotation of each head);
- at ratio 0.5 the logits stay near dense (KL, top-1 printed; SmolLM2's values
  lose ~20% of their energy at rank 32 of 64, so this is a loose bound);
- a missing factors folder and no factors at all are clear errors.
"""
import json
import os
import re
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SOTU = "/work/shared/data/sotu"
CALIB = [os.path.join(SOTU, "1790_george_washington_n.txt"), os.path.join(SOTU, "1791_george_washington_n.txt")]
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")


def lethe(*args, timeout=600):
    return subprocess.run([LETHE, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=ENV)


def fit(out, ratio):
    args = ["fit", "palu", SMOL, "--samples", "3", "--seq-len", "192", "--rank-ratio", str(ratio),
            "--out", str(out), "--threads", "2"]
    for c in CALIB:
        args += ["--calib", c]
    r = lethe(*args)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "palu.json").read_text())


@pytest.fixture(scope="module")
def factors(tmp_path_factory):
    base = tmp_path_factory.mktemp("palu")
    half, full = base / "r050", base / "r100"
    return {"half": (half, fit(half, 0.5)), "full": (full, fit(full, 1.0))}


TEXT = open(os.path.join(SOTU, "1795_george_washington_n.txt")).read()[:3000]


def batch(tmp_path, line, method=None, cfg=None):
    src, dst, dump = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "l.bin"
    src.write_text(json.dumps(line) + "\n")
    args = ["generate", "--model", SMOL, "--input", str(src), "--output", str(dst), "--dump-logits", str(dump),
            "--threads", "2", "--temperature", "0", "--max-model-len", "2048"]
    if method:
        args += ["--sparse-method", method, "--sparse-config", cfg]
    r = lethe(*args)
    assert r.returncode == 0, r.stderr
    slots = int(re.search(r"KV (\d+) slots per layer", r.stderr).group(1))
    out = json.loads(dst.read_text().splitlines()[0])
    return out, np.fromfile(dump, dtype="<f4").reshape(len(out["token_ids"]), -1), slots


def forced_logits(tmp_path, continuation, method=None, cfg=None):
    """logits of dense's own 24-token greedy continuation of a speech passage
    (a text the factors were not fitted on)"""
    _, logits, slots = batch(tmp_path, {"prompt": TEXT, "forced_token_ids": continuation}, method, cfg)
    return logits, slots


def kl_top1(p_logits, q_logits):
    def logsm(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    lp, lq = logsm(p_logits.astype(np.float64)), logsm(q_logits.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1).mean()
    top1 = (p_logits.argmax(axis=1) == q_logits.argmax(axis=1)).mean()
    return kl, top1


def test_fit_writes_factors(factors):
    d, meta = factors["half"]
    assert meta["format"] == "lethe-palu-1" and meta["n_layers"] == 30 and meta["head_dim"] == 64
    assert meta["ranks"] == [32] * 30 and meta["calibration"]["tokens"] == 3 * 192
    assert (d / "palu.safetensors").stat().st_size > 30 * 4 * 3 * 32 * 64 * 4
    assert 0.5 < meta["energy_kept"]["k_mean"] <= 1.0
    assert factors["full"][1]["ranks"] == [64] * 30
    assert factors["full"][1]["energy_kept"]["k_min"] > 0.999999


def test_palu_vs_dense(factors, tmp_path):
    out, _, _ = batch(tmp_path, {"prompt": TEXT, "max_tokens": 24})
    cont = out["token_ids"]
    dense, dense_slots = forced_logits(tmp_path, cont)
    full, full_slots = forced_logits(tmp_path, cont, "palu", f"palu_factors={factors['full'][0]}")
    half, half_slots = forced_logits(tmp_path, cont, "palu", f"palu_factors={factors['half'][0]}")
    assert full_slots == dense_slots
    assert half_slots == 2 * dense_slots or abs(half_slots - 2 * dense_slots) <= 2
    err = np.abs(full - dense).max() / np.abs(dense).max()
    kl_h, top1_h = kl_top1(dense, half)
    print(f"palu full rank: max |logit diff| / max |logit| {err:.2e}; rank 32/64: KL {kl_h:.4f}, top-1 {top1_h:.2f}, "
          f"slots {half_slots} vs dense {dense_slots}")
    assert err < 2e-3
    assert kl_h < 1.2 and top1_h >= 0.3  # SmolLM2 (3 KV heads of 64): V keeps ~80% of its energy at rank 32


def test_missing_factors_is_a_clear_error(tmp_path):
    r = lethe("generate", "--model", SMOL, "-p", "hi", "-n", "1", "--sparse-method", "palu",
              "--sparse-config", f"palu_factors={tmp_path / 'nothing'}")
    assert r.returncode != 0 and "lethe fit palu" in r.stderr and "palu.json" in r.stderr
    r = lethe("generate", "--model", SMOL, "-p", "hi", "-n", "1", "--sparse-method", "palu")
    assert r.returncode != 0 and "palu_factors" in r.stderr
