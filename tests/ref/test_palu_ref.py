"""`lethe fit palu` and the palu method (tools/fit_palu.c, src/sparse/palu.c)
vs the numpy reference tests/ref/palu_ref.py (the paper's whitened SVD,
Cholesky of X^T X and an SVD of W S) on the tiny checkpoints tiny-llama and
tiny-qwen2 (qkv bias: the affine map [W b]), group size 2 (one group of
both KV heads per layer), rank 16 of 32 (ratio 0.5), 4 x 64 random
calibration token ids (a *.ids file):

- the factors: lethe's k_up k_down [W b] equals the reference's L R (the
  sign-free product) to 1e-5 relative for K and V of every layer, the
  latents of the calibration inputs agree up to each latent's sign and one
  convention (lethe whitens with X^T X / N, the paper with X^T X: lethe's
  latents are the paper's times N^(1/4), the product L R the same), and the
  energy kept in palu.json equals the reference's;
- what the method keeps and reconstructs: `lethe generate` with those
  factors, teacher-forced, gives the logits of a numpy forward whose keys and
  values are the reference's rank-16 reconstructions (RoPE after the keys'
  reconstruction) to 1e-5 relative, while dense's logits differ from them
  (the compression is real);
- calibration ids outside the vocabulary are a clear error.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import palu_ref  # noqa: E402
from model_np import Model, load_safetensors  # noqa: E402

LETHE = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe")
SAMPLES, SEQ = 4, 64
ENV = dict(os.environ, OMP_WAIT_POLICY="passive")


def calib_ids():
    """seeded random token ids in [3, 255] (the tiny models take ids; a layer's
    first inputs depend on the token only, so X^T X needs more distinct tokens
    than the model width: a byte text has too few)"""
    return [int(t) for t in np.random.default_rng(5).integers(3, 256, SAMPLES * SEQ)]


def lethe(*args):
    r = subprocess.run([LETHE, *args], capture_output=True, text=True, cwd=ROOT, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr
    return r


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def fitted(request, tmp_path_factory):
    name = request.param
    folder = os.path.join(ROOT, "tests", "data", name)
    tmp = tmp_path_factory.mktemp("palu-" + name)
    ids = calib_ids()
    (tmp / "calib.ids").write_text(" ".join(map(str, ids)) + "\n")
    out = tmp / "factors"
    lethe("fit", "palu", folder, "--calib", str(tmp / "calib.ids"), "--samples", str(SAMPLES), "--seq-len",
          str(SEQ), "--rank-ratio", "0.5", "--group-size", "2", "--out", str(out), "--threads", "1")
    meta = json.loads((out / "palu.json").read_text())
    w = load_safetensors(str(out / "palu.safetensors"))
    m = Model(folder)
    ref = palu_ref.Palu(m, [ids[s * SEQ:(s + 1) * SEQ] for s in range(SAMPLES)], 0.5, gs=2)
    return name, folder, out, meta, w, m, ref


def test_factors_match_reference(fitted):
    name, _, _, meta, w, m, ref = fitted
    assert ref.r == 16 and meta["ranks"] == [16] * m.L and meta["group_size"] == 2
    assert meta["calibration"]["tokens"] == SAMPLES * SEQ
    worst_p, worst_h, ek, ev = 0.0, 0.0, [], []
    for l in range(m.L):
        X1 = np.concatenate([ref.X[l], np.ones((ref.X[l].shape[0], 1))], axis=1)
        for which in ("k", "v"):
            down = w[f"layers.{l}.{which}_down"].astype(np.float64)  # [ng, r, gd]
            up = w[f"layers.{l}.{which}_up"].astype(np.float64)      # [ng, gd, r]
            for g in range(ref.ng):
                A = ref.affine(l, which, g)          # y = A [x; 1], the group's pre-RoPE k / v
                P_lethe = up[g] @ down[g] @ A        # lethe: latent = down y, reconstruction up latent
                P_ref = ref.projector(l, which, g)
                e = rel(P_lethe, P_ref)
                worst_p = max(worst_p, e)
                assert e < 1e-5, f"{name} layer {l} {which}: L R differs by {e:.2e}"
                # the latents of the calibration inputs, up to the sign of each latent
                L, R, energy = (ref.k if which == "k" else ref.v)[l][g]
                h_ref = X1[:, :R.shape[1]] @ R.T
                h_lethe = (X1 @ A.T) @ down[g].T
                # lethe whitens with X^T X / N (latents independent of the
                # calibration size): its latents are the paper's x N^(1/4)
                h_ref = h_ref * X1.shape[0] ** 0.25
                sign = np.sign((h_ref * h_lethe).sum(axis=0))
                e = rel(h_lethe * sign, h_ref)
                worst_h = max(worst_h, e)
                assert e < 1e-5, f"{name} layer {l} {which}: latents differ by {e:.2e}"
                (ek if which == "k" else ev).append(energy)
    assert abs(meta["energy_kept"]["k_mean"] - np.mean(ek)) < 1e-5
    assert abs(meta["energy_kept"]["v_mean"] - np.mean(ev)) < 1e-5
    print(f"{name}: L R rel err {worst_p:.2e}, latents {worst_h:.2e}, energy kept K {np.mean(ek):.4f} "
          f"V {np.mean(ev):.4f}")


def test_kept_and_reconstructed_kv_match_reference(fitted, tmp_path):
    name, folder, out, _, _, m, ref = fitted
    rng = np.random.default_rng(3)
    prompt = [int(t) for t in rng.integers(3, 256, 40)]
    forced = [int(t) for t in rng.integers(3, 256, 8)]
    src, dump = tmp_path / "in.jsonl", tmp_path / "logits.bin"

    def run(*extra):
        src.write_text(json.dumps({"prompt_token_ids": prompt, "forced_token_ids": forced}) + "\n")
        lethe("generate", "--model", folder, "--input", str(src), "--output", str(tmp_path / "out.jsonl"),
              "--dump-logits", str(dump), "--threads", "1", "--max-model-len", "128", *extra)
        return np.fromfile(dump, dtype="<f4").astype(np.float64).reshape(len(forced), -1)

    got = run("--sparse-method", "palu", "--sparse-config", f"palu_factors={out}")
    dense = run()
    tokens = prompt + forced[:-1]
    want = palu_ref.forward_palu(m, ref, tokens)[len(prompt) - 1:]
    e, e_dense = rel(got, want), rel(dense, want)
    print(f"{name}: lethe palu vs reference logits {e:.2e} (dense vs reference {e_dense:.2e})")
    assert e < 1e-5
    assert e_dense > 100 * e


def test_calib_ids_outside_the_vocabulary_are_an_error(tmp_path):
    (tmp_path / "bad.ids").write_text("3 4 999\n")
    r = subprocess.run([LETHE, "fit", "palu", os.path.join(ROOT, "tests", "data", "tiny-llama"), "--calib",
                        str(tmp_path / "bad.ids"), "--seq-len", "16", "--out", str(tmp_path / "f")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env=ENV)
    assert r.returncode != 0 and "vocabulary size 256" in r.stderr, r.stderr
