#!/usr/bin/env python3
"""test_hf_logits.py BUILD - lethe on CUDA vs HF transformers on CUDA, logits of
the tiny random checkpoints (tests/data/tiny-llama, tiny-qwen2, tiny-qwen3,
tiny-qwen3-moe, tiny-glm4-moe-lite: llama3 RoPE scaling, qkv bias, q/k norm with
head_dim != hidden / heads, routed experts with a dense layer, latent attention).

Per model, 4 random token sequences of lengths 7, 23, 50 and 90 (a ragged
batch): transformers (fp32 weights and activations, eager attention, on the
GPU) computes the logits at every position of each sequence; lethe gets the
first half of each as its prompt and the second half as forced_token_ids
(`lethe generate --input ... --dump-logits FILE`), all four requests in one
engine, so one prefill step holds the four prompts and the following decode
steps run 4, 3, 2, then 1 sequences (CUDA graphs of buckets 4, 2, 1, batch 3
padded to 4). The logits rows lethe dumps are positions n_prompt-1 .. n-2,
compared with the same rows of transformers. Run twice: with CUDA graphs
(default; the run must report graph replays) and with --enforce-eager.

Threshold (lethe stores weights, activations and KV in bf16, accumulates in
fp32): per logits row, max |lethe - hf32| / max |hf32| <= 3e-2. As the yardstick,
the same error of transformers itself run in bf16 is printed next to it
(typically ~1e-2 on these models); lethe's error must also stay within 3x that
plus 1e-2. Top-1 agreement is reported. Max rel err per model is printed.

Needs torch with a CUDA device and transformers. Without a GPU it FAILS with a
message (it is only run by tests/gpu/run.sh on the GPU machine); for local
development LETHE_HF_TEST_DEVICE=cpu runs both sides on the CPU instead.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
MODELS = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-glm4-moe-lite"]
LENGTHS = [7, 23, 50, 90]
REL_MAX = 3e-2


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def main():
    build = sys.argv[1] if len(sys.argv) > 1 else "build"
    lethe = os.path.join(build if os.path.isabs(build) else os.path.join(ROOT, build), "lethe")
    if not os.access(lethe, os.X_OK):
        fail(f"{lethe} not found (build first: make)")
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        fail(f"needs torch and transformers ({e})")
    dev = os.environ.get("LETHE_HF_TEST_DEVICE", "cuda")
    if dev == "cuda" and not torch.cuda.is_available():
        fail("torch sees no CUDA device: this test compares lethe --device cuda with transformers "
             "on the GPU and must run on the GPU machine (make test-gpu); it does not pass without one")
    worst = {}
    for name in MODELS:
        path = os.path.join(ROOT, "tests", "data", name)
        cfg = json.load(open(os.path.join(path, "config.json")))
        vocab = cfg["vocab_size"]
        rng = np.random.default_rng(1234 + len(name))
        seqs = [rng.integers(0, vocab, size=n).tolist() for n in LENGTHS]

        # transformers: fp32 reference and bf16 yardstick, one sequence at a time
        ref, ref16 = [], []
        for dtype, out in ((torch.float32, ref), (torch.bfloat16, ref16)):
            # the checkpoints are fp32; cast after loading (works with any transformers version)
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
            model = model.to(device=dev, dtype=dtype).eval()
            with torch.no_grad():
                for s in seqs:
                    ids = torch.tensor([s], device=dev)
                    out.append(model(ids).logits[0].float().cpu().numpy())
            del model

        for mode, extra in (("graphs", []), ("eager", ["--enforce-eager"])):
            with tempfile.TemporaryDirectory() as tmp:
                inp, outp, dump = (os.path.join(tmp, f) for f in ("in.jsonl", "out.jsonl", "logits.bin"))
                with open(inp, "w") as f:
                    for s in seqs:
                        h = len(s) // 2
                        f.write(json.dumps({"prompt_token_ids": s[:h], "forced_token_ids": s[h:]}) + "\n")
                cmd = [lethe, "generate", "-m", path, "--device", dev, "--input", inp, "--output", outp,
                       "--dump-logits", dump, "--max-num-seqs", "8"] + extra
                r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                if r.returncode != 0:
                    fail(f"{name} {mode}: {' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
                summary = [l for l in r.stderr.replace("\r", "\n").splitlines() if "graph replays" in l]
                if not summary:
                    fail(f"{name} {mode}: no summary line on stderr:\n{r.stderr[-2000:]}")
                replays = int(summary[-1].split(" graph replays")[0].split("|")[-1].strip())
                if dev == "cuda" and mode == "graphs" and replays <= 0:
                    fail(f"{name}: the CUDA run replayed no graph ({summary[-1].strip()})")
                if mode == "eager" and replays != 0:
                    fail(f"{name}: --enforce-eager still replayed graphs ({summary[-1].strip()})")
                lines = [json.loads(l) for l in open(outp)]
                raw = np.fromfile(dump, dtype="<f4")
            counts = [l["usage"]["completion_tokens"] for l in lines]
            if counts != [len(s) - len(s) // 2 for s in seqs] or raw.size != sum(counts) * vocab:
                fail(f"{name} {mode}: unexpected dump: completion tokens {counts}, {raw.size} floats")
            raw = raw.reshape(-1, vocab)
            off, errs, errs16, top1, n_rows = 0, [], [], 0, 0
            for s, c, hf, hf16 in zip(seqs, counts, ref, ref16):
                h = len(s) // 2
                mine = raw[off:off + c]
                off += c
                want, want16 = hf[h - 1:len(s) - 1], hf16[h - 1:len(s) - 1]
                scale = np.abs(want).max(axis=1)
                errs.append(np.abs(mine - want).max(axis=1) / scale)
                errs16.append(np.abs(want16 - want).max(axis=1) / scale)
                top1 += int((mine.argmax(1) == want.argmax(1)).sum())
                n_rows += c
            err, err16 = float(np.concatenate(errs).max()), float(np.concatenate(errs16).max())
            print(f"{name:11s} {mode:6s} rows {n_rows:3d}  max rel err lethe {err:.2e}  "
                  f"(transformers bf16 {err16:.2e})  top-1 agreement {top1}/{n_rows}  [{summary[-1].strip()}]",
                  flush=True)
            worst[(name, mode)] = err
            if not err <= REL_MAX or not err <= 3 * err16 + 1e-2:
                fail(f"{name} {mode}: max rel err {err:.3e} > threshold ({REL_MAX:g}, or 3 x transformers "
                     f"bf16 {err16:.2e} + 1e-2)")
    print("max rel err per model: " + ", ".join(f"{n}/{m} {e:.2e}" for (n, m), e in worst.items()))
    print("PASS")


if __name__ == "__main__":
    main()
