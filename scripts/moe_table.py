#!/usr/bin/env python3
"""moe_table.py OUT MODEL... - the table of scripts/gpu-check.sh phase moe.

For each MODEL (a folder name under configs/) it reads from OUT:
  moe-MODEL.json           lethe bench engine: decode points (--skip-prefill)
                           and the prefill-only point(s)
  moe-MODEL-absorbed.json  the same prefill point with LETHE_MLA_EXPAND_MIN_Q=0
                           (latent attention models only)
  moe-MODEL-hf.json        bench/peer_hf.py: HF transformers at batch 32
  moe-MODEL-snapkv.json    lethe bench sparse --parts capacity (SnapKV 2K at 32K)
and prints decode tok/s and % of the roofline per (batch, context) against
the decode targets (batch 1 >= 70%, batch 64 >= 60% of the roofline), prefill % of the GEMM
peak (expanded and absorbed), lethe / HF at batch 32, and SnapKV vs dense.
The ceilings (copy bandwidth, GEMM peak) are those each lethe run measured."""
import json
import os
import sys


def load(out, name):
    p = os.path.join(out, name)
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        print(f"  ({name}: {e.__class__.__name__}: not available)")
        return None


def target(batch):
    return {1: 0.70, 64: 0.60}.get(batch)


def main():
    out, models = sys.argv[1], sys.argv[2:]
    for m in models:
        print(f"\n== {m} (dummy weights) ==")
        eng = load(out, f"moe-{m}.json")
        if eng:
            print(f"ceilings of this run: copy {eng['copy_gb_s']:.0f} GB/s, "
                  f"GEMM {eng['gemm_tflops']:.1f} TFLOP/s; graphs {eng['cuda_graphs']}")
            print(f"{'batch':>6} {'ctx':>7} | {'step ms':>9} {'tok/s':>9} {'GB/step':>8} "
                  f"{'of roofline':>11} {'target':>7}")
            for p in eng["points"]:
                if p["output"] == 0:
                    continue
                t = target(p["batch"])
                ok = "" if t is None else (" met" if p["decode_frac_copy_bw"] >= t else " MISSED")
                ts = f"{t:.0%}" if t else "-"
                print(f"{p['batch']:>6} {p['input']:>7} | {p['decode_step_ms']:>9.3f} "
                      f"{p['decode_tok_s']:>9.1f} {p['decode_bytes_per_step'] * 1e-9:>8.2f} "
                      f"{p['decode_frac_copy_bw']:>10.1%} {ts:>7}{ok}")
        latent = os.path.exists(os.path.join(out, f"moe-{m}-absorbed.json"))
        pre = [("expanded (LETHE_MLA_EXPAND_MIN_Q default)" if latent else "", eng)]
        if latent:
            pre.append(("absorbed (LETHE_MLA_EXPAND_MIN_Q=0)", load(out, f"moe-{m}-absorbed.json")))
        for name, r in pre:
            tag = f" {name}" if name else ""
            for p in (r or {}).get("points", []):
                if p["output"] == 0:
                    print(f"prefill {p['batch']} x {p['input']}{tag}: {p['prefill_tok_s']:.0f} tok/s, "
                          f"{p['prefill_tflops']:.1f} TFLOP/s = {p['prefill_frac_gemm_peak']:.1%} "
                          "of the GEMM peak")
        hf = load(out, f"moe-{m}-hf.json")
        if hf and hf.get("decode"):
            d = hf["decode"]
            line = (f"HF transformers b{d['batch']} x {d['input']} (+{d['output']}): "
                    f"{d['hf_tok_s']:.0f} tok/s ({d['hf_step_ms']:.1f} ms/step)")
            if d.get("lethe_tok_s"):
                r = d["lethe_tok_s"] / d["hf_tok_s"]
                line += (f"; lethe {d['lethe_tok_s']:.0f} tok/s = {r:.2f}x "
                         f"(target 3x: {'met' if r >= 3 else 'MISSED'})")
            print(line)
        sp = load(out, f"moe-{m}-snapkv.json")
        for p in ((sp or {}).get("capacity") or {}).get("points", []):
            a, md, dd = p.get("arithmetic", {}), p.get("method_decode", {}), p.get("dense_decode", {})
            if not md or not dd:
                print(f"snapkv at {p.get('input')}: {p.get('error', 'no decode result')}")
                continue
            print(f"snapkv 2K at {p['input']}: batch {a['method_batch']} vs dense {a['dense_batch']} "
                  f"({a['batch_ratio']:.2f}x), decode {md['tok_s']:.0f} vs {dd['tok_s']:.0f} tok/s "
                  f"({p['tok_s_ratio']:.2f}x); pool {a['pool_slots_per_layer']} slots/layer")


if __name__ == "__main__":
    main()
