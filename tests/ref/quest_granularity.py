"""quest_granularity.py - does Quest's one page set per layer (lethe, the
anchor) cost quality against the paper's per-head page sets? The reference
answers it on a real model: a dense prefill of a natural-text context, then
teacher-forced decode of the continuation three times from the same cache,
dense, Quest shared (one page set per layer: bounds maxed over all query
heads) and Quest per KV head (bounds maxed over the group), and KL(dense ||
method) and top-1 agreement of the next-token distributions, as `lethe eval`'s
ppl task measures them.

    python3 tests/ref/quest_granularity.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --text ../shared/data/sotu/1790_george_washington_n.txt --context 8000 --forced 64 \\
        --budgets 512,1024,2048

Budget B as `lethe eval --budget-knob quest:decode_keep_tokens`: the method's
total is 64 + B + 512 tokens, pages of 16, the first 2 layers dense. float32.
"""
import argparse
import copy
import glob
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from methods_ref import Quest  # noqa: E402
from gguf_np import tokenizer_of  # noqa: E402
from model_np import Cache, Model, softmax  # noqa: E402


def decode_logits(m, cache, forced, policy):
    """logits [len(forced), V] of teacher-forcing forced[1:] after the cache
    (row 0: the prefill's last logits, passed in by the caller)"""
    rows = []
    n = cache.n(0)
    for i, t in enumerate(forced[:-1]):
        out = m.forward(cache, [t], [n + i], select=policy.selector(m, cache) if policy else None)
        rows.append(out.logits[0])
    return np.stack(rows)


def kl_top1(dense, other):
    pd, po = softmax(dense.astype(np.float64)), softmax(other.astype(np.float64))
    kl = np.sum(pd * (np.log(pd + 1e-30) - np.log(po + 1e-30)), axis=1)
    return float(kl.mean()), float(np.quantile(kl, 0.99)), float(np.mean(dense.argmax(1) == other.argmax(1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", nargs="+", required=True)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--forced", type=int, default=64)
    ap.add_argument("--budgets", default="512,1024,2048")
    a = ap.parse_args()
    t0 = time.time()
    m = Model(a.model, dtype=np.float32)
    tk = tokenizer_of(a.model)
    ids = []
    for f in sorted(sum((glob.glob(p) for p in a.text), [])):
        ids += tk.encode(open(f, encoding="utf-8", errors="replace").read()).ids
        if len(ids) >= a.context + a.forced:
            break
    ids = ids[:a.context + a.forced]
    assert len(ids) == a.context + a.forced, f"text too short: {len(ids)} tokens"
    prompt, forced = ids[:a.context], ids[a.context:]
    base = Cache(m)
    m.forward(base, prompt, list(range(len(prompt))))
    print(f"prefill {len(prompt)} tokens: {time.time() - t0:.0f} s", flush=True)
    dense = decode_logits(m, copy.deepcopy(base), forced, None)
    print("| context | budget B | pages read | shared: KL mean / p99 / top-1 | per KV head: KL mean / p99 / top-1 |")
    print("|---:|---:|---:|---|---|")
    for B in [int(x) for x in a.budgets.split(",")]:
        total = 64 + B + 512
        res = {}
        for level in ("shared", "head"):
            res[level] = kl_top1(dense, decode_logits(m, copy.deepcopy(base), forced, Quest(total, page=16, skip=2, level=level)))
        s, h = res["shared"], res["head"]
        print(f"| {a.context} | {B} | {max(3, total // 16)} | {s[0]:.4f} / {s[1]:.4f} / {s[2]:.3f} | "
              f"{h[0]:.4f} / {h[1]:.4f} / {h[2]:.3f} |", flush=True)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
