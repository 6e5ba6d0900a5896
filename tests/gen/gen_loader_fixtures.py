#!/usr/bin/env python3
"""gen_loader_fixtures.py - reference checksums for tests/test_loader.c.

Loads models/SmolLM2-135M-Instruct.Q4_1.gguf with HF transformers
(from_pretrained(..., gguf_file=...)), which dequantizes every tensor and
undoes llama.cpp's Q/K row permutation, giving HF-layout float32 weights.
For every tensor of the state dict it writes one line
    <hf name> <n elements> <sum_i x_i * ((i % 97) + 1)>   (float64, flat row-major)
to tests/data/loader/smollm2_q4_1_checksums.txt. The weighted sum is order
sensitive, so it checks name mapping, shapes and the un-permutation at once.
Run (needs torch + transformers, offline is fine):
    python3 tests/gen/gen_loader_fixtures.py
"""
import os

import torch
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
OUT = os.path.join(ROOT, "tests", "data", "loader", "smollm2_q4_1_checksums.txt")


def main():
    m = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, "models"), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        dtype=torch.float32)
    sd = m.state_dict()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        for name, t in sd.items():
            x = t.detach().reshape(-1).to(torch.float64)
            w = (torch.arange(x.numel(), dtype=torch.int64) % 97 + 1).to(torch.float64)
            f.write(f"{name} {x.numel()} {float((x * w).sum()):.17g}\n")
    print("wrote", OUT, len(sd), "tensors")


if __name__ == "__main__":
    main()
