"""compare.py - lethe's selections (LETHE_DUMP_SELECTIONS) against the
references of methods_ref.py on the same token ids.

    python3 tests/ref/compare.py [--model tests/data/tiny-llama] [--lethe build/lethe]

runs every case of CASES through `lethe generate` (teacher-forced decode of a
fixed continuation, CPU) and through the reference, and prints per case the
Jaccard similarity of the positions each decode query reads, per (step,
layer, KV head): mean and min, against the reference of lethe's granularity
and against the other granularity (the paper's per-head sets vs the anchor's
shared ones). tests/e2e/test_ref_methods.py asserts the threshold.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from methods_ref import KVzip, Quest, RKV, SkipKV, run  # noqa: E402
from model_np import Model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

KVZ = "kvzip_token_budget=24,kvzip_chunk_size=24,kvzip_postfix=4,kvzip_sink_tokens=4"
KVZIP_INSTRUCTION = "\nReconstruct the following context span exactly:\n"  # lethe's (the anchor's) text
# (name, lethe method, --sparse-config, reference of lethe's granularity, the other
# granularity); t: the model's text facts (Text below)
CASES = [
    ("kvzip shared", "kvzip", KVZ,
     lambda t: KVzip(24, chunk=24, postfix=4, sink=4, instr=t.instr),
     lambda t: KVzip(24, chunk=24, postfix=4, sink=4, level="pair", instr=t.instr)),
    ("kvzip pair", "kvzip", KVZ + ",kvzip_level=pair",
     lambda t: KVzip(24, chunk=24, postfix=4, sink=4, level="pair", instr=t.instr),
     lambda t: KVzip(24, chunk=24, postfix=4, sink=4, instr=t.instr)),
    ("kvzip pair ratio 0.4", "kvzip", KVZ + ",kvzip_level=pair,kvzip_ratio=0.4",
     lambda t: KVzip(24, chunk=24, postfix=4, sink=4, level="pair", ratio=0.4, instr=t.instr), None),
    ("rkv", "rkv", "sink_keep_tokens=0,recent_keep_tokens=8,decode_keep_tokens=16,"
     "rkv_observation_tokens=4,rkv_compression_interval=8",
     lambda t: RKV(24, w=4, interval=8), lambda t: RKV(24, w=4, interval=8, level="head")),
    ("skipkv", "skipkv", "sink_keep_tokens=2,recent_keep_tokens=4,decode_keep_tokens=18,"
     "skipkv_compression_interval=8,skipkv_segment=4",
     lambda t: SkipKV(24, 2, 4, interval=8, segment=4, ends=t.ends),
     lambda t: SkipKV(24, 2, 4, interval=8, segment=4, ends=t.ends, embed="hidden")),
    ("quest", "quest", "sink_keep_tokens=0,recent_keep_tokens=0,decode_keep_tokens=32,"
     "quest_chunk_size=4,quest_skip_layers=0",
     lambda t: Quest(32, page=4, skip=0), lambda t: Quest(32, page=4, skip=0, level="head")),
    ("quest skip 1", "quest", "sink_keep_tokens=0,recent_keep_tokens=0,decode_keep_tokens=24,"
     "quest_chunk_size=4,quest_skip_layers=1",
     lambda t: Quest(24, page=4, skip=1), lambda t: Quest(24, page=4, skip=1, level="head")),
    # quest_granularity=head: each KV head its own top pages (the reference's per-head level)
    ("quest head", "quest", "sink_keep_tokens=0,recent_keep_tokens=0,decode_keep_tokens=32,"
     "quest_chunk_size=4,quest_skip_layers=0,quest_granularity=head",
     lambda t: Quest(32, page=4, skip=0, level="head"), lambda t: Quest(32, page=4, skip=0)),
    ("quest head skip 1", "quest", "sink_keep_tokens=0,recent_keep_tokens=0,decode_keep_tokens=24,"
     "quest_chunk_size=4,quest_skip_layers=1,quest_granularity=head",
     lambda t: Quest(24, page=4, skip=1, level="head"), lambda t: Quest(24, page=4, skip=1)),
]


class Text:
    """What the methods read of a model's tokenizer: KVzip's instruction ids,
    SkipKV's sentence ends (a token whose text holds . ! ? or a newline).
    Token-id models (the HF fixtures carry no tokenizer): none of either."""

    def __init__(self, model_path):
        self.instr, self.ends = (), None
        if model_path.endswith(".gguf"):
            from gguf_np import token_texts, tokenizer_of
            self.instr = tokenizer_of(model_path).encode(KVZIP_INSTRUCTION).ids
            texts = token_texts(model_path)
            self.ends = lambda tok: any(c in texts[tok] for c in b".!?\n")


def tokens(seed, n_prompt=60, n_forced=40, vocab=256):
    """random prompt and continuation; prompt[34:50] repeats prompt[10:26]
    verbatim, so that near-duplicate sentences exist (SkipKV's 4-token spans
    from position 2 line up with both copies)"""
    rng = np.random.default_rng(seed)
    prompt = [int(x) for x in rng.integers(3, vocab, n_prompt)]
    prompt[34:50] = prompt[10:26]
    return prompt, [int(x) for x in rng.integers(3, vocab, n_forced)]


def lethe_reads(lethe, model, method, config, prompt, forced, n_layers, n_kv):
    """[step][layer][head] -> positions read, from LETHE_DUMP_SELECTIONS"""
    with tempfile.TemporaryDirectory() as d:
        inp, outp, dump = (os.path.join(d, f) for f in ("in.jsonl", "out.jsonl", "sel.jsonl"))
        with open(inp, "w") as f:
            f.write(json.dumps({"prompt_token_ids": prompt, "forced_token_ids": forced, "max_tokens": len(forced)}) + "\n")
        env = dict(os.environ, LETHE_DUMP_SELECTIONS=dump, OMP_WAIT_POLICY="passive")
        r = subprocess.run([lethe, "generate", "--model", model, "--sparse-method", method, "--sparse-config", config,
                            "--input", inp, "--output", outp, "--threads", "1", "--no-enable-prefix-caching"],
                           capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"lethe generate {method} failed: {r.stderr[-2000:]}")
        steps = {}
        with open(dump) as f:
            for line in f:
                j = json.loads(line)
                st = steps.setdefault(j["step"], [None] * n_layers)
                heads = j.get("heads") or [j["pos"]] * n_kv
                layers = range(n_layers) if j["layer"] < 0 else [j["layer"]]
                for l in layers:
                    st[l] = [np.array(h, dtype=np.int64) for h in heads]
    return [steps[k] for k in sorted(steps)]


def jaccard(a, b):
    a, b = set(a.tolist()), set(b.tolist())
    return len(a & b) / len(a | b) if a | b else 1.0


def compare(got, ref):
    """Jaccard per (step, layer, head): (mean, min, count)"""
    assert len(got) == len(ref.reads), (len(got), len(ref.reads))
    js = [jaccard(g[h], r[h]) for gs, rs in zip(got, ref.reads) for g, r in zip(gs, rs) for h in range(len(g))]
    return float(np.mean(js)), float(np.min(js)), len(js)


def run_cases(lethe, model_dir, seeds=(0, 1)):
    m = Model(model_dir)
    t = Text(model_dir)
    rows = []
    for name, method, config, same, other in CASES:
        res = {"case": name, "method": method, "config": config}
        same_j, other_j = [], []
        for seed in seeds:
            prompt, forced = tokens(seed, vocab=m.cfg["vocab_size"])
            got = lethe_reads(lethe, model_dir, method, config, prompt, forced, m.L, m.Hk)
            same_j.append(compare(got, run(m, prompt, forced, same(t))))
            if other:
                other_j.append(compare(got, run(m, prompt, forced, other(t))))
        res["same"] = (float(np.mean([x[0] for x in same_j])), float(min(x[1] for x in same_j)))
        if other_j:
            res["other"] = (float(np.mean([x[0] for x in other_j])), float(min(x[1] for x in other_j)))
        rows.append(res)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "tests", "data", "tiny-llama"))
    ap.add_argument("--lethe", default=os.path.join(ROOT, os.environ.get("LETHE_BUILD", "build"), "lethe"))
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = run_cases(a.lethe, a.model)
    print("| case | Jaccard vs reference (mean / min) | vs the other granularity (mean / min) |")
    print("|---|---:|---:|")
    for r in rows:
        o = r.get("other")
        print(f"| {r['case']} | {r['same'][0]:.4f} / {r['same'][1]:.4f} | "
              + (f"{o[0]:.4f} / {o[1]:.4f} |" if o else "— |"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
