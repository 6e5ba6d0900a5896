/* kv_protect.c - protected logical positions of a KV row: the one mask every
 * way of dropping KV consults (retention pins, docs/serving.md).
 *
 * Per row, a sorted list of disjoint half-open position ranges. It belongs to
 * the row (not to a slot space: positions are the same in every layer), is
 * added to when a request is admitted (its pinned ranges), survives while the
 * row lives (a chain's row keeps its earlier turns' pins) and is dropped with
 * the row. Consumers:
 *   - eviction methods: lethe_sparse_keep_set (sparse/sparse_common.c) turns it
 *     into the per-entry pin mask of lethe_keep_sink_recent_topk, so every
 *     method keeps pinned entries whatever its scores say;
 *   - the radix cache: a block published from a row records which of its 16
 *     tokens are pinned, and pruning keeps them;
 *   - the engine's checker: no pinned position may be missing from a running
 *     request's row (lethe_kv_row_missing_protected). */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "kv/kv_internal.h"

struct kv_prot {
    int32_t *r; /* [2 n] start, end pairs, ascending, disjoint, non-adjacent */
    int32_t n, cap;
};
typedef struct kv_prot kv_prot;

static kv_prot *prot_of(lethe_kv_pool *pool, int32_t row, bool create) {
    if (row >= pool->n_prot) {
        if (!create) return NULL;
        int32_t nw = LETHE_MAX(row + 1, 2 * pool->n_prot);
        pool->prot = lethe_xrealloc(pool->prot, (size_t)nw * sizeof(*pool->prot));
        memset(pool->prot + pool->n_prot, 0, (size_t)(nw - pool->n_prot) * sizeof(*pool->prot));
        pool->n_prot = nw;
    }
    kv_prot *p = pool->prot[row];
    if (!p && create) p = pool->prot[row] = lethe_xcalloc(1, sizeof(*p));
    return p;
}

static const kv_prot *prot_get(const lethe_kv_pool *pool, int32_t row) {
    return row >= 0 && row < pool->n_prot ? pool->prot[row] : NULL;
}

void lethe_kv_row_protect(lethe_kv_pool *pool, int32_t row, const int32_t *ranges, int32_t n) {
    LETHE_ASSERT(lethe_kv_row_in_use(pool, row));
    if (n <= 0) return;
    kv_prot *p = prot_of(pool, row, true);
    /* merge: old and new ranges together, sorted by start, then coalesced */
    int32_t m = p->n + n;
    int32_t *all = lethe_xmalloc((size_t)m * 2 * sizeof(int32_t));
    memcpy(all, p->r, (size_t)p->n * 2 * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) {
        LETHE_ASSERT(ranges[2 * i] >= 0 && ranges[2 * i] < ranges[2 * i + 1]);
        all[2 * (p->n + i)] = ranges[2 * i];
        all[2 * (p->n + i) + 1] = ranges[2 * i + 1];
    }
    for (int32_t i = 1; i < m; i++) { /* insertion sort by start (few ranges) */
        int32_t s = all[2 * i], e = all[2 * i + 1], j = i - 1;
        while (j >= 0 && all[2 * j] > s) {
            all[2 * (j + 1)] = all[2 * j];
            all[2 * (j + 1) + 1] = all[2 * j + 1];
            j--;
        }
        all[2 * (j + 1)] = s;
        all[2 * (j + 1) + 1] = e;
    }
    int32_t k = 0;
    for (int32_t i = 0; i < m; i++) {
        if (k > 0 && all[2 * i] <= all[2 * (k - 1) + 1]) {
            all[2 * (k - 1) + 1] = LETHE_MAX(all[2 * (k - 1) + 1], all[2 * i + 1]);
        } else {
            all[2 * k] = all[2 * i];
            all[2 * k + 1] = all[2 * i + 1];
            k++;
        }
    }
    free(p->r);
    p->r = all;
    p->n = k;
    p->cap = m;
}

void lethe_kv_row_unprotect(lethe_kv_pool *pool, int32_t row) {
    kv_prot *p = prot_of(pool, row, false);
    if (!p) return;
    free(p->r);
    free(p);
    pool->prot[row] = NULL;
}

int32_t lethe_kv_row_protected(const lethe_kv_pool *pool, int32_t row, const int32_t **ranges) {
    const kv_prot *p = prot_get(pool, row);
    *ranges = p ? p->r : NULL;
    return p ? p->n : 0;
}

bool lethe_kv_pos_protected(const lethe_kv_pool *pool, int32_t row, int32_t pos) {
    const kv_prot *p = prot_get(pool, row);
    if (!p) return false;
    int32_t lo = 0, hi = p->n; /* the first range ending after pos */
    while (lo < hi) {
        int32_t mid = (lo + hi) / 2;
        if (p->r[2 * mid + 1] <= pos) lo = mid + 1;
        else hi = mid;
    }
    return lo < p->n && p->r[2 * lo] <= pos;
}

int32_t lethe_kv_row_pin_mask(const lethe_kv_pool *pool, int32_t sp, int32_t row, uint8_t *mask) {
    const kv_prot *p = prot_get(pool, row);
    const int32_t len = lethe_kv_row_len(pool, sp, row);
    const int32_t *pos = lethe_kv_row_pos(pool, sp, row);
    int32_t n = 0, k = 0;
    for (int32_t i = 0; i < len; i++) {
        while (p && k < p->n && p->r[2 * k + 1] <= pos[i]) k++;
        mask[i] = p && k < p->n && p->r[2 * k] <= pos[i];
        n += mask[i];
    }
    return n;
}

int32_t lethe_kv_row_missing_protected(const lethe_kv_pool *pool, int32_t row, int32_t from,
                                       int32_t limit) {
    const kv_prot *p = prot_get(pool, row);
    if (!p) return -1;
    for (int32_t sp = 0; sp < pool->n_spaces; sp++) {
        const int32_t len = lethe_kv_row_len(pool, sp, row);
        const int32_t *pos = lethe_kv_row_pos(pool, sp, row);
        int32_t i = 0;
        for (int32_t k = 0; k < p->n; k++)
            for (int32_t q = LETHE_MAX(p->r[2 * k], from); q < p->r[2 * k + 1] && q < limit; q++) {
                while (i < len && pos[i] < q) i++;
                if (i >= len || pos[i] != q) return q;
            }
    }
    return -1;
}

void lethe_kv_protect_free(lethe_kv_pool *pool) {
    for (int32_t r = 0; r < pool->n_prot; r++)
        if (pool->prot[r]) {
            free(pool->prot[r]->r);
            free(pool->prot[r]);
        }
    free(pool->prot);
    pool->prot = NULL;
    pool->n_prot = 0;
}
