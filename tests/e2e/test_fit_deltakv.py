"""`lethe fit deltakv` on SmolLM2-135M with a small calibration text (two State
of the Union speeches), then `--sparse-method deltakv` with the compressor it
wrote:

- the fit writes deltakv.json (shape, latent, calibration) + deltakv.safetensors
  with a progress line;
- the compressor loads; at latent 96 of 384 the pool holds > 1.5x the slots
  of dense (read from the start-up line; 2.14x the bytes per token, less the
  raw buffers' reserve);
- full latent (a rotation): the logits of a forced continuation with blocks
  compressed equal dense's up to float rounding;
- latent 96 and top-128 selection stay near dense (KL, top-1 printed);
- no compressor, a missing folder and damaged files (another format, another
  shape, truncated tensors, non-finite weights) are clear errors.
"""
import json
import os
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
SOTU = "/work/shared/data/sotu"
CALIB = [os.path.join(SOTU, "1790_george_washington_n.txt"), os.path.join(SOTU, "1791_george_washington_n.txt")]
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")
KNOBS = "sink_keep_tokens=16,recent_keep_tokens=64,decode_keep_tokens=4096"


def lethe(*args, timeout=900):
    return subprocess.run([LETHE, *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def comp(tmp_path_factory):
    out = tmp_path_factory.mktemp("dkv") / "full"
    args = ["fit", "deltakv", SMOL, "--samples", "3", "--seq-len", "192", "--latent", "384", "--sink-tokens", "16",
            "--out", str(out), "--threads", "2"]
    for c in CALIB:
        args += ["--calib", c]
    r = lethe(*args)
    assert r.returncode == 0, r.stderr
    assert "calibration sample 3 / 3" in r.stderr and "layer 30 / 30 factored" in r.stderr
    return out, json.loads((out / "deltakv.json").read_text())


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


def kl_top1(p_logits, q_logits):
    def logsm(x):
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    lp, lq = logsm(p_logits.astype(np.float64)), logsm(q_logits.astype(np.float64))
    return (np.exp(lp) * (lp - lq)).sum(axis=1).mean(), (p_logits.argmax(axis=1) == q_logits.argmax(axis=1)).mean()


def test_fit_writes_compressor(comp):
    d, meta = comp
    assert meta["format"] == "lethe-deltakv-1" and meta["n_layers"] == 30 and meta["n_kv_heads"] == 3
    assert meta["head_dim"] == 64 and meta["latent"] == 384 and meta["calibration"]["tokens"] == 3 * 192
    assert meta["energy_kept"]["min"] > 0.999999  # full latent
    assert (d / "deltakv.safetensors").stat().st_size > 30 * 2 * 384 * 384 * 4


def test_deltakv_vs_dense(comp, tmp_path):
    d, _ = comp
    out, _, _ = batch(tmp_path, {"prompt": TEXT, "max_tokens": 24})
    line = {"prompt": TEXT, "forced_token_ids": out["token_ids"]}
    _, dense, dense_slots = batch(tmp_path, line)
    _, full, _ = batch(tmp_path, line, "deltakv", f"deltakv_compressor={d},{KNOBS}")
    _, q96, slots96 = batch(tmp_path, line, "deltakv", f"deltakv_compressor={d},deltakv_latent=96,{KNOBS}")
    _, sel, _ = batch(tmp_path, line, "deltakv",
                      f"deltakv_compressor={d},deltakv_latent=96,sink_keep_tokens=16,recent_keep_tokens=64,"
                      "decode_keep_tokens=128")
    err = np.abs(full - dense).max() / np.abs(dense).max()
    kl, top1 = kl_top1(dense, q96)
    kls, top1s = kl_top1(dense, sel)
    print(f"deltakv full latent: max |logit diff| / max |logit| {err:.2e}; latent 96/384: KL {kl:.4f}, top-1 "
          f"{top1:.2f}, slots {slots96} vs dense {dense_slots}; + top-128 selection: KL {kls:.4f}, top-1 {top1s:.2f}")
    assert err < 2e-3
    # f32 bytes per token: dense 30 x 2 x 192 x 4 = 46080; deltakv 5 full layers x 1536 + 25 DeltaKV layers x
    # (96 x 4 latent + 1536 / 10 centers + 16 fathers) = 21520, after the raw buffers' reserve (<= 1/4)
    assert slots96 > 1.5 * dense_slots
    assert kl < 1.5 and top1 >= 0.3
    assert kls < 2.0 and top1s >= 0.25


def run_with(cfg):
    return lethe("generate", "--model", SMOL, "-p", "hi", "-n", "1", "--sparse-method", "deltakv",
                 "--sparse-config", cfg, "--threads", "2")


def test_errors(comp, tmp_path):
    r = lethe("generate", "--model", SMOL, "-p", "hi", "-n", "1", "--sparse-method", "deltakv")
    assert r.returncode != 0 and "deltakv_compressor" in r.stderr and "lethe fit deltakv" in r.stderr
    r = run_with(f"deltakv_compressor={tmp_path / 'nothing'}")
    assert r.returncode != 0 and "lethe fit deltakv" in r.stderr and "deltakv.json" in r.stderr
    d, meta = comp
    bad = tmp_path / "bad"

    def fresh():
        if bad.exists():
            shutil.rmtree(bad)
        shutil.copytree(d, bad)

    fresh()
    (bad / "deltakv.json").write_text(json.dumps(dict(meta, format="lethe-palu-1")))
    r = run_with(f"deltakv_compressor={bad}")
    assert r.returncode != 0 and "not a lethe-deltakv-1" in r.stderr
    fresh()
    (bad / "deltakv.json").write_text(json.dumps(dict(meta, head_dim=32)))
    r = run_with(f"deltakv_compressor={bad}")
    assert r.returncode != 0 and "another shape" in r.stderr
    fresh()
    (bad / "deltakv.json").write_text(json.dumps(dict(meta, latent=200)))  # tensors say 384
    r = run_with(f"deltakv_compressor={bad}")
    assert r.returncode != 0 and "has another shape" in r.stderr
    fresh()
    st = (bad / "deltakv.safetensors").read_bytes()
    (bad / "deltakv.safetensors").write_bytes(st[: len(st) // 2])
    r = run_with(f"deltakv_compressor={bad}")
    assert r.returncode != 0 and "deltakv.safetensors" in r.stderr
    fresh()
    hl = struct.unpack("<Q", st[:8])[0]
    arr = bytearray(st)
    arr[8 + hl: 8 + hl + 4] = struct.pack("<f", float("nan"))
    (bad / "deltakv.safetensors").write_bytes(bytes(arr))
    r = run_with(f"deltakv_compressor={bad}")
    assert r.returncode != 0 and "non-finite" in r.stderr
    r = run_with(f"deltakv_compressor={d},deltakv_latent=400")
    assert r.returncode != 0 and "deltakv_latent=400" in r.stderr
