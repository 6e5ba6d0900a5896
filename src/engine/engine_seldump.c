/* engine_seldump.c - LETHE_DUMP_SELECTIONS=FILE: what attention reads at every
 * decode step, for the reference comparisons (tests/ref): the kept token set
 * of an evicting method (its rows after compaction), the pages a selection
 * method picks, per KV head where rows keep per-head lengths.
 *
 * One JSON line per (decode sequence, layer) of every step, appended to FILE
 * (opened once at create, flushed at destroy):
 *
 *   {"step": S, "layer": L, "req": ID, "pos": [p0, p1, ...]}
 *   {"step": S, "layer": L, "req": ID, "pos": [...], "heads": [[...], ...]}
 *
 * pos: the logical positions the sequence's selection reads in layer L,
 * ascending, the new token last; heads[h]: those KV head h reads (present
 * only when the layer's plan has per-KV-head lists). A uniform plan (one plan
 * for every layer) is written once with layer -1. Prefill chunks and
 * auxiliary prefills are not written. Positions come from the row's slots, so
 * the selection must be host-readable: the CPU backend only (create refuses
 * others). */
#include <stdio.h>

#include "core/env.h"
#include "core/util.h"
#include "engine/engine_internal.h"

lethe_status eng_seldump_init(lethe_engine *e) {
    const char *path = NULL;
    lethe_status st = lethe_env_path(LETHE_ENV_DUMP_SELECTIONS, &path);
    if (st != LETHE_OK || !path[0]) return st;
    if (!e->runner.be || !lethe_backend_has(e->runner.be, LETHE_BE_HOST_MEMORY))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "LETHE_DUMP_SELECTIONS=%s: needs a backend whose memory the host reads "
                            "(the CPU backend)",
                            path);
    e->diag.seldump = fopen(path, "a");
    if (!e->diag.seldump)
        return lethe_errorf(LETHE_ERR_IO, "LETHE_DUMP_SELECTIONS=%s: cannot open for writing", path);
    return LETHE_OK;
}

void eng_seldump_close(lethe_engine *e) {
    if (e->diag.seldump) fclose(e->diag.seldump);
    e->diag.seldump = NULL;
}

/* positions of sel[0..n) (a subsequence of the row slots[0..len), ascending) */
static void write_positions(FILE *f, const int32_t *sel, int32_t n, const int32_t *slots,
                            const int32_t *pos, int32_t len) {
    fputc('[', f);
    for (int32_t j = 0, i = 0; j < n; j++, i++) {
        while (i < len && slots[i] != sel[j]) i++;
        LETHE_ASSERT(i < len); /* a selection is a subsequence of its row */
        fprintf(f, j ? ",%d" : "%d", pos[i]);
    }
    fputc(']', f);
}

void eng_seldump_layer(lethe_engine *e, int32_t layer, const lethe_layer_plan *plan) {
    FILE *f = e->diag.seldump;
    if (!f) return;
    const int32_t KH = e->runner.cfg.n_kv_heads, sp = lethe_kv_space_of(e->pool, layer);
    for (int32_t s = 0; s < e->step.st.n_seqs; s++) {
        const lethe_sparse_seq *q = &e->step.seqs[s];
        if (q->is_prefill || q->is_aux) continue;
        const int32_t len = lethe_kv_row_len(e->pool, sp, q->row);
        const int32_t *slots = lethe_kv_row_slots(e->pool, sp, q->row);
        const int32_t *pos = lethe_kv_row_pos(e->pool, sp, q->row);
        fprintf(f, "{\"step\":%lld,\"layer\":%d,\"req\":%llu,\"pos\":", (long long)e->step.index,
                e->fwd.uniform ? -1 : layer, (unsigned long long)q->request_id);
        const int32_t b = plan->sel_begin[s];
        write_positions(f, plan->sel_slots + b, plan->sel_begin[s + 1] - b, slots, pos, len);
        if (plan->head_sel_begin) {
            fputs(",\"heads\":[", f);
            for (int32_t h = 0; h < KH; h++) {
                const int32_t hb = plan->head_sel_begin[s * KH + h];
                if (h) fputc(',', f);
                write_positions(f, plan->head_sel_slots + hb,
                                plan->head_sel_begin[s * KH + h + 1] - hb, slots, pos, len);
            }
            fputc(']', f);
        }
        fputs("}\n", f);
    }
}
