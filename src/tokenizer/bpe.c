/* bpe.c - byte-level BPE of one pre-tokenized word.
 *
 * The word's bytes start as single-byte symbols (their ids via byte_id[]),
 * kept in a doubly linked list over an array. A binary min-heap holds the
 * candidate adjacent pairs keyed by (merge rank, left position); the lowest
 * rank is merged first and, among equal ranks, the leftmost, which is the
 * order HF tokenizers (Word::merge_all) and the original GPT-2 code produce.
 * A popped candidate is applied only if both symbols still carry the ids it
 * was made from (stale entries are dropped). Cost: O(n log n) per word.
 *
 * ignore_merges (Llama-3): a word whose whole byte-level piece is in the
 * vocabulary becomes that token directly, before any merge. */
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "tokenizer/tok_internal.h"

typedef struct cand {
    uint64_t key;   /* (rank << 32) | left position */
    int32_t left, right; /* ids of the pair when pushed */
} cand;

struct tok_bpe_scratch {
    int32_t *id, *prev, *next;
    size_t cap;
    cand *heap;
    size_t heap_n, heap_cap;
    char *piece;     /* byte-level form of the word, for ignore_merges */
    size_t piece_cap;
};

tok_bpe_scratch *tok_bpe_scratch_new(void) { return lethe_xcalloc(1, sizeof(tok_bpe_scratch)); }

void tok_bpe_scratch_free(tok_bpe_scratch *s) {
    if (!s) return;
    free(s->id);
    free(s->prev);
    free(s->next);
    free(s->heap);
    free(s->piece);
    free(s);
}

static void heap_push(tok_bpe_scratch *s, cand c) {
    if (s->heap_n == s->heap_cap) {
        s->heap_cap = s->heap_cap ? s->heap_cap * 2 : 64;
        s->heap = lethe_xrealloc(s->heap, s->heap_cap * sizeof(cand));
    }
    size_t i = s->heap_n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (s->heap[p].key <= c.key) break;
        s->heap[i] = s->heap[p];
        i = p;
    }
    s->heap[i] = c;
}

static cand heap_pop(tok_bpe_scratch *s) {
    cand top = s->heap[0];
    cand last = s->heap[--s->heap_n];
    size_t i = 0, n = s->heap_n;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= n) break;
        size_t m = (l + 1 < n && s->heap[l + 1].key < s->heap[l].key) ? l + 1 : l;
        if (s->heap[m].key >= last.key) break;
        s->heap[i] = s->heap[m];
        i = m;
    }
    if (n > 0) s->heap[i] = last;
    return top;
}

/* pushes the pair starting at symbol position i if it has a merge */
static void push_pair(const lethe_tokenizer *t, tok_bpe_scratch *s, int32_t i) {
    int32_t j = s->next[i];
    if (i < 0 || j < 0) return;
    const tok_pairmap *m = &t->merges;
    uint64_t key = ((uint64_t)(uint32_t)s->id[i] << 32) | (uint32_t)s->id[j];
    uint64_t k = key ^ (key >> 31);
    k *= 0x9E3779B97F4A7C15ull;
    for (uint32_t h = (uint32_t)(k >> 32) & m->mask;; h = (h + 1) & m->mask) {
        if (m->keys[h] == UINT64_MAX) return;
        if (m->keys[h] == key) {
            heap_push(s, (cand){((uint64_t)(uint32_t)m->rank[h] << 32) | (uint32_t)i, s->id[i], s->id[j]});
            return;
        }
    }
}

static int32_t merged_id(const lethe_tokenizer *t, int32_t a, int32_t b) {
    const tok_pairmap *m = &t->merges;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint64_t k = key ^ (key >> 31);
    k *= 0x9E3779B97F4A7C15ull;
    for (uint32_t h = (uint32_t)(k >> 32) & m->mask;; h = (h + 1) & m->mask) {
        if (m->keys[h] == key) return m->merged[h];
        LETHE_ASSERT(m->keys[h] != UINT64_MAX);
    }
}

int tok_bpe_word(const lethe_tokenizer *t, const char *w, size_t n, tok_ids *out, tok_bpe_scratch *s) {
    if (n == 0) return -1;
    if (t->ignore_merges || n == 1) {
        if (s->piece_cap < 2 * n) {
            s->piece_cap = 2 * n + 64;
            s->piece = lethe_xrealloc(s->piece, s->piece_cap);
        }
        size_t pl = 0;
        for (size_t i = 0; i < n; i++) pl += (size_t)tok_utf8_put(tok_byte_to_cp((uint8_t)w[i]), s->piece + pl);
        int32_t id = tok_strmap_get(t, &t->bpe_map, s->piece, pl);
        if (id >= 0) {
            tok_ids_push(out, id);
            return -1;
        }
    }
    if (s->cap < n) {
        s->cap = n + 64;
        s->id = lethe_xrealloc(s->id, s->cap * sizeof(int32_t));
        s->prev = lethe_xrealloc(s->prev, s->cap * sizeof(int32_t));
        s->next = lethe_xrealloc(s->next, s->cap * sizeof(int32_t));
    }
    /* initial symbols; a byte without a piece becomes unk. HF drops it when there is
     * no unk token; we refuse the text instead, so no input vanishes silently. */
    int32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[(uint8_t)w[i]];
        if (id < 0) id = t->unk_id;
        if (id < 0) return (uint8_t)w[i];
        s->id[m] = id;
        s->prev[m] = m - 1;
        s->next[m] = m + 1;
        m++;
    }
    if (m == 0) return -1;
    s->next[m - 1] = -1;
    s->heap_n = 0;
    if (t->merges.keys)
        for (int32_t i = 0; i + 1 < m; i++) push_pair(t, s, i);
    while (s->heap_n > 0) {
        cand c = heap_pop(s);
        int32_t i = (int32_t)(c.key & 0xFFFFFFFFu);
        int32_t j = s->next[i];
        /* stale: the left symbol was absorbed (id set to -1) or either side changed */
        if (s->id[i] != c.left || j < 0 || s->id[j] != c.right) continue;
        s->id[i] = merged_id(t, c.left, c.right);
        s->id[j] = -1;
        s->next[i] = s->next[j];
        if (s->next[j] >= 0) s->prev[s->next[j]] = i;
        if (s->prev[i] >= 0) push_pair(t, s, s->prev[i]);
        push_pair(t, s, i);
    }
    for (int32_t i = 0; i >= 0; i = s->next[i]) tok_ids_push(out, s->id[i]);
    return -1;
}
