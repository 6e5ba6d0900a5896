/* retroinfer.c - RetroInfer (methods.md §12): a vector index over keys
 * (segmented spherical k-means per layer and KV head), decode attention that
 * is exact over the best clusters and estimated over the next tier, and an
 * optional host-memory tier for the clustered KV with a device cluster cache.
 *
 * Zones of a decode token's attention, per layer and KV head h (row entries,
 * L = the row's length, end = the first entry not clustered yet):
 *   exact, resident   sink [0, s) and the tail [end, L): the unclustered
 *                     tokens, the recent window and the new token
 *   exact, retrieved  the members of the n_ret best clusters
 *   estimated         the next n_est clusters: cluster c counts as count_c
 *                     keys at its mean key m_c with its mean value, i.e.
 *                     numerator e^{q.m_c/sqrt d} V_c (V_c = value sum),
 *                     denominator count_c e^{q.m_c/sqrt d}
 *   ignored           the remaining clusters
 * one softmax over the three (backend cluster_attention). Clusters rank by
 * q.m_c / sqrt(d) averaged over the g query heads of the group (GQA: one
 * cluster order per KV head from the group's mean logit). n_ret =
 * ceil(retrieve x n_clusters), n_est = floor(estimate x n_clusters) of the
 * head's clusters (the author's 1.8% / 23.2%: the budgets are fractions of
 * clusters, with 16-token clusters on average ~ the same fraction of tokens).
 *
 * Index (finish_step, after the forward): when a prompt's prefill completes
 * with at least min_tokens entries between sink and recent, [s, L - r) is
 * split into floor(n / segment) equal segments; each gets ceil(n / csize)
 * clusters from `iters` rounds of spherical k-means (keys centred on the
 * segment's mean, unit centroids, initialised at evenly strided keys, an
 * empty cluster keeps its centroid) and a final assignment. Per non-empty
 * cluster: mean key, value sum (f32), count, and its member list (the
 * reverse list, ascending entries). After that, every `update` tokens that
 * leave the recent window become one more segment (update / csize clusters).
 * The assignment rounds run on the backend (cluster_assign); the centroid
 * updates, sums and lists on the host from the segment's K / V read back.
 *
 * Device tables per layer: cent / vsum f32 [rows, head_dim], count f32
 * [rows]; a (segment, head) takes one contiguous run of rows (first-fit run
 * allocator), uploaded at once. Counted in the pool budget per slot
 * (slot_overhead_bytes: n_layers KH (1/csize + 1/update) (2 hd + 1) floats).
 *
 * Host tier (retroinfer_host_kv): each clustered segment's K / V are also
 * copied, cluster-contiguous (f32, per head), into the request's host store,
 * and the segment's entries then leave the pool (LETHE_SPARSE_OFFLOADS:
 * finish_step drops [sink, host_end) from the shared row with lethe_kv_keep,
 * so their slots are free for other requests). A request then holds sink +
 * the unclustered tail (< recent + update entries) in the pool instead of
 * its whole context. Decode reads the retrieved clusters from a per-layer
 * device ring of cache_rows head vectors (K and V, activations; the ring's
 * bytes are taken off the KV budget, kv_reserve_bytes) holding recently
 * fetched clusters: a hit reads the ring, a miss copies the cluster from
 * host memory into the ring (all misses of a pass in one transfer per K /
 * V). The zoned sequences of a layer run in passes whose retrieved clusters
 * fit the ring together (one cluster_attention call per pass); a single
 * sequence whose retrieved clusters exceed the ring places them best first
 * and estimates the rest (counted "demoted", with a warning to raise
 * retroinfer_cache_rows), so outputs equal the device path whenever the
 * ring holds one sequence's retrieval. Host bytes are asked for at admission
 * (request_init: the prompt's K / V, refused with a message naming
 * retroinfer_host_gib when the budget is spent) and per extension segment
 * (refused: that segment and every later one stay in the pool, with a
 * warning). A row with retention pins offloads nothing. The prompt's prefill
 * still needs the whole prompt resident (its attention reads it): the saving
 * starts when the prompt is clustered. Counters (hits, misses, bytes,
 * offloaded entries, demoted clusters) log at destroy.
 *
 * Layout: planes "k" / "v" as native KV; kv_store stores as dense does;
 * kv_attend runs the backend attention over the selections (prefill and
 * unclustered rows read everything; a clustered decode row's selection is
 * its resident exact zone) and then cluster_attention over the clustered
 * decode rows, which overwrites their output. retrieve >= 1 (every cluster
 * retrieved) reads the whole row through the backend attention: dense, bit
 * for bit. Without a backend (the fake runner) every layer reads densely. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "sparse/retroinfer.h"
#include "sparse/sparse.h"

/* one (layer, KV head) of a request: its clusters and reverse lists */
typedef struct rhead {
    int32_t n_cl, cap_cl;
    int32_t *row;                    /* [n_cl] table row of cluster c */
    int64_t *host_at;                /* [n_cl] first head vector in the host store, -1: none */
    int32_t *mbeg;                   /* [n_cl + 1] member offsets into mem */
    int32_t *mem, n_mem, cap_mem;    /* members (row entries), cluster after cluster */
    int32_t *runs, n_runs, cap_runs; /* (start, len) table runs to free */
} rhead;

typedef struct rlayer {
    int32_t end;      /* entries [sink, end) are clustered (end 0: no index yet) */
    int32_t host_end; /* entries [sink, host_end) are in the host store (0: none) */
    rhead *h;         /* [n_kv_heads] */
    float *hk, *hv; /* host tier: [n_host, head_dim] f32 */
    int64_t n_host, cap_host;
} rlayer;

/* Entries are logical: entry e is the request's e-th token in its row,
 * counting the n_drop entries [sink, sink + n_drop) the host tier took out of
 * the pool (the same in every layer: one shared row). Pool row index of a
 * resident entry: e < sink ? e : e - n_drop (phys below). */
typedef struct rstate {
    rlayer *L;             /* [n_layers] */
    int64_t host_reserved; /* bytes counted against the host budget */
    int32_t n_drop;        /* entries offloaded: their slots are freed */
    bool no_drop;          /* retention pins in the row: nothing is offloaded */
} rstate;

/* pool row index of resident logical entry e */
static inline int32_t phys_of(const rstate *rs, int32_t sink, int32_t e) {
    if (e < sink) return e;
    LETHE_ASSERT(e >= sink + rs->n_drop); /* an offloaded entry has no slot */
    return e - rs->n_drop;
}

typedef struct run {
    int32_t start, len;
} run;
enum { LETHE_MAX_KV_HEADS_RETRO = 256 };

typedef struct rtables {
    void *cent, *vsum, *count; /* backend f32 */
    run *free_runs;
    int32_t n_free, cap_free;
    /* host tier: the device ring of fetched clusters */
    void *ck, *cv;      /* [cache_rows, head_dim] activations */
    int64_t ring_total; /* head vectors ever placed (absolute ring position) */
    int64_t *cache_at;  /* [rows] absolute ring position of a row's cluster, -1 */
} rtables;

typedef struct retro_priv {
    lethe_knob_values kv;
    int32_t sink, recent, csize, segment, update, min_tokens, iters, cache_rows;
    double retrieve, estimate;
    bool host_kv;
    int64_t host_budget, host_used;
    bool tables_ready, warned_rows, warned_host, warned_ring;
    int32_t rows_cap;            /* table rows per layer */
    int64_t ctx_knob, ctx_tokens; /* host tier: tokens the tables are sized for (kv_reserve) */
    rtables *t;                  /* [n_layers] */
    const lethe_sparse_step *st; /* the step being run */
    int32_t *mode, cap_mode;     /* per step sequence: 1 = three-zone decode in the current layer */
    /* scratch: K / V of a segment (host f32), k-means, op arguments */
    float *sk, *sv, *cent, *mean, *tmp;
    int32_t *assign, *order;
    size_t cap_seg, cap_cent;
    lethe_dev_buf rows_buf; /* device scratch for gather_rows */
    int32_t *q_rows, *sbeg, *sids, *xbeg, *xs, *ebeg, *eids;
    float *sc;
    int64_t cap_q, cap_s, cap_x, cap_e;
    float *stage_k, *stage_v;
    int64_t cap_stage;
    void *tops; /* ranked [cap_tops]: one (query, head)'s clusters by score */
    int32_t cap_tops;
    int32_t *cntbuf;
    int32_t *rk_c, *rk_nret, *rk_beg; /* per (i, h): retrieved (best first) then estimated */
    int64_t cap_rk, cap_rkb;
    /* counters */
    int64_t n_hits, n_misses, n_pool_reads, n_demoted, bytes_fetched, n_built;
    int64_t n_offloaded; /* entries dropped from the pool */
} retro_priv;
#define PRIV(m) ((retro_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"retroinfer_sink", LETHE_KNOB_INT, "4", 0, 1 << 20, "first tokens always read exactly"},
    {"retroinfer_recent", LETHE_KNOB_INT, "64", 1, 1 << 20,
     "newest tokens always read exactly (never clustered)"},
    {"retroinfer_cluster_size", LETHE_KNOB_INT, "16", 1, 4096, "average tokens per cluster"},
    {"retroinfer_segment", LETHE_KNOB_INT, "8192", 1, 1 << 24,
     "tokens per k-means segment of the prompt index"},
    {"retroinfer_update", LETHE_KNOB_INT, "1024", 1, 1 << 24,
     "decode tokens per extension segment"},
    {"retroinfer_min_tokens", LETHE_KNOB_INT, "16384", 1, 1 << 30,
     "build the index once this many tokens lie between sink and recent"},
    {"retroinfer_kmeans_iters", LETHE_KNOB_INT, "9", 0, 100,
     "k-means rounds before the final assignment"},
    {"retroinfer_retrieve", LETHE_KNOB_FLOAT, "0.018", 0, 1,
     "fraction of clusters read exactly (1 = dense)"},
    {"retroinfer_estimate", LETHE_KNOB_FLOAT, "0.232", 0, 1,
     "fraction of clusters estimated from value sums"},
    {"retroinfer_host_kv", LETHE_KNOB_BOOL, "false", 0, 1,
     "clustered K / V in host memory and out of the device pool, retrieved clusters fetched "
     "through a device cache"},
    {"retroinfer_host_gib", LETHE_KNOB_FLOAT, "64", 0, 1 << 20,
     "host memory budget of the host tier (GiB)"},
    {"retroinfer_context_tokens", LETHE_KNOB_INT, "0", 0, 1 << 30,
     "host tier: context tokens (all requests) the device cluster tables hold; 0 = "
     "max_num_seqs x max_model_len, at most what retroinfer_host_gib holds"},
    {"retroinfer_cache_rows", LETHE_KNOB_INT, "65536", 16, 1 << 26,
     "device cluster cache per layer, in head vectors (host tier)"},
};

/* grows *p (elements of `elem` bytes, capacity *cap) to hold `need` */
static void *grow64(void *p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return p;
    int64_t c = LETHE_MAX(need, 2 * *cap);
    *cap = c;
    return lethe_xrealloc(p, (size_t)c * elem);
}
static void *grow32(void *p, int32_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return p;
    LETHE_ASSERT(need <= INT32_MAX / 2);
    int32_t c = LETHE_MAX((int32_t)need, 2 * *cap);
    *cap = c;
    return lethe_xrealloc(p, (size_t)c * elem);
}

static lethe_status retro_init(lethe_sparse_method *m) {
    retro_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}

static void retro_destroy(lethe_sparse_method *m) {
    retro_priv *p = PRIV(m);
    if (!p) return;
    lethe_backend *be = m->env.be;
    if (p->host_kv && (p->n_hits || p->n_misses))
        LOG_INFO("retroinfer: host tier: %lld cluster hits, %lld misses (%.1f MiB fetched), %lld "
                 "clusters read from the pool, %lld estimated for want of ring rows, %lld entries "
                 "offloaded from the pool",
                 (long long)p->n_hits, (long long)p->n_misses, (double)p->bytes_fetched / (1 << 20),
                 (long long)p->n_pool_reads, (long long)p->n_demoted, (long long)p->n_offloaded);
    for (int32_t l = 0; p->t && l < m->env.n_layers; l++) {
        rtables *t = &p->t[l];
        void *bufs[5] = {t->cent, t->vsum, t->count, t->ck, t->cv};
        for (int i = 0; i < 5; i++)
            if (bufs[i]) be->ops->release(be, bufs[i]);
        free(t->free_runs);
        free(t->cache_at);
    }
    free(p->t);
    if (be) lethe_dev_buf_free(m, &p->rows_buf);
    void *h[] = {p->mode,  p->sk,     p->sv,      p->cent,    p->mean, p->tmp,   p->assign,
                 p->order, p->q_rows, p->sbeg,    p->sids,    p->xbeg, p->xs,    p->ebeg,
                 p->eids,  p->sc,     p->stage_k, p->stage_v, p->tops, p->cntbuf,
                 p->rk_c,  p->rk_nret, p->rk_beg};
    for (size_t i = 0; i < LETHE_ARRAY_LEN(h); i++) free(h[i]);
    free(p);
    m->priv = NULL;
}

static lethe_status retro_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status retro_configure(lethe_sparse_method *m) {
    retro_priv *p = PRIV(m);
    const lethe_sparse_ops *o = m->ops;
    p->sink = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_sink");
    p->recent = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_recent");
    p->csize = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_cluster_size");
    p->segment = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_segment");
    p->update = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_update");
    p->min_tokens = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_min_tokens");
    p->iters = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_kmeans_iters");
    p->retrieve = lethe_knob_num(o, &p->kv, "retroinfer_retrieve");
    p->estimate = lethe_knob_num(o, &p->kv, "retroinfer_estimate");
    p->host_kv = lethe_knob_num(o, &p->kv, "retroinfer_host_kv") != 0;
    p->host_budget = (int64_t)(lethe_knob_num(o, &p->kv, "retroinfer_host_gib") *
                               (double)(1u << 30));
    p->cache_rows = (int32_t)lethe_knob_num(o, &p->kv, "retroinfer_cache_rows");
    p->ctx_knob = (int64_t)lethe_knob_num(o, &p->kv, "retroinfer_context_tokens");
    /* every segment holds >= update tokens: the table bound of slot_overhead_bytes */
    if (p->segment < p->update || p->min_tokens < p->update)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "retroinfer: retroinfer_segment (%d) and retroinfer_min_tokens (%d) "
                            "must be >= retroinfer_update (%d)",
                            p->segment, p->min_tokens, p->update);
    if (p->update < p->csize)
        return lethe_errorf(LETHE_ERR_INVALID,
                            "retroinfer: retroinfer_update (%d) must be >= "
                            "retroinfer_cluster_size (%d)",
                            p->update, p->csize);
    if (m->env.n_kv_heads > LETHE_MAX_KV_HEADS_RETRO)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "retroinfer: %d KV heads unsupported (at most %d)", m->env.n_kv_heads,
                            (int)LETHE_MAX_KV_HEADS_RETRO);
    if (m->env.head_dim > 256)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                            "retroinfer: head_dim %d unsupported (the cluster kernels take "
                            "<= 256)",
                            m->env.head_dim);
    return LETHE_OK;
}

/* host-tier bytes of `tokens` tokens: K and V, f32, every layer and KV head */
static int64_t host_bytes(const lethe_sparse_method *m, int64_t tokens) {
    return tokens * m->env.n_layers * 2 * (int64_t)m->env.n_kv_heads * m->env.head_dim *
           (int64_t)sizeof(float);
}

/* cluster-table floats per row: centroid, value sum, count */
static size_t row_floats(const lethe_sparse_method *m) { return 2u * (size_t)m->env.head_dim + 1u; }

static int32_t rows_for(const retro_priv *p, int32_t n_kv, int64_t n_slots) {
    int64_t r = (int64_t)n_kv * (n_slots / p->csize + n_slots / p->update + 1);
    return (int32_t)LETHE_MIN(r, (int64_t)INT32_MAX / 4);
}

/* Without the host tier the tables are sized by the pool (every token holds
 * a slot) and cost a share of each slot; with it, tokens outlive their slots,
 * so the tables are sized for ctx_tokens and paid from the reserve. */
static size_t retro_slot_overhead(const lethe_sparse_method *m) {
    const retro_priv *p = PRIV(m);
    if (!m->env.be || p->host_kv) return 0;
    const double per = (double)m->env.n_layers * m->env.n_kv_heads *
                       (1.0 / p->csize + 1.0 / p->update) * (double)row_floats(m) * sizeof(float);
    return (size_t)ceil(per);
}

/* host tier: the device cluster ring of every layer (K and V, cache_rows
 * head vectors of activations), taken off the KV budget */
/* host tier: the device cluster ring of every layer (K and V, cache_rows
 * head vectors of activations) and the cluster tables for ctx_tokens tokens
 * of context (retroinfer_context_tokens, or max_num_seqs x max_model_len
 * capped by what the host budget holds), taken off the KV budget. The
 * engine's last call (its final max_num_seqs) sizes the tables. */
static size_t retro_kv_reserve(lethe_sparse_method *m, int32_t max_num_seqs,
                               int32_t max_num_batched_tokens) {
    (void)max_num_batched_tokens;
    retro_priv *p = PRIV(m);
    if (!m->env.be || !p->host_kv) return 0;
    int64_t ctx = p->ctx_knob;
    if (ctx == 0) {
        const int64_t per_tok = host_bytes(m, 1);
        ctx = LETHE_MIN((int64_t)max_num_seqs * m->env.max_model_len,
                        per_tok ? p->host_budget / per_tok : 0);
    }
    p->ctx_tokens = ctx;
    const size_t ring = (size_t)m->env.n_layers * 2u * (size_t)p->cache_rows *
                        (size_t)m->env.head_dim * m->env.be->ops->act_size;
    const size_t tables = (size_t)m->env.n_layers * (size_t)rows_for(p, m->env.n_kv_heads, ctx) *
                          row_floats(m) * sizeof(float);
    return ring + tables;
}

static bool retro_layout(const lethe_sparse_method *m, int32_t layer, lethe_kv_layout *out) {
    (void)layer;
    if (!m->env.be) return false; /* the fake runner: bookkeeping only */
    const size_t b = (size_t)m->env.n_kv_heads * m->env.head_dim * m->env.be->ops->kv_size;
    *out = (lethe_kv_layout){.n_planes = 2, .planes = {{"k", b}, {"v", b}}};
    return true;
}

static void retro_store(lethe_sparse_method *m, int32_t layer, const void *k, const void *v,
                        const int32_t *slots, const int32_t *pos, int32_t n) {
    (void)pos;
    lethe_backend *be = m->env.be;
    be->ops->kv_store(be, lethe_kv_plane_buf(m->env.pool, layer, 0),
                      lethe_kv_plane_buf(m->env.pool, layer, 1), k, v, slots, n,
                      m->env.n_kv_heads * m->env.head_dim);
}

/* ---- device tables and their run allocator ---- */

static lethe_status tables_init(lethe_sparse_method *m) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    p->tables_ready = true;
    if (!be) return LETHE_OK;
    const int32_t nl = m->env.n_layers, hd = m->env.head_dim;
    p->rows_cap = rows_for(p, m->env.n_kv_heads,
                           p->host_kv && p->ctx_tokens ? p->ctx_tokens
                                                       : lethe_kv_n_slots(m->env.pool));
    p->t = lethe_xcalloc((size_t)nl, sizeof(rtables));
    const size_t R = (size_t)p->rows_cap;
    for (int32_t l = 0; l < nl; l++) {
        rtables *t = &p->t[l];
        lethe_status st = be->ops->alloc(be, R * hd * sizeof(float), &t->cent);
        if (st == LETHE_OK) st = be->ops->alloc(be, R * hd * sizeof(float), &t->vsum);
        if (st == LETHE_OK) st = be->ops->alloc(be, R * sizeof(float), &t->count);
        if (st == LETHE_OK && p->host_kv) {
            st = be->ops->alloc(be, (size_t)p->cache_rows * hd * be->ops->act_size, &t->ck);
            if (st == LETHE_OK)
                st = be->ops->alloc(be, (size_t)p->cache_rows * hd * be->ops->act_size, &t->cv);
            t->cache_at = lethe_xmalloc(R * sizeof(int64_t));
            for (size_t i = 0; i < R; i++) t->cache_at[i] = -1;
        }
        if (st != LETHE_OK) {
            char why[256];
            snprintf(why, sizeof(why), "%s", lethe_last_error());
            for (int32_t j = 0; j <= l; j++) {
                void *bufs[5] = {p->t[j].cent, p->t[j].vsum, p->t[j].count, p->t[j].ck, p->t[j].cv};
                for (int i = 0; i < 5; i++)
                    if (bufs[i]) be->ops->release(be, bufs[i]);
                free(p->t[j].free_runs), free(p->t[j].cache_at);
            }
            free(p->t);
            p->t = NULL;
            p->tables_ready = false; /* the next request tries again */
            return lethe_errorf(st, "retroinfer: cluster tables of layer %d (%d rows): %s", l,
                                p->rows_cap, why);
        }
        t->free_runs = lethe_xmalloc(sizeof(run));
        t->cap_free = 1;
        t->n_free = 1;
        t->free_runs[0] = (run){0, p->rows_cap};
    }
    return LETHE_OK;
}

/* first-fit: a run of n rows, or -1 */
static int32_t runs_alloc(rtables *t, int32_t n) {
    for (int32_t i = 0; i < t->n_free; i++)
        if (t->free_runs[i].len >= n) {
            const int32_t s = t->free_runs[i].start;
            t->free_runs[i].start += n;
            t->free_runs[i].len -= n;
            if (t->free_runs[i].len == 0) {
                memmove(t->free_runs + i, t->free_runs + i + 1,
                        (size_t)(t->n_free - i - 1) * sizeof(run));
                t->n_free--;
            }
            return s;
        }
    return -1;
}

/* returns a run, merging with its neighbours (the list stays sorted by start) */
static void runs_free(rtables *t, int32_t start, int32_t len) {
    int32_t i = 0;
    while (i < t->n_free && t->free_runs[i].start < start) i++;
    t->free_runs = grow32(t->free_runs, &t->cap_free, t->n_free + 1, sizeof(run));
    memmove(t->free_runs + i + 1, t->free_runs + i, (size_t)(t->n_free - i) * sizeof(run));
    t->free_runs[i] = (run){start, len};
    t->n_free++;
    if (i + 1 < t->n_free &&
        t->free_runs[i].start + t->free_runs[i].len == t->free_runs[i + 1].start) {
        t->free_runs[i].len += t->free_runs[i + 1].len;
        memmove(t->free_runs + i + 1, t->free_runs + i + 2,
                (size_t)(t->n_free - i - 2) * sizeof(run));
        t->n_free--;
    }
    if (i > 0 && t->free_runs[i - 1].start + t->free_runs[i - 1].len == t->free_runs[i].start) {
        t->free_runs[i - 1].len += t->free_runs[i].len;
        memmove(t->free_runs + i, t->free_runs + i + 1, (size_t)(t->n_free - i - 1) * sizeof(run));
        t->n_free--;
    }
}

/* ---- per request ---- */


static lethe_status retro_request_init(lethe_sparse_method *m, const lethe_sparse_seq *s,
                                       void **state) {
    retro_priv *p = PRIV(m);
    if (!p->tables_ready) {
        lethe_status st = tables_init(m);
        if (st != LETHE_OK) return st;
    }
    rstate *rs = lethe_xcalloc(1, sizeof(*rs));
    if (p->host_kv && m->env.be) {
        /* the prompt's K / V in host memory, asked for now */
        const int64_t b = host_bytes(m, s->n_prompt);
        if (p->host_used + b > p->host_budget) {
            free(rs);
            return lethe_errorf(LETHE_ERR_CAPACITY,
                                "retroinfer: host tier: the prompt's %d tokens need %.2f GiB, "
                                "%.2f of %.2f GiB are in use (raise retroinfer_host_gib)",
                                s->n_prompt, (double)b / (1u << 30),
                                (double)p->host_used / (1u << 30),
                                (double)p->host_budget / (1u << 30));
        }
        p->host_used += b;
        rs->host_reserved = b;
    }
    rs->L = lethe_xcalloc((size_t)m->env.n_layers, sizeof(rlayer));
    for (int32_t l = 0; l < m->env.n_layers; l++)
        rs->L[l].h = lethe_xcalloc((size_t)m->env.n_kv_heads, sizeof(rhead));
    *state = rs;
    return LETHE_OK;
}

static void retro_request_finished(lethe_sparse_method *m, void *state) {
    retro_priv *p = PRIV(m);
    rstate *rs = state;
    if (!rs) return;
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        rlayer *L = &rs->L[l];
        for (int32_t h = 0; h < m->env.n_kv_heads; h++) {
            rhead *H = &L->h[h];
            for (int32_t r = 0; r < H->n_runs; r++) {
                const int32_t s0 = H->runs[2 * r], n = H->runs[2 * r + 1];
                if (p->t[l].cache_at)
                    for (int32_t i = 0; i < n; i++) p->t[l].cache_at[s0 + i] = -1;
                runs_free(&p->t[l], s0, n);
            }
            free(H->row), free(H->host_at), free(H->mbeg), free(H->mem), free(H->runs);
        }
        free(L->h), free(L->hk), free(L->hv);
    }
    p->host_used -= rs->host_reserved;
    free(rs->L);
    free(rs);
}

/* ---- the index: k-means over one segment ---- */

/* K / V of `n` slots of `layer` into host f32 [n, kv_dim] (both backends:
 * kv elements are activations there) */
static void read_rows(lethe_sparse_method *m, int32_t layer, const int32_t *slots, int32_t n,
                      float *k, float *v) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    const int32_t kd = m->env.n_kv_heads * m->env.head_dim;
    lethe_status st = lethe_dev_buf_reserve(m, &p->rows_buf, (size_t)n * kd * be->ops->act_size);
    LETHE_ASSERT(st == LETHE_OK); /* one segment's rows */
    be->ops->gather_rows(be, p->rows_buf.p, lethe_kv_plane_buf(m->env.pool, layer, 0), slots, n,
                         kd);
    be->ops->act_to_host(be, k, p->rows_buf.p, (size_t)n * kd);
    be->ops->gather_rows(be, p->rows_buf.p, lethe_kv_plane_buf(m->env.pool, layer, 1), slots, n,
                         kd);
    be->ops->act_to_host(be, v, p->rows_buf.p, (size_t)n * kd);
}

static void normalize(float *c, int32_t d) {
    double s = 0;
    for (int32_t i = 0; i < d; i++) s += (double)c[i] * c[i];
    if (s <= 0) return;
    const float inv = (float)(1.0 / sqrt(s));
    for (int32_t i = 0; i < d; i++) c[i] *= inv;
}

/* Clusters row entries [e0, e1) of `layer` into the request's index (all
 * heads); false when the tables have no room (the segment stays exact). */
static bool cluster_segment(lethe_sparse_method *m, rstate *rs, int32_t layer,
                            const int32_t *row_slots, int32_t e0, int32_t e1, bool to_host) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    const int32_t KH = m->env.n_kv_heads, hd = m->env.head_dim, kd = KH * hd, n = e1 - e0;
    const int32_t nc = LETHE_CEIL_DIV(n, p->csize);
    rtables *t = &p->t[layer];
    if ((size_t)n > p->cap_seg) {
        p->cap_seg = (size_t)n;
        p->sk = lethe_xrealloc(p->sk, p->cap_seg * kd * sizeof(float));
        p->sv = lethe_xrealloc(p->sv, p->cap_seg * kd * sizeof(float));
        p->assign = lethe_xrealloc(p->assign, p->cap_seg * KH * sizeof(int32_t));
        p->order = lethe_xrealloc(p->order, p->cap_seg * sizeof(int32_t));
    }
    if ((size_t)nc > p->cap_cent) {
        p->cap_cent = (size_t)nc;
        p->cent = lethe_xrealloc(p->cent, p->cap_cent * kd * sizeof(float));
        p->tmp = lethe_xrealloc(p->tmp, p->cap_cent * (2 * (size_t)hd + 1) * sizeof(float));
        p->cntbuf = lethe_xrealloc(p->cntbuf, p->cap_cent * sizeof(int32_t));
    }
    p->mean = lethe_xrealloc(p->mean, (size_t)kd * sizeof(float));
    const int32_t *slots = row_slots + phys_of(rs, p->sink, e0);
    read_rows(m, layer, slots, n, p->sk, p->sv);
    /* centre per head, strided initial centroids */
    for (int32_t h = 0; h < KH; h++) {
        double acc[256] = {0};
        for (int32_t e = 0; e < n; e++)
            for (int32_t i = 0; i < hd; i++) acc[i] += p->sk[(size_t)e * kd + (size_t)h * hd + i];
        for (int32_t i = 0; i < hd; i++) p->mean[(size_t)h * hd + i] = (float)(acc[i] / n);
        for (int32_t c = 0; c < nc; c++) {
            const int32_t e = (int32_t)(((int64_t)c * n) / nc);
            float *cc = p->cent + ((size_t)h * nc + c) * hd;
            for (int32_t i = 0; i < hd; i++)
                cc[i] = p->sk[(size_t)e * kd + (size_t)h * hd + i] - p->mean[(size_t)h * hd + i];
            normalize(cc, hd);
        }
    }
    float *sum = p->tmp; /* [nc, hd] centred sums during the rounds */
    int32_t *cnt = p->cntbuf;
    for (int32_t it = 0; it <= p->iters; it++) {
        be->ops->cluster_assign(be, p->assign, lethe_kv_plane_buf(m->env.pool, layer, 0), slots, n,
                                p->cent, p->mean, nc, KH, hd);
        if (it == p->iters) break; /* the final assignment */
        for (int32_t h = 0; h < KH; h++) {
            memset(sum, 0, (size_t)nc * hd * sizeof(float));
            memset(cnt, 0, (size_t)nc * sizeof(int32_t));
            for (int32_t e = 0; e < n; e++) {
                const int32_t c = p->assign[(size_t)h * n + e];
                const float *k = p->sk + (size_t)e * kd + (size_t)h * hd,
                            *mu = p->mean + (size_t)h * hd;
                for (int32_t i = 0; i < hd; i++) sum[(size_t)c * hd + i] += k[i] - mu[i];
                cnt[c]++;
            }
            for (int32_t c = 0; c < nc; c++) {
                if (!cnt[c]) continue; /* empty: keeps its centroid */
                float *cc = p->cent + ((size_t)h * nc + c) * hd;
                memcpy(cc, sum + (size_t)c * hd, (size_t)hd * sizeof(float));
                normalize(cc, hd);
            }
        }
    }
    /* table rows for every head's non-empty clusters first: all heads or none */
    int32_t starts[LETHE_MAX_KV_HEADS_RETRO], n_nes[LETHE_MAX_KV_HEADS_RETRO];
    LETHE_ASSERT(KH <= LETHE_MAX_KV_HEADS_RETRO);
    for (int32_t h = 0; h < KH; h++) {
        memset(cnt, 0, (size_t)nc * sizeof(int32_t));
        for (int32_t e = 0; e < n; e++) cnt[p->assign[(size_t)h * n + e]]++;
        n_nes[h] = 0;
        for (int32_t c = 0; c < nc; c++) n_nes[h] += cnt[c] > 0;
        starts[h] = runs_alloc(t, n_nes[h]);
        if (starts[h] < 0) {
            for (int32_t j = 0; j < h; j++) runs_free(t, starts[j], n_nes[j]);
            if (!p->warned_rows)
                LOG_WARN("retroinfer: cluster tables full (%d rows per layer); later segments stay "
                         "exact",
                         p->rows_cap);
            p->warned_rows = true;
            return false; /* the segment's entries stay in the exact tail */
        }
    }
    /* per head: reverse lists, the table rows, the host copy */
    for (int32_t h = 0; h < KH; h++) {
        rhead *H = &rs->L[layer].h[h];
        memset(cnt, 0, (size_t)nc * sizeof(int32_t));
        for (int32_t e = 0; e < n; e++) cnt[p->assign[(size_t)h * n + e]]++;
        const int32_t n_ne = n_nes[h], start = starts[h];
        H->runs = grow32(H->runs, &H->cap_runs, 2 * (H->n_runs + 1), sizeof(int32_t));
        H->runs[2 * H->n_runs] = start, H->runs[2 * H->n_runs + 1] = n_ne;
        H->n_runs++;
        /* members by cluster, ascending entries inside each (counting sort) */
        int32_t *off = lethe_xmalloc((size_t)(nc + 1) * sizeof(int32_t));
        off[0] = 0;
        for (int32_t c = 0; c < nc; c++) off[c + 1] = off[c] + cnt[c];
        for (int32_t e = 0; e < n; e++) p->order[off[p->assign[(size_t)h * n + e]]++] = e;
        for (int32_t c = nc; c > 0; c--) off[c] = off[c - 1];
        off[0] = 0;
        float *cen = p->tmp, *vs = p->tmp + (size_t)n_ne * hd, *ct = p->tmp + 2 * (size_t)n_ne * hd;
        H->row = grow32(H->row, &H->cap_cl, H->n_cl + n_ne, sizeof(int32_t));
        H->host_at = lethe_xrealloc(H->host_at, (size_t)H->cap_cl * sizeof(int64_t));
        H->mbeg = lethe_xrealloc(H->mbeg, (size_t)(H->cap_cl + 1) * sizeof(int32_t));
        H->mem = grow32(H->mem, &H->cap_mem, H->n_mem + n, sizeof(int32_t));
        if (H->n_cl == 0) H->mbeg[0] = 0;
        rlayer *RL = &rs->L[layer];
        if (to_host) {
            RL->hk = grow64(RL->hk, &RL->cap_host, RL->n_host + n, (size_t)hd * sizeof(float));
            int64_t cap2 = RL->cap_host;
            (void)cap2;
            RL->hv = lethe_xrealloc(RL->hv, (size_t)RL->cap_host * hd * sizeof(float));
        }
        int32_t j = 0;
        for (int32_t c = 0; c < nc; c++) {
            if (!cnt[c]) continue;
            double ak[256] = {0}, av[256] = {0};
            for (int32_t u = off[c]; u < off[c] + cnt[c]; u++) {
                const int32_t e = p->order[u];
                const float *k = p->sk + (size_t)e * kd + (size_t)h * hd,
                            *v = p->sv + (size_t)e * kd + (size_t)h * hd;
                for (int32_t i = 0; i < hd; i++) ak[i] += k[i], av[i] += v[i];
                H->mem[H->n_mem++] = e0 + e;
                if (to_host) {
                    memcpy(RL->hk + (size_t)RL->n_host * hd, k, (size_t)hd * sizeof(float));
                    memcpy(RL->hv + (size_t)RL->n_host * hd, v, (size_t)hd * sizeof(float));
                    RL->n_host++;
                }
            }
            for (int32_t i = 0; i < hd; i++) {
                cen[(size_t)j * hd + i] = (float)(ak[i] / cnt[c]);
                vs[(size_t)j * hd + i] = (float)av[i];
            }
            ct[j] = (float)cnt[c];
            H->row[H->n_cl] = start + j;
            H->host_at[H->n_cl] = to_host ? RL->n_host - cnt[c] : -1;
            H->mbeg[H->n_cl + 1] = H->n_mem;
            H->n_cl++;
            j++;
        }
        free(off);
        const size_t rb = (size_t)hd * sizeof(float);
        be->ops->copy_from_host(be, (char *)t->cent + (size_t)start * rb, cen, (size_t)n_ne * rb);
        be->ops->copy_from_host(be, (char *)t->vsum + (size_t)start * rb, vs, (size_t)n_ne * rb);
        be->ops->copy_from_host(be, (char *)t->count + (size_t)start * sizeof(float), ct,
                                (size_t)n_ne * sizeof(float));
    }
    /* the host store covers [sink, host_end) without a gap: what may be offloaded */
    rlayer *RL = &rs->L[layer];
    if (to_host && (RL->host_end == 0 ? e0 == p->sink : RL->host_end == e0)) RL->host_end = e1;
    p->n_built++;
    return true;
}

/* builds (at the end of the prompt) or extends the index of one request in every layer */
static void index_update(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    retro_priv *p = PRIV(m);
    rstate *rs = q->state;
    const int32_t L = lethe_sparse_row_len(m, 0, q->row) + rs->n_drop; /* logical */
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, lethe_kv_space_of(m->env.pool, 0),
                                              q->row);
    const int32_t lim = L - p->recent; /* entries < lim may be clustered */
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        rlayer *RL = &rs->L[l];
        if (RL->end == 0) {
            if ((!q->is_prefill || q->is_final_chunk) && lim - p->sink >= p->min_tokens) {
                const int32_t n = lim - p->sink, n_seg = LETHE_MAX(1, n / p->segment);
                const bool host =
                    p->host_kv; /* the prompt's bytes were reserved at admission (a longer
                                               * context than the prompt is within ~update of it) */
                RL->end = p->sink;
                for (int32_t g = 0; g < n_seg; g++) {
                    const int32_t a = p->sink + (int32_t)(((int64_t)n * g) / n_seg);
                    const int32_t b = p->sink + (int32_t)(((int64_t)n * (g + 1)) / n_seg);
                    if (!cluster_segment(m, rs, l, slots, a, b, host)) break;
                    RL->end = b;
                }
                if (RL->end == p->sink) RL->end = 0;
            }
            continue;
        }
        while (!q->is_prefill && lim - RL->end >= p->update) {
            bool host = p->host_kv;
            if (host) { /* an extension asks for its host bytes (per layer) */
                const int64_t b = host_bytes(m, p->update) / m->env.n_layers;
                if (p->host_used + b > p->host_budget) {
                    if (!p->warned_host)
                        LOG_WARN("retroinfer: host tier budget (retroinfer_host_gib) spent: new "
                                 "segments stay on "
                                 "the device path");
                    p->warned_host = true;
                    host = false;
                } else {
                    p->host_used += b;
                    rs->host_reserved += b;
                }
            }
            if (!cluster_segment(m, rs, l, slots, RL->end, RL->end + p->update, host)) break;
            RL->end += p->update;
        }
    }
}

/* Host tier: drops the entries every layer holds in its host store from the
 * shared row ([sink, min over layers of host_end)), freeing their slots. */
static void offload(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    retro_priv *p = PRIV(m);
    rstate *rs = q->state;
    if (!p->host_kv || rs->no_drop || p->retrieve >= 1.0) return;
    int32_t to = INT32_MAX;
    for (int32_t l = 0; l < m->env.n_layers; l++) to = LETHE_MIN(to, rs->L[l].host_end);
    if (to <= p->sink + rs->n_drop) return; /* nothing new (or some layer has no host copy) */
    lethe_kv_pool *pool = m->env.pool;
    const int32_t *prot = NULL;
    if (lethe_kv_row_protected(pool, q->row, &prot) > 0) {
        /* pinned positions must stay in the row (kv_pool.h): keep this request whole */
        if (!rs->no_drop)
            LOG_WARN("retroinfer: request %llu has retention pins: its KV stays in the pool",
                     (unsigned long long)q->request_id);
        rs->no_drop = true;
        return;
    }
    const int32_t len = lethe_kv_row_len(pool, lethe_kv_space_of(pool, 0), q->row);
    const int32_t cut = phys_of(rs, p->sink, to); /* first row index kept after the sink */
    LETHE_ASSERT(cut > p->sink && cut <= len);
    int32_t *keep = lethe_xmalloc((size_t)len * sizeof(int32_t)), n = 0;
    for (int32_t i = 0; i < p->sink; i++) keep[n++] = i;
    for (int32_t i = cut; i < len; i++) keep[n++] = i;
    lethe_kv_keep(pool, 0, q->row, keep, n); /* shared rows: every layer's row */
    free(keep);
    p->n_offloaded += cut - p->sink;
    rs->n_drop = to - p->sink;
}

static void retro_finish_step(lethe_sparse_method *m, const lethe_sparse_step *st) {
    if (!m->env.be) return;
    for (int32_t s = 0; s < st->n_seqs; s++) {
        const lethe_sparse_seq *q = &st->seqs[s];
        if (!q->state || q->is_aux) continue;
        index_update(m, q);
        offload(m, q);
    }
}

/* ---- decode ---- */

static void retro_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    retro_priv *p = PRIV(m);
    p->st = st;
    p->mode = grow32(p->mode, &p->cap_mode, st->n_seqs, sizeof(int32_t));
    memset(p->mode, 0, (size_t)st->n_seqs * sizeof(int32_t));
}

/* three-zone decode for sequence q in `layer`? */
static bool zoned(const retro_priv *p, const lethe_sparse_seq *q, int32_t layer) {
    const rstate *rs = q->state;
    return rs && !q->is_prefill && q->n_new == 1 && rs->L[layer].end > 0 && p->retrieve < 1.0;
}

static int32_t retro_decode_selection(lethe_sparse_method *m, int32_t layer,
                                      const lethe_sparse_step *st, int32_t seq, const void *q,
                                      int32_t *sel, int32_t cap) {
    retro_priv *p = PRIV(m);
    const lethe_sparse_seq *s = &st->seqs[seq];
    p->st = st;
    if (seq < p->cap_mode) p->mode[seq] = 0;
    if (!m->env.be || !q || !zoned(p, s, layer) || seq >= p->cap_mode) {
        /* an offloading request always decodes through the zones */
        LETHE_ASSERT(!s->state || ((const rstate *)s->state)->n_drop == 0);
        return lethe_sparse_select_all(m, layer, s->row, sel, cap);
    }
    /* the resident exact zone: sink and the tail (new token last); row indices */
    const rstate *rs = s->state;
    const int32_t L = lethe_sparse_row_len(m, layer, s->row);
    const int32_t end = phys_of(rs, p->sink, rs->L[layer].end);
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, lethe_kv_space_of(m->env.pool, layer),
                                              s->row);
    int32_t n = 0;
    for (int32_t e = 0; e < p->sink && e < L; e++) sel[n++] = slots[e];
    for (int32_t e = end; e < L; e++) sel[n++] = slots[e];
    LETHE_ASSERT(n <= cap);
    p->mode[seq] = 1;
    return n;
}

/* Host tier: places the clusters (table rows) of one pass in the ring; hat:
 * host store offsets (-1: no host copy), n_of: sizes; out: ring row of each,
 * or -1 (no host copy, or no room). When the misses fit the ring, earlier
 * fetches still in it are hits and the misses go to one contiguous run after
 * them (all of them in one transfer per K / V). When they do not (one
 * sequence retrieving more than cache_rows head vectors), the ring restarts
 * and takes the clusters in the given order (best first) while they fit. */
static void ring_place(lethe_sparse_method *m, int32_t layer, int32_t n_cl, const int32_t *rows,
                       const int64_t *hat, const int32_t *n_of, const rlayer *const *rl,
                       int32_t *out) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    rtables *t = &p->t[layer];
    const int64_t R = p->cache_rows;
    const int32_t hd = m->env.head_dim;
    /* misses need the ring end to move: iterate until the hits stay valid */
    int64_t miss = 0, total = t->ring_total;
    bool settled = false;
    for (int32_t pass = 0; pass < 4 && !settled; pass++) {
        miss = 0;
        for (int32_t i = 0; i < n_cl; i++) {
            const int64_t at = t->cache_at[rows[i]];
            const bool hit = at >= 0 && at >= total - R && at + n_of[i] <= t->ring_total;
            if (!hit && hat[i] >= 0) miss += n_of[i];
        }
        int64_t nt = t->ring_total;
        if (miss > 0 && miss <= R) {
            if (nt % R + miss > R) nt += R - nt % R; /* contiguous: skip the ring's tail */
            nt += miss;
        }
        settled = nt == total;
        total = nt;
    }
    const bool restart = miss > R || !settled; /* unsettled: the hits are not known valid */
    int64_t base = total - miss; /* where this pass's misses go (absolute) */
    if (restart) {               /* a fresh ring: no hits, best clusters first */
        base = t->ring_total + (t->ring_total % R ? R - t->ring_total % R : 0);
        miss = R;
    }
    p->stage_k = grow64(p->stage_k, &p->cap_stage, miss * hd, sizeof(float));
    int64_t cap2 = p->cap_stage;
    p->stage_v = lethe_xrealloc(p->stage_v, (size_t)cap2 * sizeof(float));
    int64_t put = 0;
    for (int32_t i = 0; i < n_cl; i++) {
        int64_t at = t->cache_at[rows[i]];
        const bool hit = !restart && at >= 0 && at >= total - R && at + n_of[i] <= t->ring_total;
        if (hit) {
            p->n_hits++;
            out[i] = (int32_t)(at % R);
        } else if (hat[i] >= 0 && put + n_of[i] <= miss) {
            memcpy(p->stage_k + put * hd, rl[i]->hk + hat[i] * hd,
                   (size_t)n_of[i] * hd * sizeof(float));
            memcpy(p->stage_v + put * hd, rl[i]->hv + hat[i] * hd,
                   (size_t)n_of[i] * hd * sizeof(float));
            at = base + put;
            t->cache_at[rows[i]] = at;
            out[i] = (int32_t)(at % R);
            put += n_of[i];
            p->n_misses++;
        } else {
            out[i] = -1;
        }
    }
    LETHE_ASSERT(put <= miss);
    if (put) {
        const size_t off = (size_t)(base % R) * hd * be->ops->act_size;
        be->ops->act_from_host(be, (char *)t->ck + off, p->stage_k, (size_t)put * hd);
        be->ops->act_from_host(be, (char *)t->cv + off, p->stage_v, (size_t)put * hd);
        p->bytes_fetched += 2 * put * hd * (int64_t)be->ops->act_size;
    }
    t->ring_total = restart ? base + put : total;
}

/* clusters by score, best first (ties: the lower index) */
typedef struct ranked {
    float s;
    int32_t c;
} ranked;
static inline bool better(const ranked *x, const ranked *y) {
    return x->s > y->s || (x->s == y->s && x->c < y->c);
}
static int cmp_ranked(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    return better(x, y) ? -1 : better(y, x) ? 1 : 0;
}

/* Rearranges a[lo, hi) so that a[lo, k) holds its k - lo best entries (in
 * no particular order): quickselect over the total order `better` (scores,
 * then the lower index), O(n) on average, deterministic. */
static void select_best(ranked *a, int32_t lo, int32_t hi, int32_t k) {
    while (hi - lo > 1 && k > lo && k < hi) {
        const int32_t mid = lo + (hi - lo) / 2;
        const ranked *x = &a[lo], *y = &a[mid],
                     *z = &a[hi - 1]; /* median of three: better than one other */
        const ranked piv = better(x, y) != better(x, z)   ? *x
                           : better(y, x) != better(y, z) ? *y
                                                          : *z;
        int32_t i = lo, j = hi - 1;
        while (i <= j) {
            while (better(&a[i], &piv)) i++;
            while (better(&piv, &a[j])) j--;
            if (i <= j) {
                const ranked t = a[i];
                a[i++] = a[j], a[j--] = t;
            }
        }
        if (k <= j + 1) hi = j + 1;
        else if (k >= i) lo = i;
        else return; /* [j + 1, i) equal the pivot: the split falls inside */
    }
}

/* the zoned sequences of the step in order: their step index and state */
static const lethe_sparse_seq *zoned_seq(const retro_priv *p, int32_t *s) {
    const lethe_sparse_step *st = p->st;
    while (*s < st->n_seqs && *s < p->cap_mode && !p->mode[*s]) (*s)++;
    return *s < st->n_seqs && *s < p->cap_mode ? &st->seqs[*s] : NULL;
}

/* One cluster_attention call over zoned queries [i0, i1) (rankings rk_*):
 * exact lists (sink, retrieved members from the pool or the ring, tail) and
 * estimated rows; with the host tier the pass's retrieved clusters are
 * placed in the ring first (a cluster that did not fit is read from the
 * pool, or estimated when it was offloaded). */
static void attend_pass(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a,
                        int32_t i0, int32_t i1, int32_t s0) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    const int32_t KH = m->env.n_kv_heads, sp = lethe_kv_space_of(m->env.pool, layer);
    rtables *t = &p->t[layer];
    /* host tier: every retrieved cluster of the pass, then one ring placement */
    int32_t n_fetch = 0;
    int32_t *f_rows = NULL, *f_n = NULL, *f_out = NULL;
    int64_t *f_hat = NULL;
    const rlayer **f_rl = NULL;
    if (p->host_kv) {
        int32_t nf = 0;
        for (int32_t o = i0 * KH; o < i1 * KH; o++) nf += p->rk_nret[o];
        const size_t cap = (size_t)LETHE_MAX(nf, 1);
        f_rows = lethe_xmalloc(cap * sizeof(int32_t)), f_n = lethe_xmalloc(cap * sizeof(int32_t));
        f_out = lethe_xmalloc(cap * sizeof(int32_t)), f_hat = lethe_xmalloc(cap * sizeof(int64_t));
        f_rl = lethe_xmalloc(cap * sizeof(*f_rl));
        int32_t s = s0;
        for (int32_t i = i0; i < i1; i++, s++) {
            const lethe_sparse_seq *q = zoned_seq(p, &s);
            const rlayer *RL = &((const rstate *)q->state)->L[layer];
            for (int32_t h = 0; h < KH; h++) {
                const rhead *H = &RL->h[h];
                const int32_t o = i * KH + h;
                for (int32_t r = 0; r < p->rk_nret[o]; r++) {
                    const int32_t c = p->rk_c[p->rk_beg[o] + r];
                    f_rows[n_fetch] = H->row[c];
                    f_n[n_fetch] = H->mbeg[c + 1] - H->mbeg[c];
                    f_hat[n_fetch] = H->host_at[c];
                    f_rl[n_fetch] = RL;
                    n_fetch++;
                }
            }
        }
        if (n_fetch) ring_place(m, layer, n_fetch, f_rows, f_hat, f_n, f_rl, f_out);
    }
    /* the lists, per (query, head) of the pass */
    int64_t nx = 0, ne = 0;
    int32_t fi = 0, s = s0;
    for (int32_t i = i0; i < i1; i++, s++) {
        const lethe_sparse_seq *q = zoned_seq(p, &s);
        const rstate *rs = q->state;
        const rlayer *RL = &rs->L[layer];
        const int32_t L = lethe_kv_row_len(m->env.pool, sp, q->row);
        const int32_t *slots = lethe_kv_row_slots(m->env.pool, sp, q->row);
        const int32_t end = phys_of(rs, p->sink, RL->end), off_end = p->sink + rs->n_drop;
        for (int32_t h = 0; h < KH; h++) {
            const rhead *H = &RL->h[h];
            const int32_t o = i * KH + h, b0 = p->rk_beg[o], nret = p->rk_nret[o];
            const int32_t nall = p->rk_beg[o + 1] - b0, oo = o - i0 * KH;
            int64_t need_x = nx + LETHE_MIN(p->sink, L) + (L - end);
            for (int32_t r = 0; r < nret; r++)
                need_x += H->mbeg[p->rk_c[b0 + r] + 1] - H->mbeg[p->rk_c[b0 + r]];
            p->xs = grow64(p->xs, &p->cap_x, need_x, sizeof(int32_t));
            p->eids = grow64(p->eids, &p->cap_e, ne + nall, sizeof(int32_t));
            p->xbeg[oo] = (int32_t)nx;
            p->ebeg[oo] = (int32_t)ne;
            for (int32_t e = 0; e < p->sink && e < L; e++) p->xs[nx++] = slots[e];
            for (int32_t r = 0; r < nret; r++) {
                const int32_t c = p->rk_c[b0 + r], mb = H->mbeg[c], cnt = H->mbeg[c + 1] - mb;
                const int32_t ring = p->host_kv ? f_out[fi++] : -1;
                if (ring >= 0) {
                    for (int32_t u = 0; u < cnt; u++) p->xs[nx++] = -1 - (ring + u);
                } else if (H->mem[mb] >= off_end) { /* resident: the pool */
                    for (int32_t u = 0; u < cnt; u++) p->xs[nx++] = slots[H->mem[mb + u] - rs->n_drop];
                    if (p->host_kv && H->host_at[c] >= 0) p->n_pool_reads++;
                } else { /* offloaded and no ring room: estimated */
                    p->eids[ne++] = H->row[c];
                    p->n_demoted++;
                    if (!p->warned_ring)
                        LOG_WARN("retroinfer: one request's retrieved clusters exceed the cluster "
                                 "cache (%d head vectors per layer): the rest are estimated; "
                                 "raise retroinfer_cache_rows",
                                 p->cache_rows);
                    p->warned_ring = true;
                }
            }
            for (int32_t e = end; e < L; e++) p->xs[nx++] = slots[e];
            for (int32_t r = nret; r < nall; r++) p->eids[ne++] = H->row[p->rk_c[b0 + r]];
        }
    }
    LETHE_ASSERT(!p->host_kv || fi == n_fetch);
    free(f_rows), free(f_n), free(f_out), free(f_hat), free(f_rl);
    const int32_t nq = i1 - i0;
    p->xbeg[nq * KH] = (int32_t)nx;
    p->ebeg[nq * KH] = (int32_t)ne;
    /* the three zones under one softmax, over the pass's rows of out */
    lethe_cluster_attn_args ca = {.out = a->out,
                                  .q = a->q,
                                  .k_cache = a->k_cache,
                                  .v_cache = a->v_cache,
                                  .k_aux = p->host_kv ? t->ck : NULL,
                                  .v_aux = p->host_kv ? t->cv : NULL,
                                  .cent = t->cent,
                                  .vsum = t->vsum,
                                  .count = t->count,
                                  .n_q = nq,
                                  .q_rows = p->q_rows + i0,
                                  .x_begin = p->xbeg,
                                  .x_slots = p->xs,
                                  .e_begin = p->ebeg,
                                  .e_ids = p->eids,
                                  .n_heads = m->env.n_heads,
                                  .n_kv_heads = KH,
                                  .head_dim = m->env.head_dim,
                                  .scale = a->scale};
    be->ops->cluster_attention(be, &ca);
}

static void retro_attend(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a) {
    retro_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    be->ops->attention(be, a); /* every row; a zoned row's selection is its resident zone */
    const lethe_sparse_step *st = p->st;
    if (!st || st->n_seqs != a->n_seqs) return;
    const int32_t KH = m->env.n_kv_heads;
    int32_t n_q = 0;
    int64_t n_s = 0;
    for (int32_t s = 0; s < st->n_seqs && s < p->cap_mode; s++) {
        if (!p->mode[s]) continue;
        const rstate *rs = st->seqs[s].state;
        n_q++;
        for (int32_t h = 0; h < KH; h++) n_s += rs->L[layer].h[h].n_cl;
    }
    if (n_q == 0) return;
    /* 1. centroid scores of every zoned (query, KV head) */
    p->q_rows = grow64(p->q_rows, &p->cap_q, n_q, sizeof(int32_t));
    int64_t cq = p->cap_q;
    p->sbeg = lethe_xrealloc(p->sbeg, (size_t)(cq * KH + 1) * sizeof(int32_t));
    p->xbeg = lethe_xrealloc(p->xbeg, (size_t)(cq * KH + 1) * sizeof(int32_t));
    p->ebeg = lethe_xrealloc(p->ebeg, (size_t)(cq * KH + 1) * sizeof(int32_t));
    p->sids = grow64(p->sids, &p->cap_s, n_s, sizeof(int32_t));
    int64_t cs = p->cap_s;
    p->sc = lethe_xrealloc(p->sc, (size_t)cs * sizeof(float));
    int32_t i = 0, ns = 0;
    for (int32_t s = 0; s < st->n_seqs && s < p->cap_mode; s++) {
        if (!p->mode[s]) continue;
        const lethe_sparse_seq *q = &st->seqs[s];
        const rstate *rs = q->state;
        p->q_rows[i] = q->q_row;
        for (int32_t h = 0; h < KH; h++) {
            const rhead *H = &rs->L[layer].h[h];
            p->sbeg[i * KH + h] = ns;
            memcpy(p->sids + ns, H->row, (size_t)H->n_cl * sizeof(int32_t));
            ns += H->n_cl;
        }
        i++;
    }
    p->sbeg[n_q * KH] = ns;
    rtables *t = &p->t[layer];
    be->ops->cluster_scores(be, p->sc, a->q, t->cent, n_q, p->q_rows, p->sbeg, p->sids,
                            m->env.n_heads, KH, m->env.head_dim, a->scale);
    /* 2. rank per (query, head): the retrieved clusters best first, then the estimated ones */
    p->rk_beg = grow64(p->rk_beg, &p->cap_rkb, (int64_t)n_q * KH + 1, sizeof(int32_t));
    int64_t crb = p->cap_rkb;
    p->rk_nret = lethe_xrealloc(p->rk_nret, (size_t)crb * sizeof(int32_t));
    int64_t nr = 0;
    i = 0;
    for (int32_t s = 0; s < st->n_seqs && s < p->cap_mode; s++) {
        if (!p->mode[s]) continue;
        const rstate *rs = st->seqs[s].state;
        for (int32_t h = 0; h < KH; h++) {
            const rhead *H = &rs->L[layer].h[h];
            const int32_t o = i * KH + h, ncl = H->n_cl;
            const int32_t n_ret = LETHE_MIN(ncl, (int32_t)ceil(p->retrieve * ncl - 1e-9));
            const int32_t n_est = LETHE_MIN(ncl - n_ret, (int32_t)floor(p->estimate * ncl + 1e-9));
            p->tops = grow32(p->tops, &p->cap_tops, ncl, sizeof(ranked));
            ranked *rk = p->tops;
            for (int32_t c = 0; c < ncl; c++) rk[c] = (ranked){p->sc[p->sbeg[o] + c], c};
            /* the retrieved (best first) and the estimated (any order) tiers only: O(n) */
            select_best(rk, 0, ncl, n_ret + n_est);
            select_best(rk, 0, n_ret + n_est, n_ret);
            qsort(rk, (size_t)n_ret, sizeof(ranked), cmp_ranked);
            p->rk_c = grow64(p->rk_c, &p->cap_rk, nr + n_ret + n_est, sizeof(int32_t));
            p->rk_beg[o] = (int32_t)nr;
            p->rk_nret[o] = n_ret;
            for (int32_t r = 0; r < n_ret + n_est; r++) p->rk_c[nr++] = rk[r].c;
        }
        i++;
    }
    p->rk_beg[n_q * KH] = (int32_t)nr;
    /* 3. passes: consecutive queries whose retrieved host-tier clusters fit the
     * ring together (all of them at once without the tier) */
    int32_t i0 = 0, s0 = 0, s = 0;
    int64_t need = 0;
    for (i = 0; i < n_q; i++, s++) {
        const lethe_sparse_seq *q = zoned_seq(p, &s);
        int64_t ni = 0;
        if (p->host_kv) {
            const rlayer *RL = &((const rstate *)q->state)->L[layer];
            for (int32_t h = 0; h < KH; h++)
                for (int32_t r = 0; r < p->rk_nret[i * KH + h]; r++) {
                    const int32_t c = p->rk_c[p->rk_beg[i * KH + h] + r];
                    if (RL->h[h].host_at[c] >= 0) ni += RL->h[h].mbeg[c + 1] - RL->h[h].mbeg[c];
                }
        }
        if (i > i0 && need + ni > p->cache_rows) {
            attend_pass(m, layer, a, i0, i, s0);
            i0 = i, s0 = s, need = 0;
        }
        need += ni;
    }
    attend_pass(m, layer, a, i0, n_q, s0);
}

const lethe_sparse_ops lethe_sparse_retroinfer = {
    .name = "retroinfer",
    .aliases = {"retro_infer", NULL},
    .summary = "k-means key clusters per KV head: decode reads the best clusters exactly, "
               "estimates the next tier "
               "from value sums; optional host-memory tier",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .knob_table = knobs,
    .n_knob_table = (int32_t)LETHE_ARRAY_LEN(knobs),
    /* identity: the index is built and extended (tiny segments), every cluster retrieved */
    .test_configs =
        {.identity = "retroinfer_sink=2,retroinfer_recent=4,retroinfer_cluster_size=4,retroinfer_"
                     "segment=16,"
                     "retroinfer_update=8,retroinfer_min_tokens=16,retroinfer_retrieve=1",
         .small = "retroinfer_sink=2,retroinfer_recent=4,retroinfer_cluster_size=4,retroinfer_"
                  "segment=16,"
                  "retroinfer_update=8,retroinfer_min_tokens=16,retroinfer_retrieve=0.25,"
                  "retroinfer_estimate=0.25"},
    .flags = LETHE_SPARSE_OFFLOADS,
    .slot_overhead_bytes = retro_slot_overhead,
    .kv_reserve_bytes = retro_kv_reserve,
    .kv_layout = retro_layout,
    .kv_store = retro_store,
    .kv_attend = retro_attend,
    .init = retro_init,
    .configure = retro_configure,
    .destroy = retro_destroy,
    .set_knob = retro_set_knob,
    .request_init = retro_request_init,
    .request_finished = retro_request_finished,
    .prepare = retro_prepare,
    .finish_step = retro_finish_step,
    .build_decode_selection = retro_decode_selection,
};

/* ---- a read-only view (retroinfer.h) ---- */

bool lethe_retroinfer_view(const lethe_sparse_method *m, const void *state, int32_t layer,
                           int32_t head, lethe_retro_head_view *out) {
    if (!m || m->ops != &lethe_sparse_retroinfer || !state) return false;
    LETHE_ASSERT(layer >= 0 && layer < m->env.n_layers && head >= 0 && head < m->env.n_kv_heads);
    const rstate *rs = state;
    const rhead *H = &rs->L[layer].h[head];
    static const int32_t zero = 0;
    *out = (lethe_retro_head_view){.end = rs->L[layer].end,
                                   .n_offloaded = rs->n_drop,
                                   .n_clusters = H->n_cl,
                                   .mbeg = H->n_cl ? H->mbeg : &zero,
                                   .members = H->mem,
                                   .rows = H->row,
                                   .host_at = H->host_at};
    return true;
}

bool lethe_retroinfer_table_row(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                float *cent, float *vsum, float *count) {
    const retro_priv *p = PRIV(m);
    if (m->ops != &lethe_sparse_retroinfer || !p->t ||
        !lethe_backend_has(m->env.be, LETHE_BE_HOST_MEMORY))
        return false;
    const int32_t hd = m->env.head_dim;
    memcpy(cent, (const float *)p->t[layer].cent + (size_t)row * hd, (size_t)hd * sizeof(float));
    memcpy(vsum, (const float *)p->t[layer].vsum + (size_t)row * hd, (size_t)hd * sizeof(float));
    *count = ((const float *)p->t[layer].count)[row];
    return true;
}

void lethe_retroinfer_counters(const lethe_sparse_method *m, lethe_retro_counters *out) {
    const retro_priv *p = PRIV(m);
    *out = (lethe_retro_counters){.hits = p->n_hits,
                                  .misses = p->n_misses,
                                  .pool_reads = p->n_pool_reads,
                                  .demoted = p->n_demoted,
                                  .offloaded = p->n_offloaded,
                                  .bytes_fetched = p->bytes_fetched};
}
