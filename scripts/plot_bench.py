#!/usr/bin/env python3
"""plot_bench.py BENCH.json OUT.png - draws `lethe bench engine --json` output:
decode tokens/s and fraction of the memory roofline per point, prefill
fraction of the GEMM peak, and the decode-attention sweep vs copy bandwidth."""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    src, dst = sys.argv[1], sys.argv[2]
    with open(src) as f:
        d = json.load(f)
    pts = d.get("points", [])
    att = d.get("attention", [])
    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    labels = [f"b{p['batch']}\ni{p['input']}" for p in pts]
    ax[0].bar(labels, [p["decode_tok_s"] for p in pts], color="tab:blue")
    ax[0].set_title("decode tokens/s")
    ax0b = ax[0].twinx()
    ax0b.plot(labels, [100 * p["decode_frac_copy_bw"] for p in pts], "ro-")
    ax0b.set_ylabel("% of memory roofline", color="r")
    ax0b.set_ylim(0, 110)
    ax[1].bar(labels, [100 * p["prefill_frac_gemm_peak"] for p in pts], color="tab:green")
    ax[1].set_title(f"prefill % of GEMM peak ({d['gemm_tflops']:.0f} TFLOP/s)")
    ax[1].set_ylim(0, 100)
    if att:
        al = [f"b{a['batch']}\n{a['ctx'] // 1024}K" for a in att]
        ax[2].bar(al, [100 * a["frac_copy"] for a in att], color="tab:purple")
        ax[2].axhline(85, color="k", ls="--", lw=1)
        ax[2].set_title(f"decode attention % of copy bw ({d['copy_gb_s']:.0f} GB/s)")
        ax[2].set_ylim(0, 110)
    fig.suptitle(f"lethe bench engine: {d['model']} on {d['device']}")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)
    print(f"plot: {dst}")


if __name__ == "__main__":
    main()
