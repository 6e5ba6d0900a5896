#!/usr/bin/env python3
"""ncu_steps.py - per decode step kernel breakdown of an Nsight Compute CSV
export (`ncu --import R --csv --page raw --print-units base`) of runs made
with LETHE_PROFILE_STEP=N (the profiler range is one decode step per engine;
`lethe bench sparse` runs dense first, then each matched method).

  ncu_steps.py LABELS CSV [TOP]   LABELS: comma list naming the steps in order

A step ends with the sampling kernel (sample_kernel). Per step: kernels,
summed kernel time (ncu serialises kernels: this is device busy time without
launch gaps), then the TOP kernel names by time with count and share.
Tolerant: a missing CSV or metric prints one line and exits 0."""
import csv
import re
import sys

from ncu_summary import M_TIME, num, short_name


def short(name):
    """kernel name without arguments and template arguments"""
    return re.sub(r"<.*", "", short_name(name)).strip() or "?"


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return
    labels = sys.argv[1].split(",")
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 14
    try:
        rows = list(csv.DictReader(open(sys.argv[2], newline="")))
    except OSError as e:
        print(f"ncu_steps: {e}")
        return
    rows = [r for r in rows if r.get("ID", "").strip().isdigit()]  # drops the units row
    if not rows or M_TIME not in rows[0]:
        print(f"ncu_steps: no {M_TIME} rows in {sys.argv[2]}")
        return
    rows.sort(key=lambda r: int(r["ID"]))
    steps, cur = [], []
    for r in rows:
        t = (num(r[M_TIME]) or 0.0) / 1e3  # ns -> us
        cur.append((short(r.get("Kernel Name")), t))
        if "sample_kernel" in cur[-1][0]:
            steps.append(cur)
            cur = []
    if cur:
        steps.append(cur)
    for i, st in enumerate(steps):
        lab = labels[i] if i < len(labels) else f"step{i}"
        tot = sum(t for _, t in st)
        print(f"--- {lab}: {len(st)} kernels, {tot / 1e3:.3f} ms summed kernel time")
        by = {}
        for n, t in st:
            c, s = by.get(n, (0, 0.0))
            by[n] = (c + 1, s + t)
        for n, (c, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"  {s:9.1f} us {100 * s / tot:5.1f}%  x{c:<5d} {s / c:8.2f} us/call  {n}")


if __name__ == "__main__":
    main()
