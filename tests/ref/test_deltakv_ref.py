"""The C DeltaKV (src/sparse/deltakv.c through tests/test_deltakv --dump) vs
the numpy reference tests/ref/deltakv_ref.py on the same inputs and a random
linear compressor written by numpy in lethe's file format: every step's
attention outputs of every layer agree (float32 vs float64), with every token
read (keep >= history) and with OmniKV selection at decode (keep 6)."""
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import deltakv_ref  # noqa: E402

BIN = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "tests", "test_deltakv")


@pytest.mark.parametrize("keep", [4096, 6])
def test_c_matches_reference(tmp_path, keep):
    NL, HK, d, lat = 3, 2, 16, 12
    rng = np.random.default_rng(7)
    D = 2 * HK * d
    down = [rng.standard_normal((lat, D)) / np.sqrt(D) for _ in range(NL)]
    up = [rng.standard_normal((D, lat)) / np.sqrt(lat) for _ in range(NL)]
    deltakv_ref.write_compressor(tmp_path, NL, HK, d, down, up)
    dump = tmp_path / "run.bin"
    r = subprocess.run([BIN, "--dump", str(dump), "--compressor", str(tmp_path), "--keep", str(keep)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg, steps = deltakv_ref.read_dump(dump)
    assert (cfg["NL"], cfg["HK"], cfg["d"], cfg["keep"]) == (NL, HK, d, keep)
    # the file's weights as the C side read them (f32)
    down32 = [w.astype(np.float32).astype(np.float64) for w in down]
    up32 = [w.astype(np.float32).astype(np.float64) for w in up]
    ref = deltakv_ref.DeltaKV(NL, cfg["H"], HK, d, cfg["s"], cfg["r"], cfg["stride"], cfg["K"], keep,
                              [True] + [False] * (NL - 1), down32, up32)
    n_prompt = sum(n for n, _, _ in steps if n > 1)
    worst, n_latent_reads = 0.0, 0
    for n, first, layers in steps:
        decode = first >= n_prompt
        outs = ref.step(first, [q.astype(np.float64) for q, _, _, _ in layers],
                        [k.astype(np.float64) for _, k, _, _ in layers],
                        [v.astype(np.float64) for _, _, v, _ in layers], decode)
        for l in range(NL):
            c = layers[l][3].astype(np.float64)
            e = np.linalg.norm(c - outs[l]) / np.linalg.norm(outs[l])
            worst = max(worst, e)
            assert e < 1e-4, f"step at {first} layer {l}: rel err {e:.2e}"
        n_latent_reads += sum(s == 2 for s in ref.layers[1].state)
    print(f"keep {keep}: {len(steps)} steps, worst rel err {worst:.2e}")
    assert n_latent_reads > 0  # compression ran
