#!/usr/bin/env python3
"""gen_safetensors_fixtures.py - tiny checkpoints for tests/test_safetensors.c.

Written with the reference `safetensors` library (torch API, for BF16) so the
C parser is checked against files produced by the format's own writer:
  tests/data/st/tiny.safetensors    F32 [3,4], F16 [2,8], BF16 [16], I64 [4],
                                    F32 scalar [], F32 empty [0], + __metadata__
  tests/data/st/sharded/            model.safetensors.index.json + 2 shards
Values are simple closed forms (see the test) and exact in every dtype.
Run: python3 tests/gen/gen_safetensors_fixtures.py
"""
import json
import os

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "data", "st")


def main():
    os.makedirs(os.path.join(OUT, "sharded"), exist_ok=True)
    t = {
        "a.f32": (torch.arange(12, dtype=torch.float32) * 0.5 - 1).reshape(3, 4),
        "b.f16": ((torch.arange(16, dtype=torch.float32) - 8) * 0.125).to(torch.float16).reshape(2, 8),
        "c.bf16": ((torch.arange(16, dtype=torch.float32) - 8) * 0.25).to(torch.bfloat16),
        "d.i64": torch.arange(4, dtype=torch.int64) * 1000,
        "e.scalar": torch.tensor(3.0, dtype=torch.float32),
        "f.empty": torch.zeros(0, dtype=torch.float32),
    }
    save_file(t, os.path.join(OUT, "tiny.safetensors"), metadata={"format": "pt"})

    s1 = {"x": torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32)}
    s2 = {"y": torch.tensor([-1.0, 0.5, 2.0, 8.0], dtype=torch.bfloat16)}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(s1, os.path.join(OUT, "sharded", names[0]), metadata={"format": "pt"})
    save_file(s2, os.path.join(OUT, "sharded", names[1]), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 24}, "weight_map": {"x": names[0], "y": names[1]}}
    with open(os.path.join(OUT, "sharded", "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
