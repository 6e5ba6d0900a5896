/* host_tier.c - blobs in host memory under (owner, key) with a byte cap and
 * strict LRU (see host_tier.h).
 *
 * Entries sit in a chained hash table (power-of-two buckets, doubled when
 * the entries outnumber them) and on one doubly linked list, most recently
 * used at the head: put and take move an entry to the head or off the list,
 * room is made from the tail. Every operation is O(1) but the key listing. */
#include "cache/host_tier.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

typedef struct ht_ent {
    uint64_t key;
    uint32_t owner;
    size_t n;
    void *blob;
    struct ht_ent *prev, *next; /* LRU list: prev toward the head (newest) */
    struct ht_ent *hnext;
} ht_ent;

struct lethe_host_tier {
    pthread_mutex_t mu;
    ht_ent **buckets;
    size_t n_buckets; /* power of two */
    ht_ent *head, *tail;
    lethe_host_tier_stats st;
};

static size_t bucket_of(const lethe_host_tier *t, uint32_t owner, uint64_t key) {
    uint64_t h = key ^ ((uint64_t)owner * 0x9e3779b97f4a7c15ull);
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return (size_t)h & (t->n_buckets - 1);
}

lethe_host_tier *lethe_host_tier_create(size_t cap_bytes) {
    LETHE_ASSERT(cap_bytes > 0);
    lethe_host_tier *t = lethe_xcalloc(1, sizeof(*t));
    pthread_mutex_init(&t->mu, NULL);
    t->n_buckets = 256;
    t->buckets = lethe_xcalloc(t->n_buckets, sizeof(*t->buckets));
    t->st.cap_bytes = cap_bytes;
    return t;
}

void lethe_host_tier_destroy(lethe_host_tier *t) {
    if (!t) return;
    for (ht_ent *e = t->head; e;) {
        ht_ent *next = e->next;
        free(e->blob);
        free(e);
        e = next;
    }
    free(t->buckets);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

static ht_ent **slot_of(lethe_host_tier *t, uint32_t owner, uint64_t key) {
    ht_ent **p = &t->buckets[bucket_of(t, owner, key)];
    while (*p && ((*p)->key != key || (*p)->owner != owner)) p = &(*p)->hnext;
    return p;
}

static void lru_unlink(lethe_host_tier *t, ht_ent *e) {
    if (e->prev) e->prev->next = e->next;
    else t->head = e->next;
    if (e->next) e->next->prev = e->prev;
    else t->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru_push_head(lethe_host_tier *t, ht_ent *e) {
    e->prev = NULL;
    e->next = t->head;
    if (t->head) t->head->prev = e;
    t->head = e;
    if (!t->tail) t->tail = e;
}

/* unlinks e from the table and the list, accounts for it; the caller owns it */
static void remove_ent(lethe_host_tier *t, ht_ent *e) {
    ht_ent **p = slot_of(t, e->owner, e->key);
    LETHE_ASSERT(*p == e);
    *p = e->hnext;
    lru_unlink(t, e);
    t->st.used_bytes -= e->n;
    t->st.entries--;
}

static void grow(lethe_host_tier *t) {
    size_t nb = t->n_buckets * 2;
    ht_ent **b = lethe_xcalloc(nb, sizeof(*b));
    size_t old = t->n_buckets;
    ht_ent **ob = t->buckets;
    t->buckets = b;
    t->n_buckets = nb;
    for (size_t i = 0; i < old; i++)
        for (ht_ent *e = ob[i]; e;) {
            ht_ent *next = e->hnext;
            size_t k = bucket_of(t, e->owner, e->key);
            e->hnext = b[k];
            b[k] = e;
            e = next;
        }
    free(ob);
}

bool lethe_host_tier_put(lethe_host_tier *t, uint32_t owner, uint64_t key, void *blob, size_t n) {
    pthread_mutex_lock(&t->mu);
    ht_ent **p = slot_of(t, owner, key);
    if (*p) { /* the same key again: the new blob replaces the old one */
        ht_ent *old = *p;
        remove_ent(t, old);
        free(old->blob);
        free(old);
    }
    if (n > t->st.cap_bytes) {
        t->st.refused++;
        pthread_mutex_unlock(&t->mu);
        free(blob);
        return false;
    }
    while (t->st.used_bytes + n > t->st.cap_bytes) { /* room from the least recently used */
        ht_ent *v = t->tail;
        LETHE_ASSERT(v);
        remove_ent(t, v);
        free(v->blob);
        free(v);
        t->st.evictions++;
    }
    if ((size_t)t->st.entries + 1 > t->n_buckets) grow(t);
    ht_ent *e = lethe_xcalloc(1, sizeof(*e));
    *e = (ht_ent){.key = key, .owner = owner, .n = n, .blob = blob};
    size_t k = bucket_of(t, owner, key);
    e->hnext = t->buckets[k];
    t->buckets[k] = e;
    lru_push_head(t, e);
    t->st.used_bytes += n;
    t->st.entries++;
    t->st.puts++;
    t->st.bytes_in += (int64_t)n;
    pthread_mutex_unlock(&t->mu);
    return true;
}

void *lethe_host_tier_take(lethe_host_tier *t, uint32_t owner, uint64_t key, size_t *n) {
    pthread_mutex_lock(&t->mu);
    ht_ent *e = *slot_of(t, owner, key);
    void *blob = NULL;
    if (e) {
        remove_ent(t, e);
        blob = e->blob;
        if (n) *n = e->n;
        t->st.hits++;
        t->st.bytes_out += (int64_t)e->n;
        free(e);
    } else {
        t->st.misses++;
        if (n) *n = 0;
    }
    pthread_mutex_unlock(&t->mu);
    return blob;
}

size_t lethe_host_tier_read(lethe_host_tier *t, uint32_t owner, uint64_t key, void *dst, size_t cap) {
    pthread_mutex_lock(&t->mu);
    const ht_ent *e = *slot_of(t, owner, key);
    size_t n = e ? e->n : 0;
    if (e && dst && cap) memcpy(dst, e->blob, LETHE_MIN(cap, e->n));
    pthread_mutex_unlock(&t->mu);
    return n;
}

bool lethe_host_tier_drop(lethe_host_tier *t, uint32_t owner, uint64_t key) {
    pthread_mutex_lock(&t->mu);
    ht_ent *e = *slot_of(t, owner, key);
    if (e) {
        remove_ent(t, e);
        free(e->blob);
        free(e);
    }
    pthread_mutex_unlock(&t->mu);
    return e != NULL;
}

int64_t lethe_host_tier_keys(lethe_host_tier *t, uint32_t owner, uint64_t *out, int64_t cap) {
    pthread_mutex_lock(&t->mu);
    int64_t n = 0;
    for (const ht_ent *e = t->head; e; e = e->next)
        if (e->owner == owner) {
            if (out && n < cap) out[n] = e->key;
            n++;
        }
    pthread_mutex_unlock(&t->mu);
    return n;
}

void lethe_host_tier_get_stats(lethe_host_tier *t, lethe_host_tier_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->st;
    pthread_mutex_unlock(&t->mu);
}

bool lethe_host_tier_check(lethe_host_tier *t) {
    pthread_mutex_lock(&t->mu);
    size_t bytes = 0;
    int64_t n = 0;
    bool ok = true;
    const ht_ent *prev = NULL;
    for (const ht_ent *e = t->head; e && ok; prev = e, e = e->next) {
        ok = e->prev == prev && *slot_of(t, e->owner, e->key) == e;
        bytes += e->n;
        n++;
    }
    ok = ok && t->tail == prev && bytes == t->st.used_bytes && n == t->st.entries &&
         bytes <= t->st.cap_bytes;
    int64_t in_table = 0;
    for (size_t i = 0; i < t->n_buckets; i++)
        for (const ht_ent *e = t->buckets[i]; e; e = e->hnext) in_table++;
    ok = ok && in_table == n;
    pthread_mutex_unlock(&t->mu);
    return ok;
}
