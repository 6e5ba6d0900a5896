#!/usr/bin/env python3
"""ncu_summary.py - short text summary of Nsight Compute CSV exports
(`ncu --import R.ncu-rep --csv --page raw --print-units base`), written by
scripts/gpu-check.sh's profile phase into $OUT/profile.txt.

  ncu_summary.py kernels TITLE CSV   per kernel: time, achieved DRAM throughput
                                     (% of peak), memory and SM throughput, occupancy
                                     (achieved / theoretical), registers, top stalls
  ncu_summary.py share TITLE CSV     per-kernel time share of everything profiled
                                     (e.g. one decode step), grouped by kernel name

Tolerant by design: a metric ncu did not export prints as n/a; a missing or
empty CSV prints one line saying so (the profile phase must never fail the run)."""
import csv
import re
import sys

M_TIME = "gpu__time_duration.sum"
M_DRAM = "dram__throughput.avg.pct_of_peak_sustained_elapsed"
M_MEM = "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"
M_SM = "sm__throughput.avg.pct_of_peak_sustained_elapsed"
M_OCC = "sm__warps_active.avg.pct_of_peak_sustained_active"
M_OCC_T = "sm__maximum_warps_per_active_cycle_pct"
M_REGS = "launch__registers_per_thread"
M_DRAM_B = "dram__bytes_read.sum"
STALL = re.compile(r"smsp__average_warps?_issue_stalled_([a-z_]+?)_per_(?:issue|warp)_active\.ratio$")


def num(v):
    try:
        return float(str(v).replace(",", ""))
    except (TypeError, ValueError):
        return None


def short_name(name):
    n = re.sub(r"^void\s+", "", name or "?")
    n = n.split("(")[0]
    return n.strip() or "?"


def read_rows(path):
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as e:
        return None, f"no ncu export ({e})"
    # the header is the first row with a "Kernel Name" column (ncu may print
    # "==PROF==" lines before it)
    for i, r in enumerate(rows):
        if "Kernel Name" in r:
            hdr = r
            body = rows[i + 1:]
            break
    else:
        return None, f"{path}: no kernel rows (ncu profiled nothing?)"
    # the row after the header holds units when its ID column is empty
    if body and not num(body[0][hdr.index("ID")] if "ID" in hdr else None):
        body = body[1:]
    out = [dict(zip(hdr, r)) for r in body if len(r) == len(hdr)]
    if not out:
        return None, f"{path}: no kernel rows (ncu profiled nothing?)"
    return out, None


def fmt(v, spec="5.1f", unit=""):
    return "n/a" if v is None else format(v, spec) + unit


def kernels(title, path):
    rows, err = read_rows(path)
    print(f"== {title}")
    if err:
        print(f"   {err}")
        return
    print(f"   {'kernel':<28} {'grid':>16} {'us':>9} {'DRAM%':>6} {'mem%':>6} {'SM%':>6} "
          f"{'occ ach/theo':>13} {'regs':>5} {'DRAM GB/s':>9}  top stalls (warps per issue)")
    for r in rows:
        t = num(r.get(M_TIME))
        t_us = t * 1e-3 if t is not None else None  # base unit: ns
        b = num(r.get(M_DRAM_B))
        gbs = b / t if b is not None and t else None  # bytes / ns = GB/s
        stalls = []
        for k, v in r.items():
            m = STALL.match(k)
            x = num(v)
            if m and x is not None and m.group(1) not in ("selected",):
                stalls.append((x, m.group(1)))
        stalls.sort(reverse=True)
        st = ", ".join(f"{n} {x:.2f}" for x, n in stalls[:3]) or "n/a"
        occ = f"{fmt(num(r.get(M_OCC)), '.0f')}/{fmt(num(r.get(M_OCC_T)), '.0f')}%"
        print(f"   {short_name(r.get('Kernel Name'))[:28]:<28} {r.get('Grid Size', '?'):>16} "
              f"{fmt(t_us, '9.1f'):>9} {fmt(num(r.get(M_DRAM))):>6} {fmt(num(r.get(M_MEM))):>6} "
              f"{fmt(num(r.get(M_SM))):>6} {occ:>13} {fmt(num(r.get(M_REGS)), '.0f'):>5} "
              f"{fmt(gbs, '9.0f'):>9}  {st}")


def share(title, path):
    rows, err = read_rows(path)
    print(f"== {title}")
    if err:
        print(f"   {err}")
        return
    agg = {}
    for r in rows:
        n = short_name(r.get("Kernel Name"))
        t = num(r.get(M_TIME)) or 0.0
        a = agg.setdefault(n, [0.0, 0, 0.0, 0.0])
        a[0] += t
        a[1] += 1
        a[2] += t * (num(r.get(M_DRAM)) or 0.0)
        a[3] += t * (num(r.get(M_SM)) or 0.0)
    total = sum(a[0] for a in agg.values())
    print(f"   {len(rows)} kernels, {total * 1e-3:.1f} us of kernel time (sum of profiled "
          f"durations; no launch gaps)")
    print(f"   {'kernel':<40} {'calls':>5} {'us':>9} {'share':>6} {'DRAM%':>6} {'SM%':>6}  "
          "(DRAM/SM: time-weighted means)")
    for n, a in sorted(agg.items(), key=lambda kv: -kv[1][0])[:14]:
        w = a[0] or 1.0
        print(f"   {n[:40]:<40} {a[1]:>5} {a[0] * 1e-3:>9.1f} {100 * a[0] / (total or 1):>5.1f}% "
              f"{a[2] / w:>6.1f} {a[3] / w:>6.1f}")


def main():
    if len(sys.argv) != 4 or sys.argv[1] not in ("kernels", "share"):
        print(__doc__)
        return 2
    (kernels if sys.argv[1] == "kernels" else share)(sys.argv[2], sys.argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main())
