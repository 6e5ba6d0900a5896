"""RetroInfer's C implementation (src/sparse/retroinfer.c through the sparse
contract on the CPU backend, driven by build/tests/test_retroinfer --ref)
against the numpy reference tests/ref/retroinfer_ref.py on random K / V / q:
the same clusters (member lists per KV head) and the same decode output up to
float rounding, at two budget levels and with a GQA group of 2 and 4.
"""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "ref"))
import retroinfer_ref as ref  # noqa: E402

BIN = os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "tests", "test_retroinfer")


@pytest.mark.parametrize("seed,n,h,kh,d,retrieve,estimate", [
    (1, 400, 4, 2, 16, 0.018, 0.232),
    (2, 700, 8, 2, 32, 0.1, 0.3),
    (3, 333, 4, 1, 16, 0.25, 0.5),
])
def test_matches_reference(tmp_path, seed, n, h, kh, d, retrieve, estimate):
    rng = np.random.default_rng(seed)
    sink, recent, csize, segment, update, iters = 4, 16, 8, 128, 32, 9
    k = (rng.standard_normal((n, kh, d)) * 1.2).astype(np.float32)
    v = rng.standard_normal((n, kh, d)).astype(np.float32)
    q = (rng.standard_normal((h, d)) * 1.2).astype(np.float32)
    inp = tmp_path / "in.bin"
    with open(inp, "wb") as f:
        f.write(struct.pack("10i", n, h, kh, d, sink, recent, csize, segment, update, iters))
        f.write(struct.pack("2d", retrieve, estimate))
        f.write(k.tobytes() + v.tobytes() + q.tobytes())
    out = tmp_path / "out.bin"
    r = subprocess.run([BIN, "--ref", str(inp), str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    buf = out.read_bytes()
    off = 0

    def ints(cnt):
        nonlocal off
        a = np.frombuffer(buf, dtype=np.int32, count=cnt, offset=off)
        off += 4 * cnt
        return a

    heads, end = ref.build_index(k, v, sink, recent, csize, segment, iters)
    for hh in range(kh):
        c_end, n_cl = ints(2)
        assert c_end == end
        mbeg = ints(n_cl + 1)
        mem = ints(int(mbeg[-1]))
        got = sorted(tuple(mem[mbeg[c]:mbeg[c + 1]]) for c in range(n_cl))
        want = sorted(tuple(c[0]) for c in heads[hh])
        assert got == want, f"head {hh}: clusters differ"
    o = np.frombuffer(buf, dtype=np.float32, count=h * d, offset=off).reshape(h, d)
    want = ref.decode(k, v, q, heads, end, sink, retrieve, estimate)
    err = np.abs(o - want).max()
    print(f"max abs err {err:.2e}")
    assert err < 2e-5
