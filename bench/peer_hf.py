#!/usr/bin/env python3
"""peer_hf.py - peers for `lethe bench engine`, run on the GPU machine in the
same call (scripts/gpu-check.sh):

 1. HF transformers generating with the same dummy config (random bf16
    weights, SDPA attention, static shapes): batch 32, prompt 512, 64 new
    tokens, greedy; decode tokens/s = batch * (64 - 1) / (t(64) - t(1)).
 2. The decode attention kernel against torch scaled_dot_product_attention
    (flash backend where it takes the shape, else PyTorch's default choice)
    on the shapes of lethe's attention sweep: q [B, H, 1, D], K/V
    [B, KV, ctx, D] bf16, GQA.
--no-attention skips part 2 (latent attention, MoE runs: the attention
sweep's K / V heads do not exist there); --reps N takes the best of N
generate calls per length (default 2). Reads lethe's --json output and
prints the ratios side by side: the ratio
column is lethe's attention (the entry's "us"); JSON from before the v1
kernels moved to dev/cuda carries every generation ("kernels": v1, v2) and
their ratios follow."""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoConfig, AutoModelForCausalLM


def time_cuda(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


def hf_decode(cfg_dir, batch, prompt, new, reps=2):
    cfg = AutoConfig.from_pretrained(cfg_dir)
    cfg.torch_dtype = torch.bfloat16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device="cuda")
    mask = torch.ones_like(ids)

    def gen(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(2)  # warm-up
    t1 = min(gen(1) for _ in range(reps))
    tn = min(gen(new) for _ in range(reps))
    del model
    torch.cuda.empty_cache()
    return batch * (new - 1) / (tn - t1), (tn - t1) / (new - 1)


def sdpa_decode(B, H, KV, D, ctx):
    q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, KV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, KV, ctx, D, device="cuda", dtype=torch.bfloat16)
    used = "flash"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        fn = lambda: _flash(q, k, v)  # noqa: E731
    except RuntimeError:
        used = "default"
        fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    t = time_cuda(fn)
    return t, used


def _flash(q, k, v):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/llama-3.1-8b-instruct")
    ap.add_argument("--lethe-json", help="lethe bench engine --json output (optional)")
    ap.add_argument("--json")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-attention", action="store_true")
    a = ap.parse_args()
    lethe = {}
    if a.lethe_json:
        try:
            with open(a.lethe_json) as f:
                lethe = json.load(f)
        except OSError as e:
            print(f"peer_hf: no lethe results ({e}); running the peers alone")
    cfg = AutoConfig.from_pretrained(a.config)
    H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    res = {"attention": [], "decode": {}}

    att = []
    shapes = lethe.get("attention") or [{"batch": b, "ctx": c, "us": float("nan")}
                                         for b in (8, 32) for c in (16384, 32768)]
    if a.no_attention:
        shapes = []
    for e in shapes:
        t, used = sdpa_decode(e["batch"], H, KV, D, e["ctx"])
        att.append((e, t, used))
        res["attention"].append({"batch": e["batch"], "ctx": e["ctx"], "torch_us": t * 1e6,
                                 "torch_backend": used, "lethe_us": e["us"],
                                 "lethe_kernel": e.get("kernel", "default"),
                                 "speedup": t * 1e6 / e["us"],
                                 "speedup_per_kernel": {k: t * 1e6 / v["us"] for k, v in
                                                        e.get("kernels", {}).items()}})
    tok_s, step = hf_decode(a.config, a.batch, a.input_len, a.output_len, a.reps)
    mine = [p for p in lethe.get("points", [])
            if p["batch"] == a.batch and p["input"] == a.input_len]
    res["decode"] = {"batch": a.batch, "input": a.input_len, "output": a.output_len,
                     "hf_tok_s": tok_s, "hf_step_ms": step * 1e3,
                     "lethe_tok_s": mine[0]["decode_tok_s"] if mine else None}
    print("\n== side by side (lethe vs peers) ==")
    d = res["decode"]
    if d["lethe_tok_s"]:
        print(f"decode b{a.batch} i{a.input_len}: lethe {d['lethe_tok_s']:.0f} tok/s, HF "
              f"transformers {tok_s:.0f} tok/s ({d['hf_step_ms']:.1f} ms/step): "
              f"{d['lethe_tok_s'] / tok_s:.2f}x")
    else:
        print(f"decode b{a.batch}: HF transformers {tok_s:.0f} tok/s (no lethe point to compare)")
    if att:
        print(f"{'batch':>6} {'ctx':>7} {'lethe us':>10} {'torch us':>10} {'torch/lethe':>12}  backend"
              "  (lethe kernel; per kernel)")
    for e, t, used in att:
        per = " ".join(f"{k} {t * 1e6 / v['us']:.2f}x" for k, v in e.get("kernels", {}).items())
        print(f"{e['batch']:>6} {e['ctx']:>7} {e['us']:>10.1f} {t * 1e6:>10.1f} "
              f"{t * 1e6 / e['us']:>11.2f}x  {used}  ({e.get('kernel', 'default')}; {per})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
