/* chain.c - Chain Cache records, turn admission, strict-LRU reclaim of IDLE
 * chains and bounded tombstones (see chain.h for the model).
 *
 * Records live in a flat array (a server holds at most a few thousand
 * chains; every operation is a linear scan that costs far less than one
 * forward pass). The LRU clock is a counter bumped on every begin/finish, so
 * two chains never share a timestamp and the reclaim order is total.
 * Tombstones are a FIFO ring of ids: the oldest is forgotten first.
 *
 * Capacity usage per slot space = sum over IDLE chains of resident slots +
 * sum over ACTIVE chains of their reservation + each distinct shared prefix
 * once (branching chains: digest and length equal); a chain's reservation is
 * resident + (suffix tokens + gen_peak), capped by the space size, and its
 * resident and reserved slots leave out its shared prefix. */
#include "cache/chain.h"

#include <errno.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "core/status.h"
#include "core/util.h"

typedef struct chain_rec {
    char id[LETHE_CHAIN_ID_CAP];
    char owner[LETHE_CHAIN_OWNER_CAP]; /* tenant that created it ("" = anonymous) */
    uint8_t fp[LETHE_CHAIN_FP_BYTES];
    lethe_chain_state state;
    int32_t processed;
    uint8_t digest[LETHE_CHAIN_FP_BYTES];
    int32_t *hist;             /* logical token history */
    int32_t n_hist, cap_hist;
    int32_t *resident;         /* [n_spaces] slots held */
    int32_t *reserved;         /* [n_spaces] ACTIVE: planned peak (incl. resident) */
    uint64_t last_access;
    int32_t n_messages, pending_messages;
    int32_t share;             /* shared prefix tokens (0: none) */
    uint8_t share_digest[LETHE_CHAIN_FP_BYTES]; /* of tokens [0, share) */
    void *payload;             /* IDLE: resident KV handle (or its host-tier stub) */
    uint8_t host;              /* HOST_*: where an IDLE chain's KV is */
    int32_t *host_resident;    /* [n_spaces] its resident slots before demotion */
} chain_rec;

/* An IDLE chain's KV: in the pool, queued for demotion (the payload is in
 * the demote list; a turn cancels it), being copied by the engine thread (a
 * turn waits), or in the host tier (a turn claims it). */
enum { HOST_NONE = 0, HOST_QUEUED, HOST_MOVING, HOST_STORED };

struct lethe_chain_table {
    lethe_chain_table_params p;
    pthread_mutex_t mu;
    chain_rec **recs;
    int32_t n_recs, cap_recs;
    struct { char id[LETHE_CHAIN_ID_CAP], owner[LETHE_CHAIN_OWNER_CAP]; } *tomb; /* ring */
    int32_t tomb_head, n_tomb;
    void **released;
    int32_t n_released, cap_released;
    void **demote;             /* payloads to demote (HOST_QUEUED chains) */
    int32_t n_demote, cap_demote;
    pthread_cond_t moved;      /* a HOST_MOVING chain left that state */
    uint64_t clock;
    lethe_chain_stats st;
    int64_t *usage;            /* scratch [n_spaces] */
    chain_rec **cand;          /* scratch */
    int32_t cap_cand;
};

lethe_status lethe_chain_code_status(lethe_chain_code c) {
    switch (c) {
    case LETHE_CHAIN_OK: return LETHE_OK;
    case LETHE_CHAIN_CAPACITY:
    case LETHE_CHAIN_QUEUE_FULL: return LETHE_ERR_CAPACITY;
    case LETHE_CHAIN_NOT_FOUND:
    case LETHE_CHAIN_GONE: return LETHE_ERR_NOT_FOUND;
    case LETHE_CHAIN_BAD_REQUEST:
    case LETHE_CHAIN_MODE_DISABLED:
    case LETHE_CHAIN_INVALID_REQUEST: return LETHE_ERR_INVALID;
    case LETHE_CHAIN_BUSY:
    case LETHE_CHAIN_PREFIX_MISMATCH:
    case LETHE_CHAIN_FINGERPRINT_MISMATCH:
    case LETHE_CHAIN_ENGINE_BUSY: return LETHE_ERR_BUSY;
    }
    return LETHE_ERR_INVALID;
}

const char *lethe_chain_status_name(lethe_chain_status s) {
    switch (s) {
    case LETHE_CHAIN_CREATED: return "created";
    case LETHE_CHAIN_RESUMED: return "resumed";
    case LETHE_CHAIN_RECREATED: return "recreated";
    }
    return "created";
}

/* ---- hashing and ids ---- */

void lethe_chain_digest(const int32_t *tokens, int32_t n, uint8_t out[LETHE_CHAIN_FP_BYTES]) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    LETHE_ASSERT(ctx && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) == 1);
    uint8_t buf[8 * 256];
    for (int32_t i = 0; i < n;) {
        int32_t k = LETHE_MIN(n - i, 256);
        for (int32_t j = 0; j < k; j++) {
            uint64_t v = (uint64_t)(int64_t)tokens[i + j];
            for (int b = 0; b < 8; b++) buf[8 * j + b] = (uint8_t)(v >> (8 * b));
        }
        LETHE_ASSERT(EVP_DigestUpdate(ctx, buf, (size_t)k * 8) == 1);
        i += k;
    }
    unsigned int len = 0;
    LETHE_ASSERT(EVP_DigestFinal_ex(ctx, out, &len) == 1 && len == LETHE_CHAIN_FP_BYTES);
    EVP_MD_CTX_free(ctx);
}

void lethe_chain_fingerprint(const char *description, uint8_t out[LETHE_CHAIN_FP_BYTES]) {
    unsigned int len = 0;
    LETHE_ASSERT(EVP_Digest(description, strlen(description), out, &len, EVP_sha256(), NULL) == 1 &&
                 len == LETHE_CHAIN_FP_BYTES);
}

int lethe_chain_new_id(char out[LETHE_CHAIN_ID_CAP]) {
    static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    uint8_t raw[24];
    size_t got = 0;
    while (got < sizeof(raw)) {
        ssize_t k = getrandom(raw + got, sizeof(raw) - got, 0);
        if (k < 0) {
            if (errno == EINTR) continue;
            return lethe_errorf(LETHE_ERR_IO, "chain id: getrandom failed: %s", strerror(errno));
        }
        got += (size_t)k;
    }
    char *o = out + sprintf(out, "chain_");
    for (int i = 0; i < 24; i += 3) { /* 3 bytes -> 4 chars, no padding */
        uint32_t v = (uint32_t)raw[i] << 16 | (uint32_t)raw[i + 1] << 8 | raw[i + 2];
        for (int j = 3; j >= 0; j--) *o++ = b64[(v >> (6 * j)) & 63];
    }
    *o = 0;
    return 0;
}

bool lethe_chain_id_valid(const char *id) {
    size_t n = id ? strlen(id) : 0;
    if (n < 8 || n >= LETHE_CHAIN_ID_CAP) return false;
    for (size_t i = 0; i < n; i++) {
        char c = id[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-' || c == '.'))
            return false;
    }
    return true;
}

/* ---- table ---- */

lethe_chain_table *lethe_chain_create(const lethe_chain_table_params *p) {
    LETHE_ASSERT(p->n_spaces > 0 && p->slots_per_space > 0);
    lethe_chain_table *t = lethe_xcalloc(1, sizeof(*t));
    t->p = *p;
    if (t->p.max_tombstones <= 0) t->p.max_tombstones = LETHE_CHAIN_DEFAULT_TOMBSTONES;
    t->tomb = lethe_xcalloc((size_t)t->p.max_tombstones, sizeof(*t->tomb));
    t->usage = lethe_xcalloc((size_t)p->n_spaces, sizeof(int64_t));
    LETHE_ASSERT(!p->demote || (p->claim && p->present));
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->moved, NULL);
    return t;
}

static void rec_free(chain_rec *r) {
    if (!r) return;
    free(r->hist);
    free(r->resident);
    free(r->reserved);
    free(r->host_resident);
    free(r);
}

void lethe_chain_destroy(lethe_chain_table *t) {
    if (!t) return;
    for (int32_t i = 0; i < t->n_recs; i++) rec_free(t->recs[i]);
    free(t->recs);
    free(t->tomb);
    free(t->released);
    free(t->demote);
    free(t->usage);
    free(t->cand);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->moved);
    free(t);
}

static chain_rec *find(lethe_chain_table *t, const char *id) {
    for (int32_t i = 0; i < t->n_recs; i++)
        if (strcmp(t->recs[i]->id, id) == 0) return t->recs[i];
    return NULL;
}

static const char *owner_of(const char *owner) { return owner ? owner : ""; }

/* owner NULL: any owner (inspection) */
static bool is_tomb(const lethe_chain_table *t, const char *id, const char *owner) {
    for (int32_t i = 0; i < t->n_tomb; i++) {
        int32_t k = (t->tomb_head + i) % t->p.max_tombstones;
        if (strcmp(t->tomb[k].id, id) == 0) return !owner || strcmp(t->tomb[k].owner, owner) == 0;
    }
    return false;
}

static void add_tomb(lethe_chain_table *t, const chain_rec *r) {
    int32_t cap = t->p.max_tombstones;
    if (t->n_tomb == cap) { /* forget the oldest */
        t->tomb_head = (t->tomb_head + 1) % cap;
        t->n_tomb--;
    }
    int32_t k = (t->tomb_head + t->n_tomb) % cap;
    snprintf(t->tomb[k].id, LETHE_CHAIN_ID_CAP, "%s", r->id);
    snprintf(t->tomb[k].owner, LETHE_CHAIN_OWNER_CAP, "%s", r->owner);
    t->n_tomb++;
}

static void queue_release(lethe_chain_table *t, void *payload) {
    if (!payload) return;
    if (t->n_released == t->cap_released) {
        t->cap_released = t->cap_released ? 2 * t->cap_released : 16;
        t->released = lethe_xrealloc(t->released, (size_t)t->cap_released * sizeof(void *));
    }
    t->released[t->n_released++] = payload;
}

static void push_ptr(void ***arr, int32_t *n, int32_t *cap, void *p) {
    if (*n == *cap) {
        *cap = *cap ? 2 * *cap : 16;
        *arr = lethe_xrealloc(*arr, (size_t)*cap * sizeof(void *));
    }
    (*arr)[(*n)++] = p;
}

/* takes p out of the demote list (false when it is not there) */
static bool unqueue_demotion(lethe_chain_table *t, const void *p) {
    for (int32_t i = 0; i < t->n_demote; i++)
        if (t->demote[i] == p) {
            t->demote[i] = t->demote[--t->n_demote];
            return true;
        }
    return false;
}

/* Removes record r from the table, tombstones its id and queues its payload. */
static void drop(lethe_chain_table *t, chain_rec *r) {
    LETHE_ASSERT(r->host != HOST_MOVING);
    if (r->host == HOST_QUEUED) LETHE_ASSERT(unqueue_demotion(t, r->payload));
    for (int32_t i = 0; i < t->n_recs; i++) {
        if (t->recs[i] == r) {
            t->recs[i] = t->recs[--t->n_recs];
            break;
        }
    }
    add_tomb(t, r);
    queue_release(t, r->payload);
    rec_free(r);
}

static chain_rec *rec_new(lethe_chain_table *t) {
    chain_rec *r = lethe_xcalloc(1, sizeof(*r));
    r->resident = lethe_xcalloc((size_t)t->p.n_spaces, sizeof(int32_t));
    r->reserved = lethe_xcalloc((size_t)t->p.n_spaces, sizeof(int32_t));
    r->host_resident = lethe_xcalloc((size_t)t->p.n_spaces, sizeof(int32_t));
    if (t->n_recs == t->cap_recs) {
        t->cap_recs = t->cap_recs ? 2 * t->cap_recs : 16;
        t->recs = lethe_xrealloc(t->recs, (size_t)t->cap_recs * sizeof(*t->recs));
    }
    t->recs[t->n_recs++] = r;
    return r;
}

static bool same_share(const chain_rec *a, int32_t share, const uint8_t *digest) {
    return a->share == share && share > 0 && !memcmp(a->share_digest, digest, LETHE_CHAIN_FP_BYTES);
}

/* whether a chain other than `self` before index `before` (all: n_recs)
 * holds this shared prefix */
static bool share_held(const lethe_chain_table *t, const chain_rec *self, int32_t before,
                       int32_t share, const uint8_t *digest) {
    for (int32_t i = 0; i < before; i++)
        if (t->recs[i] != self && same_share(t->recs[i], share, digest)) return true;
    return false;
}

/* usage[sp] of every chain except `self`: their private slots, and each
 * distinct shared prefix they hold once */
static void usage_without(lethe_chain_table *t, const chain_rec *self) {
    memset(t->usage, 0, (size_t)t->p.n_spaces * sizeof(int64_t));
    for (int32_t i = 0; i < t->n_recs; i++) {
        const chain_rec *r = t->recs[i];
        if (r == self) continue;
        const int32_t *u = r->state == LETHE_CHAIN_ACTIVE ? r->reserved : r->resident;
        int32_t sh = r->share > 0 && !share_held(t, self, i, r->share, r->share_digest) ? r->share : 0;
        for (int32_t sp = 0; sp < t->p.n_spaces; sp++) t->usage[sp] += u[sp] + sh;
    }
}

static bool fits(const lethe_chain_table *t, const int32_t *need) {
    for (int32_t sp = 0; sp < t->p.n_spaces; sp++)
        if (t->usage[sp] + need[sp] > t->p.slots_per_space) return false;
    return true;
}

static int cmp_lru(const void *a, const void *b) {
    const chain_rec *x = *(const chain_rec *const *)a, *y = *(const chain_rec *const *)b;
    return x->last_access < y->last_access ? -1 : x->last_access > y->last_access;
}

/* An IDLE chain's KV leaves the pool: to the host tier when there is one
 * (the record stays, its slots go once the engine thread copied them), else
 * the chain is dropped. */
static void reclaim(lethe_chain_table *t, chain_rec *v) {
    if (t->p.demote && v->payload) {
        memcpy(v->host_resident, v->resident, (size_t)t->p.n_spaces * sizeof(int32_t));
        memset(v->resident, 0, (size_t)t->p.n_spaces * sizeof(int32_t));
        v->host = HOST_QUEUED;
        push_ptr(&t->demote, &t->n_demote, &t->cap_demote, v->payload);
    } else {
        drop(t, v);
    }
}

/* Makes room for `need` (per space) besides `self`: picks IDLE victims in
 * LRU order; reclaims them only if that suffices. Returns victims reclaimed,
 * or -1 when it cannot fit (nothing reclaimed). */
static int32_t make_room(lethe_chain_table *t, const chain_rec *self, const int32_t *need) {
    usage_without(t, self);
    if (fits(t, need)) return 0;
    if (t->n_recs > t->cap_cand) {
        t->cap_cand = t->n_recs;
        t->cand = lethe_xrealloc(t->cand, (size_t)t->cap_cand * sizeof(*t->cand));
    }
    int32_t nc = 0;
    for (int32_t i = 0; i < t->n_recs; i++)
        if (t->recs[i] != self && t->recs[i]->state == LETHE_CHAIN_IDLE && t->recs[i]->host == HOST_NONE)
            t->cand[nc++] = t->recs[i];
    qsort(t->cand, (size_t)nc, sizeof(*t->cand), cmp_lru);
    int32_t k = 0;
    while (k < nc && !fits(t, need)) {
        for (int32_t sp = 0; sp < t->p.n_spaces; sp++) t->usage[sp] -= t->cand[k]->resident[sp];
        k++;
    }
    if (!fits(t, need)) return -1;
    for (int32_t i = 0; i < k; i++) reclaim(t, t->cand[i]);
    t->st.n_reclaimed += k;
    return k;
}

static lethe_chain_code reject(lethe_chain_table *t, lethe_chain_turn *out, lethe_chain_code c,
                               const char *fmt, const char *id) {
    out->code = c;
    snprintf(out->message, sizeof(out->message), fmt, id);
    t->st.n_rejected++;
    if (c == LETHE_CHAIN_CAPACITY) t->st.n_capacity_rejected++;
    return c;
}

static void hist_set(chain_rec *r, const int32_t *a, int32_t na, const int32_t *b, int32_t nb) {
    int32_t n = na + nb;
    if (n > r->cap_hist) {
        r->cap_hist = LETHE_MAX(n, 2 * r->cap_hist);
        r->hist = lethe_xrealloc(r->hist, (size_t)r->cap_hist * sizeof(int32_t));
    }
    if (a != r->hist && na) memmove(r->hist, a, (size_t)na * sizeof(int32_t));
    if (nb) memcpy(r->hist + na, b, (size_t)nb * sizeof(int32_t));
    r->n_hist = n;
}

void lethe_chain_begin(lethe_chain_table *t, const lethe_chain_begin_args *a, lethe_chain_turn *out) {
    memset(out, 0, sizeof(*out));
    pthread_mutex_lock(&t->mu);
    const char *id = a->chain_id && a->chain_id[0] ? a->chain_id : NULL;
    chain_rec *r = NULL;
    lethe_chain_status status = LETHE_CHAIN_CREATED;
    int32_t *full = NULL, n_full = 0, reused = 0;
    if (a->n_tokens < 1 && !a->append) {
        reject(t, out, LETHE_CHAIN_BAD_REQUEST, "empty prompt%s", "");
        goto done;
    }
    if (a->append && !id) {
        reject(t, out, LETHE_CHAIN_BAD_REQUEST, "chain_append_start requires a chain_id%s", "");
        goto done;
    }
    if (id) {
        /* its KV is being copied to the host tier right now: wait for the copy */
        while ((r = find(t, id)) && r->host == HOST_MOVING) pthread_cond_wait(&t->moved, &t->mu);
        /* another tenant's chain does not exist for this one (same answer as an unknown id) */
        if (r && strcmp(r->owner, owner_of(a->owner)) != 0) r = NULL;
        if (!r) {
            if (is_tomb(t, id, owner_of(a->owner)))
                reject(t, out, LETHE_CHAIN_GONE, "chain %.60s was reclaimed or invalidated; resend the full "
                       "prompt without chain_id", id);
            else
                reject(t, out, LETHE_CHAIN_NOT_FOUND, "unknown chain_id %.60s", id);
            goto done;
        }
        if (r->state == LETHE_CHAIN_ACTIVE) {
            reject(t, out, LETHE_CHAIN_BUSY, "chain %.60s is busy with another request", id);
            goto done;
        }
        if (memcmp(r->fp, a->fingerprint, LETHE_CHAIN_FP_BYTES) != 0) {
            reject(t, out, LETHE_CHAIN_FINGERPRINT_MISMATCH,
                   "chain %.60s was built by a different model/method configuration", id);
            goto done;
        }
        if (a->append && a->append_start != r->n_messages) {
            char msg[64];
            snprintf(msg, sizeof(msg), "%d, the chain covers %d", a->append_start, r->n_messages);
            reject(t, out, LETHE_CHAIN_PREFIX_MISMATCH,
                   "chain_append_start does not continue the chain: appended messages start at %s", msg);
            goto done;
        }
        /* the full prompt of this turn */
        n_full = a->append ? r->n_hist + a->n_tokens : a->n_tokens;
        full = lethe_xmalloc((size_t)LETHE_MAX(n_full, 1) * sizeof(int32_t));
        if (a->append) {
            if (r->n_hist) memcpy(full, r->hist, (size_t)r->n_hist * sizeof(int32_t));
            if (a->n_tokens) memcpy(full + r->n_hist, a->tokens, (size_t)a->n_tokens * sizeof(int32_t));
        } else {
            memcpy(full, a->tokens, (size_t)n_full * sizeof(int32_t));
        }
        bool prefix_ok = n_full > r->processed;
        if (prefix_ok && r->processed > 0) {
            uint8_t d[LETHE_CHAIN_FP_BYTES];
            lethe_chain_digest(full, r->processed, d);
            prefix_ok = memcmp(d, r->digest, sizeof(d)) == 0;
        }
        if (prefix_ok && r->host == HOST_QUEUED) { /* not copied yet: it stays in the pool */
            LETHE_ASSERT(unqueue_demotion(t, r->payload));
            memcpy(r->resident, r->host_resident, (size_t)t->p.n_spaces * sizeof(int32_t));
            r->host = HOST_NONE;
        }
        if (prefix_ok) {
            status = LETHE_CHAIN_RESUMED;
            reused = r->processed;
        } else if (a->append) {
            reject(t, out, LETHE_CHAIN_PREFIX_MISMATCH,
                   "chain %.60s: the appended prompt does not continue the processed tokens", id);
            goto done;
        } else {
            status = LETHE_CHAIN_RECREATED;
            reused = 0;
        }
    } else {
        if (a->new_id && a->new_id[0]) { /* named by a load balancer: ids are never reused */
            if (!lethe_chain_id_valid(a->new_id)) {
                reject(t, out, LETHE_CHAIN_BAD_REQUEST, "invalid new chain id %.60s", a->new_id);
                goto done;
            }
            if (find(t, a->new_id) || is_tomb(t, a->new_id, NULL)) {
                reject(t, out, LETHE_CHAIN_BAD_REQUEST, "new chain id %.60s is already taken",
                       a->new_id);
                goto done;
            }
        }
        n_full = a->n_tokens;
        full = lethe_xmalloc((size_t)n_full * sizeof(int32_t));
        memcpy(full, a->tokens, (size_t)n_full * sizeof(int32_t));
    }
    if (a->max_len > 0 && (int64_t)n_full + 1 > a->max_len) {
        char msg[64];
        snprintf(msg, sizeof(msg), "%d", n_full);
        reject(t, out, LETHE_CHAIN_BAD_REQUEST, "prompt of %s tokens does not fit max_model_len", msg);
        goto done;
    }
    /* the shared prefix: a resumed chain keeps its own, a new one takes whole
     * blocks of what it asked for, leaving at least the last prompt token */
    int32_t share = 0;
    uint8_t share_digest[LETHE_CHAIN_FP_BYTES] = {0};
    if (status == LETHE_CHAIN_RESUMED) {
        share = r->share;
        memcpy(share_digest, r->share_digest, sizeof(share_digest));
    } else if (a->share_tokens > 0) {
        int32_t blk = LETHE_MAX(t->p.share_block, 1);
        share = LETHE_MIN(a->share_tokens / blk, (n_full - 1) / blk) * blk;
        if (share > 0) lethe_chain_digest(full, share, share_digest);
    }
    /* capacity: this chain's peak per space; private = without the shared
     * prefix, which counts only when no other chain holds it already */
    int32_t *need = lethe_xmalloc((size_t)t->p.n_spaces * sizeof(int32_t));
    int64_t gen = LETHE_MAX(a->gen_peak, 0);
    if (a->max_len > 0) gen = LETHE_MIN(gen, (int64_t)a->max_len - n_full);
    int64_t extra = (int64_t)(n_full - LETHE_MAX(reused, share)) + gen;
    int32_t own_share =
        share > 0 && !share_held(t, r, t->n_recs, share, share_digest) ? share : 0;
    for (int32_t sp = 0; sp < t->p.n_spaces; sp++) {
        /* a chain in the host tier needs its slots again */
        int64_t base = status != LETHE_CHAIN_RESUMED ? 0
                       : r->host == HOST_STORED ? r->host_resident[sp]
                                                : r->resident[sp];
        need[sp] = (int32_t)LETHE_MIN(base + extra + own_share, (int64_t)t->p.slots_per_space + 1);
    }
    int32_t k = make_room(t, r, need);
    if (k < 0) {
        free(need);
        reject(t, out, LETHE_CHAIN_CAPACITY,
               "no KV capacity for this chain turn even after reclaiming every idle chain%s", "");
        goto done;
    }
    out->n_reclaimed = k;
    if (r && r->host == HOST_STORED && status == LETHE_CHAIN_RESUMED) {
        /* the KV comes back from the host tier, unless the tier dropped it */
        if (!t->p.claim(t->p.host_ctx, r->payload)) {
            free(need);
            drop(t, r);
            t->st.n_lost++;
            reject(t, out, LETHE_CHAIN_GONE, "chain %.60s was reclaimed from the KV cache and the "
                   "host tier; resend the full prompt without chain_id", id);
            goto done;
        }
        t->st.n_restored++;
        r->host = HOST_NONE;
    }
    if (!r) {
        r = rec_new(t);
        if (a->new_id && a->new_id[0]) snprintf(r->id, sizeof(r->id), "%s", a->new_id);
        else if (lethe_chain_new_id(r->id) != 0) { /* no randomness: refuse rather than guess */
            t->n_recs--;
            rec_free(r);
            free(need);
            reject(t, out, LETHE_CHAIN_CAPACITY, "%s", lethe_last_error());
            goto done;
        }
        memcpy(r->fp, a->fingerprint, LETHE_CHAIN_FP_BYTES);
        snprintf(r->owner, sizeof(r->owner), "%s", owner_of(a->owner));
        t->st.n_created++;
    } else if (status == LETHE_CHAIN_RECREATED) {
        if (r->host == HOST_QUEUED) LETHE_ASSERT(unqueue_demotion(t, r->payload));
        r->host = HOST_NONE; /* a demoted payload's blob goes with its release */
        queue_release(t, r->payload);
        r->payload = NULL;
        r->processed = 0;
        memset(r->resident, 0, (size_t)t->p.n_spaces * sizeof(int32_t));
        t->st.n_recreated++;
    } else {
        t->st.n_resumed++;
    }
    for (int32_t sp = 0; sp < t->p.n_spaces; sp++) r->reserved[sp] = need[sp] - own_share;
    free(need);
    r->share = share;
    memcpy(r->share_digest, share_digest, sizeof(share_digest));
    r->state = LETHE_CHAIN_ACTIVE;
    r->last_access = ++t->clock;
    r->pending_messages = a->n_messages > 0 ? a->n_messages + 1 : 0;
    t->st.reused_tokens += reused;
    t->st.prompt_tokens += n_full;
    out->code = LETHE_CHAIN_OK;
    snprintf(out->id, sizeof(out->id), "%s", r->id);
    out->status = status;
    out->reused = reused;
    out->tokens = full;
    out->n_tokens = n_full;
    out->shared = share;
    full = NULL; /* a resumed chain's payload stays in the record until lethe_chain_take_payload */
done:
    free(full);
    pthread_mutex_unlock(&t->mu);
}

void *lethe_chain_take_payload(lethe_chain_table *t, const char *id) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find(t, id);
    LETHE_ASSERT(r && r->state == LETHE_CHAIN_ACTIVE);
    void *p = r->payload;
    r->payload = NULL;
    pthread_mutex_unlock(&t->mu);
    return p;
}

void *lethe_chain_peek_payload(lethe_chain_table *t, const char *id) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find(t, id);
    void *p = r && r->state == LETHE_CHAIN_IDLE ? r->payload : NULL;
    pthread_mutex_unlock(&t->mu);
    return p;
}

void *lethe_chain_turn_payload(lethe_chain_table *t, const char *id) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find(t, id);
    void *p = r && r->state == LETHE_CHAIN_ACTIVE ? r->payload : NULL;
    pthread_mutex_unlock(&t->mu);
    return p;
}

void lethe_chain_for_each_payload(lethe_chain_table *t, void (*visit)(void *ctx, void *payload), void *ctx) {
    pthread_mutex_lock(&t->mu);
    for (int32_t i = 0; i < t->n_recs; i++)
        if (t->recs[i]->payload) visit(ctx, t->recs[i]->payload);
    for (int32_t i = 0; i < t->n_released; i++) visit(ctx, t->released[i]);
    pthread_mutex_unlock(&t->mu);
}

int32_t lethe_chain_count_payloads(lethe_chain_table *t) {
    pthread_mutex_lock(&t->mu);
    int32_t n = t->n_released;
    for (int32_t i = 0; i < t->n_recs; i++) n += t->recs[i]->payload != NULL;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void lethe_chain_finish(lethe_chain_table *t, const char *id, const int32_t *tokens, int32_t n_tokens,
                        int32_t processed, const int32_t *resident, void *payload) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find(t, id);
    LETHE_ASSERT(r && r->state == LETHE_CHAIN_ACTIVE && !r->payload);
    LETHE_ASSERT(processed >= 0 && processed <= n_tokens);
    hist_set(r, tokens, n_tokens, NULL, 0);
    if (!payload) processed = 0;
    r->processed = processed;
    lethe_chain_digest(tokens, processed, r->digest);
    for (int32_t sp = 0; sp < t->p.n_spaces; sp++) {
        r->resident[sp] = payload ? resident[sp] : 0;
        r->reserved[sp] = 0;
    }
    r->payload = payload;
    r->n_messages = r->pending_messages;
    r->state = LETHE_CHAIN_IDLE;
    r->last_access = ++t->clock;
    pthread_mutex_unlock(&t->mu);
}

int32_t lethe_chain_limit_idle(lethe_chain_table *t, int32_t max_idle) {
    pthread_mutex_lock(&t->mu);
    if (t->n_recs > t->cap_cand) {
        t->cap_cand = t->n_recs;
        t->cand = lethe_xrealloc(t->cand, (size_t)t->cap_cand * sizeof(*t->cand));
    }
    int32_t nc = 0;
    for (int32_t i = 0; i < t->n_recs; i++)
        if (t->recs[i]->state == LETHE_CHAIN_IDLE && t->recs[i]->payload && t->recs[i]->host == HOST_NONE)
            t->cand[nc++] = t->recs[i];
    qsort(t->cand, (size_t)nc, sizeof(*t->cand), cmp_lru);
    const int32_t k = LETHE_MAX(nc - max_idle, 0);
    for (int32_t i = 0; i < k; i++) reclaim(t, t->cand[i]);
    t->st.n_reclaimed += k;
    pthread_mutex_unlock(&t->mu);
    return k;
}

void lethe_chain_abandon(lethe_chain_table *t, const char *id, void *payload) {
    pthread_mutex_lock(&t->mu);
    queue_release(t, payload);
    chain_rec *r = find(t, id);
    if (r) {
        queue_release(t, r->payload); /* not taken yet (the turn never started) */
        r->payload = NULL;
        LETHE_ASSERT(r->state == LETHE_CHAIN_ACTIVE);
        drop(t, r);
        t->st.n_invalidated++;
    }
    pthread_mutex_unlock(&t->mu);
}

int32_t lethe_chain_take_released(lethe_chain_table *t, void **out, int32_t cap) {
    pthread_mutex_lock(&t->mu);
    int32_t k = LETHE_MIN(cap, t->n_released);
    for (int32_t i = 0; i < k; i++) out[i] = t->released[t->n_released - 1 - i];
    t->n_released -= k;
    pthread_mutex_unlock(&t->mu);
    return k;
}

int32_t lethe_chain_drain_all(lethe_chain_table *t, void **out, int32_t cap) {
    pthread_mutex_lock(&t->mu);
    int32_t k = 0;
    t->n_demote = 0; /* their payloads are the records' own, taken below */
    for (int32_t i = 0; i < t->n_recs && k < cap; i++) {
        if (t->recs[i]->payload) {
            out[k++] = t->recs[i]->payload;
            t->recs[i]->payload = NULL;
            t->recs[i]->host = HOST_NONE;
            memset(t->recs[i]->resident, 0, (size_t)t->p.n_spaces * sizeof(int32_t));
        }
    }
    while (k < cap && t->n_released > 0) out[k++] = t->released[--t->n_released];
    pthread_mutex_unlock(&t->mu);
    return k;
}

/* under t->mu */
static void rec_info(const lethe_chain_table *t, const chain_rec *r, lethe_chain_info *out) {
    memset(out, 0, sizeof(*out));
    out->state = r->state;
    out->processed = r->processed;
    out->n_history = r->n_hist;
    out->n_messages = r->n_messages;
    out->last_access = r->last_access;
    for (int32_t sp = 0; sp < t->p.n_spaces; sp++) {
        out->resident_total += r->resident[sp];
        out->resident_max = LETHE_MAX(out->resident_max, r->resident[sp]);
    }
    memcpy(out->digest, r->digest, sizeof(out->digest));
    out->shared = r->share;
    out->on_host = r->host != HOST_NONE;
}

lethe_chain_code lethe_chain_lookup(lethe_chain_table *t, const char *id, lethe_chain_info *out) {
    pthread_mutex_lock(&t->mu);
    lethe_chain_code c = LETHE_CHAIN_OK;
    chain_rec *r = find(t, id);
    if (!r) c = is_tomb(t, id, NULL) ? LETHE_CHAIN_GONE : LETHE_CHAIN_NOT_FOUND;
    else if (out) rec_info(t, r, out);
    pthread_mutex_unlock(&t->mu);
    return c;
}

static int by_recent_use(const void *a, const void *b) {
    uint64_t x = ((const lethe_chain_entry *)a)->info.last_access,
             y = ((const lethe_chain_entry *)b)->info.last_access;
    return x < y ? 1 : x > y ? -1 : 0;
}

int32_t lethe_chain_list(lethe_chain_table *t, lethe_chain_entry *out, int32_t cap) {
    pthread_mutex_lock(&t->mu);
    const int32_t n = t->n_recs;
    lethe_chain_entry *all = n ? lethe_xmalloc((size_t)n * sizeof(*all)) : NULL;
    for (int32_t i = 0; i < n; i++) {
        snprintf(all[i].id, sizeof(all[i].id), "%s", t->recs[i]->id);
        rec_info(t, t->recs[i], &all[i].info);
    }
    pthread_mutex_unlock(&t->mu);
    if (n) qsort(all, (size_t)n, sizeof(*all), by_recent_use); /* the LRU clock has no ties */
    if (out && cap > 0 && n > 0) memcpy(out, all, (size_t)LETHE_MIN(n, cap) * sizeof(*all)); /* all: NULL when n = 0 */
    free(all);
    return n;
}

int32_t lethe_chain_history(lethe_chain_table *t, const char *id, int32_t *out, int32_t cap) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find(t, id);
    int32_t n = -1;
    if (r) {
        n = r->n_hist;
        if (out && cap > 0) memcpy(out, r->hist, (size_t)LETHE_MIN(cap, n) * sizeof(int32_t));
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

void lethe_chain_get_stats(lethe_chain_table *t, lethe_chain_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->st;
    out->n_chains = t->n_recs;
    out->n_tombstones = t->n_tomb;
    out->resident_slots = out->reserved_slots = 0;
    for (int32_t i = 0; i < t->n_recs; i++) {
        const chain_rec *r = t->recs[i];
        if (r->state == LETHE_CHAIN_ACTIVE) out->n_active++; else out->n_idle++;
        out->n_on_host += r->host != HOST_NONE;
        for (int32_t sp = 0; sp < t->p.n_spaces; sp++) {
            out->resident_slots += r->resident[sp];
            out->reserved_slots += r->state == LETHE_CHAIN_ACTIVE ? r->reserved[sp] : r->resident[sp];
        }
        if (r->share > 0) {
            out->n_branched++;
            if (!share_held(t, NULL, i, r->share, r->share_digest)) {
                out->n_shared_prefixes++;
                out->shared_slots += (int64_t)r->share * t->p.n_spaces;
            }
        }
    }
    pthread_mutex_unlock(&t->mu);
}

/* ---- host tier ---- */

static chain_rec *find_payload(lethe_chain_table *t, const void *p) {
    for (int32_t i = 0; i < t->n_recs; i++)
        if (t->recs[i]->payload == p) return t->recs[i];
    return NULL;
}

int32_t lethe_chain_take_demotions(lethe_chain_table *t, void **out, int32_t cap) {
    pthread_mutex_lock(&t->mu);
    int32_t k = LETHE_MIN(cap, t->n_demote);
    for (int32_t i = 0; i < k; i++) {
        void *p = t->demote[--t->n_demote];
        chain_rec *r = find_payload(t, p);
        LETHE_ASSERT(r && r->state == LETHE_CHAIN_IDLE && r->host == HOST_QUEUED);
        r->host = HOST_MOVING;
        out[i] = p;
    }
    pthread_mutex_unlock(&t->mu);
    return k;
}

void lethe_chain_demoted(lethe_chain_table *t, void *payload, bool ok) {
    pthread_mutex_lock(&t->mu);
    chain_rec *r = find_payload(t, payload);
    LETHE_ASSERT(r && r->host == HOST_MOVING);
    if (ok) {
        r->host = HOST_STORED;
        t->st.n_demoted++;
    } else { /* lost: as a reclaimed chain without a host tier */
        r->host = HOST_NONE;
        drop(t, r);
        t->st.n_lost++;
    }
    pthread_cond_broadcast(&t->moved);
    pthread_mutex_unlock(&t->mu);
}

int32_t lethe_chain_sweep_host(lethe_chain_table *t) {
    pthread_mutex_lock(&t->mu);
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_recs;) {
        chain_rec *r = t->recs[i];
        if (r->host == HOST_STORED && !t->p.present(t->p.host_ctx, r->payload)) {
            drop(t, r); /* moves the last record into slot i */
            t->st.n_lost++;
            n++;
        } else {
            i++;
        }
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}
