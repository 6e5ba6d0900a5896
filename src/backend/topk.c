/* topk.c - lethe_topk_indices (see topk.h): a size-k heap whose root is the
 * worst kept element, then the kept indices sorted ascending. */
#include "backend/topk.h"

#include <stdlib.h>

#include "core/status.h"
#include "core/util.h"

typedef struct heap_item {
    float s;
    int32_t i;
} heap_item;

/* a is "worse" than b: b ranks before a */
static bool worse(heap_item a, heap_item b) { return lethe_rank_before(b.s, b.i, a.s, a.i); }

static void sift_down(heap_item *h, int32_t n, int32_t at) {
    for (;;) {
        int32_t l = 2 * at + 1, r = l + 1, w = at;
        if (l < n && worse(h[l], h[w])) w = l;
        if (r < n && worse(h[r], h[w])) w = r;
        if (w == at) return;
        heap_item t = h[at];
        h[at] = h[w];
        h[w] = t;
        at = w;
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

int32_t lethe_topk_indices(const float *scores, int32_t n, int32_t k, int32_t *out) {
    LETHE_ASSERT(n >= 0 && k >= 0);
    if (k > n) k = n;
    if (k == 0) return 0;
    if (k == n) {
        for (int32_t i = 0; i < n; i++) out[i] = i;
        return n;
    }
    heap_item *h = lethe_xmalloc((size_t)k * sizeof(*h));
    for (int32_t i = 0; i < k; i++) h[i] = (heap_item){scores[i], i};
    for (int32_t i = k / 2 - 1; i >= 0; i--) sift_down(h, k, i);
    for (int32_t i = k; i < n; i++) {
        heap_item c = {scores[i], i};
        if (worse(h[0], c)) { /* c beats the worst kept one */
            h[0] = c;
            sift_down(h, k, 0);
        }
    }
    for (int32_t i = 0; i < k; i++) out[i] = h[i].i;
    free(h);
    qsort(out, (size_t)k, sizeof(*out), cmp_i32);
    return k;
}
