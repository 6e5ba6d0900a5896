#!/usr/bin/env python3
"""replay_table.py - writes the agent-trace replay table of docs/benchmarks.md.

Reads every docs/results/*.json with schema lethe-bench-replay/1 (written by
`lethe bench replay --result-json`) and replaces the text between

    <!-- gen:begin replay -->
    <!-- gen:end replay -->

in docs/benchmarks.md (appending the markers if they are missing). Each
result file's conditions (commit, date, machine, model, trace sizes,
concurrency, sparse knobs) head its rows; speedups are end-to-end time
relative to the file's dense-radix row (or its first row). scripts/gen_docs.py
writes the same section (it imports section() from here).

    python3 scripts/replay_table.py            regenerate
    python3 scripts/replay_table.py --check    exit 1 if the table is out of date
"""
import glob
import json
import os
import re
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def fmt(v, nd=1):
    if v is None or (isinstance(v, float) and v != v):
        return "-"
    return f"{v:,.{nd}f}" if isinstance(v, float) else f"{v:,}"


def section(results):
    out = []
    for r in results:
        t = r.get("trace", {})
        rows = r["results"]
        base = next((x for x in rows if x["config"] == "dense-radix"), rows[0])
        model = r.get("model", "?")
        model = model if os.path.basename(model) == "config.json" else os.path.basename(model)
        gpu = f", GPU {r['gpu']}" if r.get("gpu") else ""
        out.append(f"**{r['_file']}** - commit {r.get('commit', '?')}, {r.get('date', '?')}, {r.get('machine', '?')}{gpu}; "
                   f"model `{model}`"
                   + (f", attention kernel {r['attn_kernel']}" if r.get("attn_kernel") else "")
                   + f"; trace: {t.get('agents')} agents, "
                   f"{t.get('turns')} turns (generated: {t.get('min_turns')}-{t.get('max_turns')} turns/agent, "
                   f"system {t.get('system_tokens')} + task {t.get('task_tokens')} words, tool outputs "
                   f"{t.get('tool_min')}-{t.get('tool_max')}, replies {t.get('out_min')}-{t.get('out_max')}, "
                   f"waits U[0, {t.get('max_wait_s')}) s, context <= {t.get('max_context')}, seed {t.get('seed')}"
                   + (f"; longest context {t['longest_context_tokens']:,} tokens" if t.get("longest_context_tokens") else "")
                   + "); "
                   f"concurrency {rows[0].get('concurrency')}, wait scale {rows[0].get('wait_scale')}; "
                   f"sparse knobs `{r.get('sparse_config', '-')}`; serve flags `{r.get('serve_args', '-')}`."
                   + (f" Note: {r['commit_note']}." if r.get("commit_note") else ""))
        out.append("")
        out.append("| config | end-to-end s | speedup vs " + base["config"] + " | TTFT p50 ms | p90 ms | p99 ms "
                   "| prompt tokens | reused | computed | turns ok | chains created / resumed |")
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for x in rows:
            sp = base["end_to_end_s"] / x["end_to_end_s"] if x["end_to_end_s"] else float("nan")
            chains = f"{x['chains_created']} / {x['chains_resumed']}" if x["client_mode"] == "chain" else "-"
            out.append(f"| {x['config']} | {fmt(x['end_to_end_s'])} | {sp:.2f}x | {fmt(x['p50_ttft_ms'])} | "
                       f"{fmt(x['p90_ttft_ms'])} | {fmt(x['p99_ttft_ms'])} | {fmt(int(x['prompt_tokens']))} | "
                       f"{fmt(int(x['reused_tokens']))} | {fmt(int(x['computed_prompt_tokens']))} | "
                       f"{x['turns_ok']}/{x['turns']} | {chains} |")
        out.append("")
    return "\n".join(out) if out else "(no replay results yet)"


def main(argv):
    check = "--check" in argv
    results = []
    for p in sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json"))):
        with open(p) as f:
            r = json.load(f)
        if str(r.get("schema", "")).startswith("lethe-bench-replay/"):
            r["_file"] = os.path.basename(p)
            results.append(r)
    doc = os.path.join(ROOT, "docs", "benchmarks.md")
    old = open(doc).read() if os.path.exists(doc) else "# Benchmarks\n"
    begin, end = "<!-- gen:begin replay -->", "<!-- gen:end replay -->"
    block = f"{begin}\n{section(results).rstrip()}\n{end}"  # as gen_docs.py writes it
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    new = pat.sub(lambda m: block, old, count=1) if pat.search(old) else old.rstrip("\n") + "\n\n" + block + "\n"
    if new == old:
        return 0
    if check:
        print("replay_table: docs/benchmarks.md is out of date; run python3 scripts/replay_table.py", file=sys.stderr)
        return 1
    with open(doc, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
