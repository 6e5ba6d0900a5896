#!/usr/bin/env python3
"""gen_docs.py - regenerates the measured parts of docs/quality.md and docs/benchmarks.md.

Result files live in docs/results/*.json: `lethe eval --result-json` files
(schema lethe-eval/1), `lethe bench serve --result-json` files (schema
lethe-bench-serve/1), `lethe bench sparse --json` files (lethe-bench-sparse/1)
and `lethe bench replay --result-json` files (lethe-bench-replay/1, table
written by scripts/replay_table.py's section()). From them this script writes tables and PNG plots
(docs/img/) into the docs, but only between marker lines

    <!-- gen:begin NAME -->
    ...generated...
    <!-- gen:end NAME -->

so hand-written text around them (and sections other helpers own) stays as
it is. A doc without the markers gets them appended at its end; a missing
doc is created with a short hand-written preamble that may then be edited.

    python3 scripts/gen_docs.py                 regenerate (sections "quality", "quality-grid", "serve", "sparse", "replay")
    python3 scripts/gen_docs.py --check         exit 1 if the docs are out of date
    python3 scripts/gen_docs.py plot-eval R.json OUT.png    plot one eval result
    python3 scripts/gen_docs.py plot-serve R.json [R.json...] OUT.png

Plots need matplotlib (PyPI; `make deps` installs it). Every table row
carries its method and knobs; each result file's commit, date, machine,
model and conditions head the rows it produced.
"""
import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["passkey", "niah_multikey", "vt", "cwe"]

QUALITY_PREAMBLE = """# Quality

How much quality a sparse method keeps, measured against dense on identical inputs by `lethe eval`
(src/eval, tools/cmd_eval.c). Tasks (RULER-style, generated from a seed at each context length, haystack
from a text corpus, exact-match scoring of the greedy answer after the model's chat template):

- **passkey**: one 5-digit pass key hidden in the haystack.
- **niah_multikey**: four "special magic number for KEY" needles, one asked, three distractors.
- **vt**: variable tracking, a chain `VAR A = 12345`, `VAR B = VAR A`, ... (5 names) plus a distractor
  chain; score = fraction of the 5 names given.
- **cwe**: common-word extraction from a numbered word list; score = fraction of the 10 most frequent
  words given.
- **ppl**: perplexity of teacher-forced continuations of long documents (sliding windows ending at the
  same tokens for every context length), and for sparse methods the per-position KL(dense || method)
  and top-1 agreement of next-token distributions.

A length the model cannot handle is reported with score 0 and the reason, not dropped.
Reproduce a table with the command shown above it; regenerate this page with `python3 scripts/gen_docs.py`.

"""

BENCH_PREAMBLE = """# Benchmarks

"""

SERVE_HEAD = """## Serving (`lethe bench serve`)

Measured with `lethe bench serve` (tools/bench_serve.c), a streaming OpenAI-API client in the style of
`vllm bench serve`: TTFT = send to first content chunk, TPOT = (E2EL - TTFT) / (output tokens - 1),
ITL = gaps between content chunks, E2EL = send to end of response; `ignore_eos` makes output lengths
exact. The last column is the server's own /metrics mean TTFT over the same run. Rows are generated
from docs/results/*.json by `python3 scripts/gen_docs.py`.

"""


# ---- helpers ------------------------------------------------------------------------------

def load_results(results_dir):
    evals, serves, sparse, replays = [], [], [], []
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path) as f:
            try:
                r = json.load(f)
            except json.JSONDecodeError as e:
                raise SystemExit(f"gen_docs: {path}: not JSON ({e})")
        r["_file"] = os.path.basename(path)
        schema = r.get("schema", "")
        if schema.startswith("lethe-eval/"):
            evals.append(r)
        elif schema.startswith("lethe-bench-serve/"):
            serves.append(r)
        elif schema.startswith("lethe-bench-sparse/"):
            sparse.append(r)
        elif schema.startswith("lethe-bench-replay/"):
            replays.append(r)
    key = lambda r: (r.get("date", ""), r["_file"])
    # the replay table keeps its file-name order (scripts/replay_table.py)
    return sorted(evals, key=key), sorted(serves, key=key), sorted(sparse, key=key), replays


def fmt(v, nd=3):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "—"
    if isinstance(v, (int, float)):
        return f"{v:.{nd}f}"
    return str(v)


def replace_section(text, name, body):
    begin, end = f"<!-- gen:begin {name} -->", f"<!-- gen:end {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    pat = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pat.search(text):
        return pat.sub(lambda m: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def update_doc(path, preamble, sections, check, have_results=True):
    old = open(path).read() if os.path.exists(path) else None
    if not have_results and (old is None or not all(f"<!-- gen:begin {n} -->" in old for n, _ in sections)):
        return False  # nothing measured yet: no empty page, no empty section in someone's page
    old = old if old is not None else preamble
    new = old
    for name, body in sections:
        new = replace_section(new, name, body)
    if new == old and os.path.exists(path):
        return False
    if not check:
        with open(path, "w") as f:
            f.write(new)
    return True


def plt_module():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        raise SystemExit("gen_docs: plots need matplotlib (python3 -m pip install matplotlib, or `make deps`)")


# ---- eval: plot ---------------------------------------------------------------------------

def eval_metrics(rows):
    """(key, title, rows filter) for every metric present in the result."""
    have = {r["task"] for r in rows}
    out = [(t, t, "score") for t in TASKS if t in have]
    if "ppl" in have:
        out.append(("ppl", "perplexity", "ppl"))
        if any(r.get("top1_agree") is not None for r in rows if r["task"] == "ppl"):
            out.append(("ppl", "top-1 agreement with dense", "top1_agree"))
            out.append(("ppl", "mean KL(dense || method)", "kl_mean"))
    return out


def plot_eval(result, out_png):
    plt = plt_module()
    rows = result["rows"]
    metrics = eval_metrics(rows)
    lengths = sorted({r["context_length"] for r in rows})
    methods = sorted({r["method"] for r in rows if r["method"] != "dense"})
    by_budget = any(r.get("budget") is not None for r in rows)
    ncol = min(3, len(metrics))
    nrow = math.ceil(len(metrics) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (task, title, field) in enumerate(metrics):
        ax = axes[k // ncol][k % ncol]
        sel = [r for r in rows if r["task"] == task]
        if by_budget:
            for li, L in enumerate(lengths):
                d = [r for r in sel if r["method"] == "dense" and r["context_length"] == L]
                if d and d[0].get(field) is not None:
                    ax.axhline(d[0][field], color="k", ls=styles[li % 4], lw=1, label=f"dense {L}")
                for mi, m in enumerate(methods):
                    pts = sorted((r["budget"], r.get(field)) for r in sel
                                 if r["method"] == m and r["context_length"] == L and r.get("budget") is not None)
                    pts = [(b, v) for b, v in pts if v is not None]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ls=styles[li % 4],
                                color=colors[mi % len(colors)], label=f"{m} {L}")
            budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets)
            ax.set_xticklabels([str(b) for b in budgets])
            ax.minorticks_off()
            ax.set_xlabel("budget (tokens)")
        else:
            for mi, m in enumerate(["dense"] + methods):
                pts = sorted((r["context_length"], r.get(field)) for r in sel if r["method"] == m)
                pts = [(L, v) for L, v in pts if v is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                            color="k" if m == "dense" else colors[mi % len(colors)], label=m)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths)
            ax.set_xticklabels([str(L) for L in lengths])
            ax.minorticks_off()
            ax.set_xlabel("context length (tokens)")
        if field == "score" or field == "top1_agree":
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for k in range(len(metrics), nrow * ncol):
        axes[k // ncol][k % ncol].axis("off")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for a in axes.flat:
        for h, l in zip(*a.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=8,
               bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"{result.get('model', '?')} on {result.get('device', '?')}: quality vs "
                 f"{'budget' if by_budget else 'context length'} (commit {result.get('commit', '?')})", fontsize=10)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(labels) / 6), 1, 0.95))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


# ---- eval: tables -------------------------------------------------------------------------

def eval_section(evals, img_dir, img_rel, images, draw):
    if not evals:
        return "_No eval results yet: run `lethe eval ... --result-json docs/results/NAME.json`._\n"
    out = []
    for r in evals:
        stem = os.path.splitext(r["_file"])[0]
        out.append(f"### {r.get('model', '?')} on {r.get('device', '?')}: {', '.join(str(x) for x in r.get('context_lengths', []))} tokens ({r['_file']})\n")
        out.append(f"- commit `{r.get('commit', '?')}`, {r.get('date', '?')}, machine: {r.get('machine', '?')}, "
                   f"threads: {r.get('threads', '?')}")
        out.append(f"- model `{r.get('model', '?')}` (max_model_len {r.get('max_model_len', '?')}), "
                   f"{r.get('samples', '?')} sample(s) per task and length, seed {r.get('seed', '?')}, "
                   f"haystack corpus `{r.get('corpus', '?')}`, ppl windows of {r.get('forced_tokens', '?')} forced "
                   f"tokens from `{r.get('ppl_corpus', '?')}`; {r.get('prompt_format', '')}")
        env = ", ".join(f"{k}={r[k]}" for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if r.get(k))
        out.append(f"- prefix caching {'on' if r.get('prefix_caching') else 'off'}"
                   + (f"; ppl documents: {r['ppl_documents']}" if r.get("ppl_documents") else "")
                   + (f"; environment: {env}" if env else ""))
        if r.get("command"):
            out.append(f"- command: `{r['command']}`")
        out.append("")
        tasks_present = [t for t in TASKS if any(x["task"] == t for x in r["rows"])]
        has_ppl = any(x["task"] == "ppl" for x in r["rows"])
        head = ["method", "budget", "knobs", "ctx", "n"] + tasks_present
        if has_ppl:
            head += ["ppl", "KL mean", "KL p99", "top-1"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|")
        notes = []
        keys = []
        for x in r["rows"]:
            k = (x["method"], x.get("budget"), x.get("knobs", ""), x["context_length"])
            if k not in keys:
                keys.append(k)
        for k in keys:
            sel = {x["task"]: x for x in r["rows"]
                   if (x["method"], x.get("budget"), x.get("knobs", ""), x["context_length"]) == k}
            # budget: tokens the budget knob was set to; a method run without one (dense = the
            # reference, quantization methods have no token budget) says so instead of a number
            budget = (str(k[1]) if k[1] is not None else "full (reference)" if k[0] == "dense"
                      else "none (no token budget)")
            ns = sorted({x.get("n") for x in sel.values() if x.get("n") is not None})
            cells = [k[0], budget, f"`{k[2]}`" if k[2] else "—", str(k[3]),
                     "/".join(str(n) for n in ns) if ns else "—"]
            for t in tasks_present:
                x = sel.get(t)
                c = fmt(x.get("score"), 2) if x else "—"
                if x and x.get("error"):
                    notes.append(f"{k[0]} {k[2] or ''} ctx {k[3]} {t}: {x['error']}")
                    c += f" [{len(notes)}]"
                cells.append(c)
            if has_ppl:
                x = sel.get("ppl", {})
                c = fmt(x.get("ppl"), 2)
                if x.get("error"):
                    notes.append(f"{k[0]} {k[2] or ''} ctx {k[3]} ppl: {x['error']}")
                    c += f" [{len(notes)}]"
                cells += [c, fmt(x.get("kl_mean"), 4), fmt(x.get("kl_p99"), 4), fmt(x.get("top1_agree"), 3)]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
        out.append("n = samples per task (ppl: windows). Scores are the mean over samples of the fraction of expected answers found (1.00 = every "
                   "sample exact). KL and top-1 compare each method with dense on the same teacher-forced "
                   "tokens (— for dense, the reference).")
        if notes:
            out.append("")
            for i, n in enumerate(notes, 1):
                out.append(f"[{i}] {n}  ")
        if images:
            if draw:
                plot_eval(r, os.path.join(img_dir, f"quality-{stem}.png"))
            out.append("")
            out.append(f"![quality of {r.get('model')} ({stem})]({img_rel}/quality-{stem}.png)")
        out.append("")
    return "\n".join(out)


# ---- eval: the method grid (scripts/quality-grid.sh) --------------------------------------

# Result files named *-grid-NAME-TAG.json are one run of scripts/quality-grid.sh: one eval
# process per method and level, each with its own dense reference on the same windows. They
# render as one table per context length (method x budget, KL / top-1) plus one of the methods
# whose level is a size knob (bits, rank, latent dims) or their defaults, with the KV bytes per
# token of each configuration's pool, instead of one table per file.
GRID_KIND = {"streamingllm": "eviction", "snapkv": "eviction", "pyramidkv": "eviction", "h2o": "eviction",
             "kvzip": "eviction", "rkv": "eviction", "skipkv": "eviction", "quest": "selection",
             "omnikv": "selection", "retroinfer": "selection", "omnikv_prefill": "prefill",
             "flashprefill": "prefill", "kivi": "quantization", "turboquant": "quantization",
             "fp8_kv": "quantization", "palu": "compression", "deltakv": "compression",
             "flashprefill+snapkv": "prefill + eviction", "omnikv_prefill+quest": "prefill + selection"}
# knobs whose value is a number of tokens: their configurations go to the budget table
GRID_TOKEN_KNOBS = ("decode_keep_tokens", "recent_keep_tokens", "h2o_decode_budget", "kvzip_token_budget",
                    "omnikv_prefill_keep_tokens")


def is_grid(r):
    return "-grid-" in r["_file"]


def grid_group(r):
    """(tag, commit): the files of one grid run (the tag is the file name's last part: h200, cpu)"""
    return (os.path.splitext(r["_file"])[0].rsplit("-", 1)[-1], r.get("commit", "?"))


def grid_budget_knob(x):
    """the knob the budget set ("" when the configuration has no budget)"""
    if x.get("budget") is None:
        return ""
    for kv in reversed((x.get("knobs") or "").split(",")):
        k, _, v = kv.partition("=")
        if v == str(x["budget"]):
            return k
    return ""


def grid_other_knobs(x):
    """the configuration's knobs besides the budget, asset folders by their last name"""
    bk = grid_budget_knob(x)
    ks = []
    for kv in (x.get("knobs") or "").split(","):
        k, _, v = kv.partition("=")
        if kv and k != bk:
            ks.append(f"{k}={os.path.basename(v) if '/' in v else v}")
    return ",".join(ks)


def grid_section(grids):
    if not grids:
        return ("_No grid results yet: `scripts/gpu-check.sh quality` on the GPU machine, then "
                "`scripts/quality-grid.sh docs gpu-out/quality`._\n")
    groups = {}
    for r in grids:
        groups.setdefault(grid_group(r), []).append(r)
    out = []
    for (tag, commit), rs in sorted(groups.items(), key=lambda kv: max(r.get("date", "") for r in kv[1]), reverse=True):
        r0 = rs[0]
        dates = sorted(r.get("date", "?") for r in rs)
        lengths = sorted({L for r in rs for L in r.get("context_lengths", [])})
        out.append(f"### Every method vs dense: {r0.get('model', '?')} on {r0.get('device', '?')}"
                   f" ({tag}, {len(rs)} result files)\n")
        out.append(f"- commit `{commit}`, {dates[0]} to {dates[-1]}, machine: {r0.get('machine', '?')}"
                   + (f", GPU: {r0['gpu']}" if r0.get("gpu") else "") + f", threads per process: {r0.get('threads', '?')}")
        out.append(f"- {r0.get('ppl_windows', r0.get('samples', '?'))} ppl windows of {r0.get('forced_tokens', '?')} "
                   f"teacher-forced tokens per cell (KL(dense || method) and top-1 agreement over every scored "
                   f"position), seed {r0.get('seed', '?')}, documents {r0.get('ppl_documents', '?')} of "
                   f"`{r0.get('ppl_corpus', '?')}`; each file's dense reference ran in the same process on the "
                   f"same windows")
        out.append(f"- files `{'`, `'.join(sorted(r['_file'] for r in rs))}`")
        out.append(f"- command of each: `{r0.get('command', '?')}` (the methods, budgets and knobs per file: "
                   f"scripts/quality-grid.sh)")
        out.append("")
        notes = []
        cells, dense, tok_bytes = {}, {}, {}
        for r in rs:
            for c in r.get("configs", []):
                if c.get("kv_token_bytes"):
                    tok_bytes[(c["method"], c.get("knobs", ""))] = c["kv_token_bytes"] + c.get("kv_slot_overhead_bytes", 0)
            for x in r["rows"]:
                if x["task"] != "ppl":
                    continue
                if x["method"] == "dense":
                    dense.setdefault(x["context_length"], []).append(x)
                else:
                    cells[(x["method"], x.get("knobs", ""), x["context_length"])] = x

        def cell(x):
            if x is None:
                return "—"
            if x.get("error"):
                notes.append(f"{x['method']} `{x.get('knobs', '')}` ctx {x['context_length']}: {x['error']}")
                return f"error [{len(notes)}]"
            return f"{fmt(x.get('kl_mean'), 4)} / {fmt(x.get('top1_agree'), 3)}"

        dense_b = next((v for (m, _), v in tok_bytes.items() if m == "dense"), None)
        methods = [m for m in GRID_KIND if any(k[0] == m for k in cells)]
        methods += sorted({k[0] for k in cells} - set(methods))
        for L in lengths:
            d = dense.get(L, [])
            dppl = sorted({round(x["ppl"], 4) for x in d if x.get("ppl") is not None})
            out.append(f"#### {L} tokens\n")
            out.append(f"Dense: ppl {' / '.join(f'{v:.2f}' for v in dppl) or '—'} over "
                       f"{d[0].get('n', '?') if d else '?'} windows"
                       + (f" (the same in all {len(d)} processes)" if len(dppl) == 1 and len(d) > 1 else "")
                       + (f", {dense_b} KV bytes per token" if dense_b else "") + ".\n")
            tb = [x for k, x in cells.items() if k[2] == L and grid_budget_knob(x) in GRID_TOKEN_KNOBS]
            budgets = sorted({x["budget"] for x in tb})
            if tb:
                out.append("KL mean / top-1 vs dense at each token budget (the knob it sets: "
                           "\"What a budget B sets\" below), KV bytes per token of the pool:\n")
                out.append("| method | kind | budget knob | other knobs | KV bytes per token | "
                           + " | ".join(str(b) for b in budgets) + " | n |")
                out.append("|---|---|---|---|---:|" + "---:|" * len(budgets) + "---:|")
                for m in methods:
                    rows_m = {}
                    for x in tb:
                        if x["method"] == m:
                            rows_m.setdefault(grid_other_knobs(x), {})[x["budget"]] = x
                    for other, xs in sorted(rows_m.items()):
                        ns = sorted({x.get("n") for x in xs.values() if x.get("n") is not None})
                        bs = sorted({tok_bytes.get((m, x.get("knobs", ""))) for x in xs.values()} - {None})
                        out.append(f"| {m} | {GRID_KIND.get(m, '?')} | `{grid_budget_knob(next(iter(xs.values())))}` | "
                                   f"{'`' + other + '`' if other else '—'} | {'/'.join(str(b) for b in bs) or '—'} | "
                                   + " | ".join(cell(xs.get(b)) for b in budgets)
                                   + f" | {'/'.join(str(n) for n in ns) or '—'} |")
                out.append("")
            lv = [x for k, x in cells.items() if k[2] == L and grid_budget_knob(x) not in GRID_TOKEN_KNOBS]
            if lv:
                out.append("Methods at a size level or at their defaults, with the KV bytes per token of their pool "
                           "(payload + per-slot buffers, this device's storage format):\n")
                out.append("| method | kind | level / knobs | KV bytes per token | dense / method bytes | KL mean | KL p99 | top-1 | ppl | n |")
                out.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
                for m in methods:
                    for x in sorted((x for x in lv if x["method"] == m), key=lambda x: (x.get("budget") or 0, x.get("knobs", ""))):
                        b = tok_bytes.get((m, x.get("knobs", "")))
                        ratio = f"{dense_b / b:.2f}x" if b and dense_b else "—"
                        c = cell(x)
                        kl = (f"{fmt(x.get('kl_mean'), 4)} | {fmt(x.get('kl_p99'), 4)} | {fmt(x.get('top1_agree'), 3)}"
                              if not x.get("error") else f"{c} | — | —")
                        knobs = ",".join(kv.partition("=")[0] + "=" + os.path.basename(kv.partition("=")[2])
                                         for kv in (x.get("knobs") or "").split(",") if kv)
                        out.append(f"| {m} | {GRID_KIND.get(m, '?')} | `{knobs or 'defaults'}` | "
                                   f"{b if b else '—'} | {ratio} | {kl} | {fmt(x.get('ppl'), 2)} | {x.get('n', '—')} |")
                out.append("")
        if notes:
            for i, n in enumerate(notes, 1):
                out.append(f"[{i}] {n}  ")
            out.append("")
    return "\n".join(out)


# ---- serve --------------------------------------------------------------------------------

def serve_workload(r):
    if r.get("dataset"):
        return f"dataset `{os.path.basename(r['dataset'])}`"
    w = f"in {r.get('random_input_len')} / out {r.get('random_output_len')}"
    if r.get("random_range_ratio"):
        w += f" ±{r['random_range_ratio']:.0%}"
    if r.get("shared_prefix_len"):
        w += f", shared prefix {r['shared_prefix_len']}"
    return w


def serve_section(serves, img_dir, img_rel, images, draw):
    if not serves:
        return SERVE_HEAD + "_No serving results yet: run `lethe bench serve ... --result-json docs/results/NAME.json`._\n"
    out = [SERVE_HEAD.rstrip("\n"), "", "| date | commit | machine | model | method | knobs | endpoint | workload | rate | conc. | done/failed "
           "| req/s | out tok/s | TTFT mean / p99 (ms) | TPOT mean / p99 (ms) | ITL mean / p99 (ms) | E2EL mean (ms) "
           "| server TTFT mean (ms) |",
           "|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in serves:
        sm = r.get("server_metrics") or {}
        out.append("| " + " | ".join([
            r.get("date", "?")[:10], f"`{r.get('commit', '?')}`", r.get("machine", "?"), r.get("model_id", "?"),
            r.get("method", "?"), f"`{r['knobs']}`" if r.get("knobs") else "—", r.get("endpoint", "?"),
            serve_workload(r), str(r.get("request_rate", "?")), str(r.get("max_concurrency") or "—"),
            f"{r.get('completed', 0)}/{r.get('failed', 0)}", fmt(r.get("request_throughput"), 2),
            fmt(r.get("output_throughput"), 1),
            f"{fmt(r.get('mean_ttft_ms'), 1)} / {fmt(r.get('p99_ttft_ms'), 1)}",
            f"{fmt(r.get('mean_tpot_ms'), 2)} / {fmt(r.get('p99_tpot_ms'), 2)}",
            f"{fmt(r.get('mean_itl_ms'), 2)} / {fmt(r.get('p99_itl_ms'), 2)}",
            fmt(r.get("mean_e2el_ms"), 1), fmt(sm.get("mean_ttft_ms"), 1)]) + " |")
    out.append("")
    out.append("Client-side numbers except the last column (— when the server exposes no /metrics). Commands:")
    out.append("")
    for i, r in enumerate(serves, 1):
        out.append(f"{i}. {r.get('date', '?')}: `{r.get('command', '?')}`")
    if images:
        if draw:
            plot_serve(serves, os.path.join(img_dir, "serve.png"))
        out.append("")
        out.append(f"![serving latency vs throughput]({img_rel}/serve.png)")
    return "\n".join(out) + "\n"


def plot_serve(serves, out_png):
    plt = plt_module()
    groups = {}
    for r in serves:
        groups.setdefault((r.get("model_id", "?"), r.get("method", "?"), r.get("knobs", "")), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6 + 0.3 * len(groups)), squeeze=False)
    for (model, method, knobs), rs in groups.items():
        rs = sorted(rs, key=lambda r: r.get("output_throughput", 0))
        lab = f"{model} {method}" + (f" {knobs}" if knobs else "")
        x = [r.get("output_throughput", 0) for r in rs]
        axes[0][0].plot(x, [r.get("mean_ttft_ms") for r in rs], marker="o", label=lab)
        axes[0][1].plot(x, [r.get("mean_tpot_ms") for r in rs], marker="o", label=lab)
    for ax, t in zip(axes[0], ["mean TTFT (ms)", "mean TPOT (ms)"]):
        ax.set_xlabel("output tokens/s")
        ax.set_title(t)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=7)
    fig.tight_layout(rect=(0, 0.06 * len(labels) + 0.02, 1, 1))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


# ---- sparse (lethe bench sparse) ----------------------------------------------------------

SPARSE_HEAD = """## Sparse methods vs dense (`lethe bench sparse`)

`lethe bench sparse` (tools/bench_sparse.c) measures what a sparse method buys in decode throughput.
Every method gets the same total budget T tokens per layer: sink 64 + recent 512 + `decode_keep_tokens`
T - 576 (SnapKV keeps that many slots per layer after the prompt, Quest reads that many tokens as
16-token pages, OmniKV's sparse layers read that many). Prefix caching is off; prompts are random
tokens, identical for every method; outputs are greedy with `ignore_eos`.

**Largest batch (eviction method vs dense).** Prefilling the hundreds of long prompts such a batch
holds does not fit a short GPU call, so this part has two halves, both in one engine:

1. a real engine run (lethe_engine C API, the method on the device) of N = max(1, E / L) requests
   at input length L (E = `--engine-tokens`, see the command): prefill time (submit until every request has its first token) and
   the slots each layer keeps after compaction (read from the KV pool when the first token is
   published, i.e. after the method compacted the prompt), plus the engine's own decode tokens/s
   at that small batch;
2. the largest batch from the engine's own capacity planning: the KV pool has S slots per layer
   (sized by the engine from `--gpu-memory-utilization`); a request needs P = the method's
   `max_resident(L, L + O)` while it prefills (SnapKV: the whole prompt) and R + O afterwards (R =
   most slots any layer kept in half 1, O = planned output tokens). Method batch
   B = min(max_num_seqs, 1 + floor((S - P) / (R + O))) (the last request prefills while the others
   hold R + O); dense batch = min(max_num_seqs, floor(S / (L + O))) with the same S (the engine sizes
   the pool from the same memory budget and per-token bytes for every method). At each batch it times decode
   steps over synthetic resident KV of exactly that size inside the engine's own KV buffers (every
   layer reads R, resp. L, contiguous slots per sequence; window centred on context R + O/2, resp.
   L + O/2; median step after 2 warm-up steps; `lethe_model_forward_uniform`, CUDA graphs up to
   batch 256, logits of every sequence copied to the host as the engine's sampler needs).

This is steady-state decode at full residency (as the anchor's continuous-decode window), not a
measurement of admitting the whole batch through the scheduler.

**Matched batch (selection methods vs dense).** Real engine runs, one engine per method, the same B
prompts of L tokens: decode tokens/s = tokens produced in steps while every request was decoding
(all had their first token, none had finished) / the time of those steps. `--repeats N`
(default 1) runs each configuration N times; decode tokens/s is the median (every run's value is in
`decode_tok_s_runs`); `matched_output_requested` is `--matched-output` next to the `max_tokens` sent.
The last two columns are the window's median step as a rate (tokens of an average full-batch step /
the median step's time) and its slowest step: a method that compacts inside one decode step (R-KV's
first pass over a long prompt, while the batch waits) lowers the window's rate but not the median's
(— in files from before these fields).

**Capacity through each method's own path (`--parts ownpath`).** For dense and each of
`--ownpath-methods` (default SnapKV, PyramidKV, H2O, StreamingLLM; H2O gets
`h2o_decode_budget` = T), a pool of K (L + O) slots per layer is planned (K =
`--ownpath-pool-requests` dense requests, O = `--ownpath-output` = every request's `max_tokens`, as
requested). The method's batch in it follows the formula above from its measured R (one probe
request, the most slots a layer holds after its 4th token) and P; then that many REAL requests
(distinct random prompts, prefilled, compacted and decoded by the method's own engine path, not
synthetic KV) run `--repeats` times, and the full-batch decode tokens/s is the median. Dense runs
K requests. The batch is filled by separate prefills, not by forking one prefilled request, so
B × L prompt tokens are prefilled per run and K stays small; the batch ratio grows with K toward
(L + O) / (R + O) (one request always prefills at its peak P), so it understates the full-pool
ratio of the capacity part. GPU: the `kvcap` phase of scripts/gpu-check.sh (L = 8192, K = 4,
O = 128, 2 repeats). Not run on a GPU yet.

"""


def sparse_section(results):
    if not results:
        return SPARSE_HEAD + "_No results yet: run `lethe bench sparse ... --json docs/results/NAME.json`._\n"
    out = [SPARSE_HEAD.rstrip("\n"), ""]
    for r in results:
        dev = r.get("device", "?")
        where = r.get("gpu") or r.get("machine", "?")
        mem = (f"`--gpu-memory-utilization {r.get('gpu_memory_utilization')}`" if dev == "cuda"
               else f"KV budget {r.get('kv_cache_bytes', 0) / 2**20:.0f} MiB")
        out.append(f"**{r['_file']}**: commit `{r.get('commit', '?')}`, {r.get('date', '?')}, {where}; "
                   f"model `{r.get('model', '?')}` ({r.get('load_format', '?')} weights), device {dev}, {mem}, "
                   f"budget T = {r.get('budget')}, max_num_seqs {r.get('max_num_seqs')}, prefill chunk "
                   f"{r.get('max_num_batched_tokens')} tokens, CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}"
                   + (f", attention kernel {r['attn_kernel']}" if r.get("attn_kernel") else "") + ".")
        notes = [r[k] for k in ("commit_note", "parts_note") if r.get(k)]
        if r.get("gpu"):
            notes.append("the GPU field is nvidia-smi's name, memory, SM clock and memory clock at query time (the GPU idle), driver version")
        if notes:
            out.append("")
            out.append("Notes: " + "; ".join(notes) + ".")
        out.append("")
        cap = r.get("capacity")
        if cap:
            m = cap.get("method", "?")
            out.append(f"Largest batch: `{m}` (`{cap.get('knobs', '')}`) vs dense; KV pool "
                       f"{cap.get('pool_slots_per_layer', '?')} slots per layer "
                       f"({cap.get('kv_bytes_per_token', 0) * cap.get('pool_slots_per_layer', 0) / 2**30:.1f} GiB), "
                       f"planned output O = {cap.get('output_tokens')} tokens."
                       + (f" Error: {cap['error']}" if cap.get("error") else ""))
            out.append("")
            out.append(f"| input L | engine run: requests, prefill s | resident after compaction min / mean / max "
                       f"| R used | P | {m} batch (pool limit) | {m} step ms | {m} tok/s | dense batch (pool limit) "
                       f"| dense step ms | dense tok/s | tok/s ratio |")
            out.append("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for p in cap.get("points", []):
                er = p.get("engine_run", {})
                res = p.get("resident_after_compaction")
                a = p.get("arithmetic", {})
                md, dd = p.get("method_decode", {}), p.get("dense_decode", {})
                run = f"{er.get('requests')}, {fmt(er.get('prefill_s'), 2)}" + (" (failed)" if er.get("error") else "")
                rs = f"{res['min']} / {res['mean']:.0f} / {res['max']}" if res else "not measured"
                r_used = f"{a.get('resident_R')}" + ("" if res else " (budget)")
                out.append("| " + " | ".join([
                    str(p.get("input")), run, rs, r_used, str(a.get("prefill_peak_P")),
                    f"{a.get('method_batch')} ({a.get('method_batch_pool_limit')})", fmt(md.get("step_ms"), 2),
                    fmt(md.get("tok_s"), 0), f"{a.get('dense_batch')} ({a.get('dense_batch_pool_limit')})",
                    fmt(dd.get("step_ms"), 2), fmt(dd.get("tok_s"), 0),
                    (fmt(p.get("tok_s_ratio"), 2) + "x") if p.get("tok_s_ratio") is not None else "—"]) + " |")
            capped = []
            for p in cap.get("points", []):
                a = p.get("arithmetic", {})
                mb, ml, db = a.get("method_batch"), a.get("method_batch_pool_limit"), a.get("dense_batch")
                if a.get("method_capped_by_max_num_seqs") and ml and db:
                    capped.append(f"L={p.get('input')}: the pool alone holds {ml} {m} sequences ({ml / db:.1f}x the "
                                  f"dense batch of {db}; timed batch {mb} = {mb / db:.1f}x)")
            if capped:
                out.append("")
                out.append(f"Batch capped by max_num_seqs {cap.get('max_num_seqs', r.get('max_num_seqs'))} (only the "
                           "capped batch was timed; the uncapped one would need a larger max_num_seqs and CUDA-graph "
                           "bucket): " + "; ".join(capped) + ".")
            errs = [f"L={p.get('input')}: {p['engine_run']['error']}" for p in cap.get("points", [])
                    if p.get("engine_run", {}).get("error")]
            if errs:
                out.append("")
                out.append("Engine-run errors (R then falls back to the budget): " + "; ".join(errs))
            out.append("")
        mt = r.get("matched")
        if mt:
            out.append(f"Matched batch: {mt.get('batch')} requests x {mt.get('input')} input tokens, max_tokens "
                       f"{mt.get('max_tokens')}.")
            out.append("")
            out.append("| method | knobs | prefill s | prefill tok/s | decode tok/s | full-batch steps | preemptions "
                       "| vs dense | median-step tok/s | slowest step ms |")
            out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
            for x in mt.get("methods", []):
                if x.get("error") and x.get("decode_tok_s") is None:
                    out.append(f"| {x.get('method')} | `{x.get('knobs') or '—'}` | failed: {x['error'][:120]} "
                               "| | | | | | | |")
                    continue
                vs = x.get("decode_vs_dense")
                # the window's median step as a rate and its slowest step (files from before
                # these fields: —)
                p50 = x.get("decode_tok_s_p50_step")
                mx = x.get("decode_step_max_ms")
                out.append("| " + " | ".join([
                    x.get("method", "?"), f"`{x['knobs']}`" if x.get("knobs") else "—", fmt(x.get("prefill_s"), 2),
                    fmt(x.get("prefill_tok_s"), 0), fmt(x.get("decode_tok_s"), 1), str(x.get("decode_window_steps")),
                    str(x.get("preemptions")), (fmt(vs, 2) + "x") if vs is not None else "—",
                    fmt(p50, 1) if p50 is not None else "—", fmt(mx, 1) if mx is not None else "—"]) +
                    (" (failed: " + x["error"][:80] + ")" if x.get("error") else "") + " |")
            out.append("")
        out.append(f"Command: `{r.get('command', '?')}`")
        out.append("")
    return "\n".join(out) + "\n"


# ---- main ---------------------------------------------------------------------------------

def main(argv):
    if argv and argv[0] == "plot-eval":
        if len(argv) != 3:
            raise SystemExit("usage: gen_docs.py plot-eval RESULT.json OUT.png")
        with open(argv[1]) as f:
            plot_eval(json.load(f), argv[2])
        return 0
    if argv and argv[0] == "plot-serve":
        if len(argv) < 3:
            raise SystemExit("usage: gen_docs.py plot-serve RESULT.json [RESULT.json ...] OUT.png")
        rs = [json.load(open(p)) for p in argv[1:-1]]
        plot_serve(rs, argv[-1])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--check", action="store_true", help="exit 1 if the docs' tables are out of date")
    ap.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    a = ap.parse_args(argv)
    evals, serves, sparse, replays = load_results(a.results)
    img_dir = os.path.join(a.docs, "img")
    images = not a.no_plots
    draw = images and not a.check  # --check compares text only; the image lines stay
    if draw:
        os.makedirs(img_dir, exist_ok=True)
    grids = [r for r in evals if is_grid(r)]
    qs = eval_section([r for r in evals if not is_grid(r)], img_dir, "img", images, draw)
    ss = serve_section(serves, img_dir, "img", images, draw)
    qsec = [("quality", qs)]
    qpath = os.path.join(a.docs, "quality.md")
    if grids or (os.path.exists(qpath) and "<!-- gen:begin quality-grid -->" in open(qpath).read()):
        qsec.append(("quality-grid", grid_section(grids)))
    changed = update_doc(os.path.join(a.docs, "quality.md"), QUALITY_PREAMBLE, qsec, a.check, bool(evals))
    bench_sections = [("serve", ss)]
    if sparse:
        bench_sections.append(("sparse", sparse_section(sparse)))
    if replays:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import replay_table
        bench_sections.append(("replay", replay_table.section(replays)))
    changed |= update_doc(os.path.join(a.docs, "benchmarks.md"), BENCH_PREAMBLE, bench_sections, a.check,
                          bool(serves or sparse or replays))
    if a.check and changed:
        print("gen_docs: docs/quality.md or docs/benchmarks.md is out of date; run python3 scripts/gen_docs.py",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
