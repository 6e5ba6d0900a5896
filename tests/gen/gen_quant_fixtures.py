#!/usr/bin/env python3
"""gen_quant_fixtures.py - reference data for tests/test_dequant.c.

For each ggml type writes tests/data/quant/<type>.q (raw block bytes) and
<type>.f32 (the expected little-endian float32 values) computed with the
`gguf` Python package (gguf.quants.dequantize), the reference implementation
published with the GGUF format. Blocks come from two sources:
  - gguf.quants.quantize of random normal data (types it can quantize), and
  - random bytes with the f16 scale fields set to finite values, which
    exercise every bit of the packed layouts (the only source for K-quants).
F16/BF16/F32 fixtures include zeros, subnormals, infinities and NaN.
Deterministic (fixed seed). Run: python3 tests/gen/gen_quant_fixtures.py
"""
import os

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

OUT = os.path.join(os.path.dirname(__file__), "..", "data", "quant")
rng = np.random.default_rng(1234)

# byte offsets of f16 scale fields inside one block, per type
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
QUANTIZABLE = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0}


def random_blocks(t, n_blocks):
    _, size = GGML_QUANT_SIZES[t]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        scale = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        b[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return b


def write(name, raw, ref):
    raw = np.ascontiguousarray(raw).view(np.uint8)
    ref = np.ascontiguousarray(ref, dtype="<f4")
    with open(os.path.join(OUT, name + ".q"), "wb") as f:
        f.write(raw.tobytes())
    with open(os.path.join(OUT, name + ".f32"), "wb") as f:
        f.write(ref.tobytes())
    print(f"{name}: {raw.size} bytes -> {ref.size} values")


def main():
    os.makedirs(OUT, exist_ok=True)
    for t in F16_FIELDS:
        block, _ = GGML_QUANT_SIZES[t]
        parts = []
        if t in QUANTIZABLE:
            x = rng.standard_normal(4 * block).astype(np.float32)
            x[:block] = 0.0                      # an all-zero block
            x[block:2 * block] *= 1000.0         # a large-magnitude block
            parts.append(quantize(x.reshape(1, -1), t).reshape(-1, GGML_QUANT_SIZES[t][1]))
        parts.append(random_blocks(t, 4))
        raw = np.concatenate(parts, axis=0)
        ref = dequantize(raw.reshape(-1), t).reshape(-1)
        write(t.name.lower(), raw, ref)

    # float types: specials included
    special = np.array([0.0, -0.0, 1.0, -2.5, 65504.0, 6e-8, 3e-5, np.inf, -np.inf, np.nan],
                       dtype=np.float32)
    f = np.concatenate([special, rng.standard_normal(54).astype(np.float32)])
    h = f.astype(np.float16)
    h_bits = h.view(np.uint16).copy()
    h_bits[-1] = 0x0001                           # smallest subnormal
    h_bits[-2] = 0x03ff                           # largest subnormal
    write("f16", h_bits, dequantize(h_bits.view(np.uint8), T.F16))
    bf = quantize(f, T.BF16)                      # round-to-nearest-even to bf16
    write("bf16", bf, dequantize(bf.view(np.uint8), T.BF16))
    write("f32", f, f)


if __name__ == "__main__":
    main()
