/* deltakv.c - DeltaKV (methods.md §13): residual latent coding of pre-RoPE
 * KV against nearest center tokens, with OmniKV-style selection at the full
 * layers and reconstruction of the selected tokens only.
 *
 * Layers. Full layers (deltakv_full_layers, OmniKV's list; layer 0 always)
 * keep raw K / V: planes "k" and "v" (the slot's K after RoPE, rotated at
 * store time, and V). The others are DeltaKV layers with one plane "z": the
 * token's latent [latent] (kv elements). Per token t of a DeltaKV layer,
 * x_t = [k_t ; v_t] (2 KH hd, k before RoPE) is either
 *   raw      (sink tokens [0, s), centers, and the uncompressed buffer of the
 *            newest tokens): x_t in the method's raw store (rawk / rawv
 *            [n_raw, KH hd] per DeltaKV layer; one raw row id per slot,
 *            the same in every DeltaKV layer), or
 *   latent   z_t = Down (x_t - base_t) in the "z" plane, base_t = the mean of
 *            its K fathers' x (K = deltakv_neighbors nearest centers in
 *            x-space, ranking 2 x.c - |c|^2, among the centers at positions
 *            before t), father raw rows in a host table [n_slots, K].
 * Reconstruction: x^_t = Up z_t + base_t (Down, Up linear: the fitted
 * compressor of `lethe fit deltakv`, tools/fit_deltakv.c), then RoPE of the
 * key part at the token's position (any k-norm was applied before the store).
 *
 * Buffer policy (finish_step = SE). New tokens are stored raw. After each
 * step, per sequence, the buffer B (the trailing entries still raw and not
 * yet compressed) is compressed in multiples of r = recent_keep_tokens when
 * |B| > r: its oldest floor((|B| - r) / r) r tokens form a block; every
 * stride = floor(1 / deltakv_center_ratio)-th token of the block (from its
 * first) becomes a center (raw kept), the others get fathers and latents and
 * lose their raw rows. So |B| stays in [r, 2r) after a step and fathers are
 * always causally earlier centers (or sinks).
 *
 * Decode selection (OmniKV): a full layer whose next layer is a DeltaKV
 * layer scores, for each decode sequence with more than
 * decode_keep_tokens compressed candidates [s, start of B), per head the
 * softmax over the candidates, max over heads, and keeps the top-K; the
 * following DeltaKV layers read sink + top-K + B (the new token included) and
 * reconstruct only what they read. Prefill reads everything (the full-prefill
 * policy: chunks after the first read the earlier chunks reconstructed).
 *
 * Memory. A DeltaKV layer costs per token latent kv elements in the pool, and
 * through slot_overhead_bytes 2 KH hd act elements / stride (the centers'
 * raw rows) + 4 K bytes (fathers, host); the raw rows of every running
 * request's sink and buffer and of one step's new tokens are a fixed reserve
 * (kv_reserve_bytes: max_num_seqs (s + 2 r + 1) + max_num_batched_tokens
 * rows) taken off the budget before it is divided into slots.
 *
 * Compressor: deltakv_compressor=DIR with DIR/deltakv.json ({"format":
 * "lethe-deltakv-1", n_layers, n_kv_heads, head_dim, latent, ...}) and
 * DIR/deltakv.safetensors (F32 "layers.L.down" [latent, 2 KH hd], applied to
 * [k ; v], "layers.L.up" [2 KH hd, latent]); deltakv_latent=R keeps the
 * leading R latent dims (a PCA fit is ordered by variance). @identity:
 * Down = Up = I (latent 2 KH hd; reconstruction exact up to the rounding of
 * (x - base) + base). @random: seeded random projections of deltakv_latent
 * dims (default 128): a compressor with the real shapes for speed
 * measurements only, not for quality. Without one the method refuses to
 * start, naming `lethe fit deltakv`.
 *
 * Father search: per tile of up to TILE block tokens, the scores x . c
 * [nt, ncc] against the candidates (sinks and centers before the tile's last
 * token) are one product over k and v on the backend, and ops->row_topk
 * ranks 2 x.c - |c|^2 per token over the candidates before it there: only
 * the [nt, K] father indices reach the host (|c|^2 of each new center is
 * computed once on the host, in double, and kept per raw row).
 *
 * Limits: linear Down / Up only (the paper's MLP variants and latent int4
 * quantization are not implemented); the full layers keep KV at the native
 * type (no KIVI); the decode selection's top-K runs on the host (scores
 * copied from the backend, one row per decode sequence); prefill chunks after
 * the first reconstruct every earlier compressed token in every DeltaKV
 * layer (full-prefill policy); no radix prefix reuse; slots must not be freed
 * under a live row (pruning clients / eviction do not combine with it). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/topk.h"
#include "core/json.h"
#include "core/util.h"
#include "model/safetensors.h"
#include "sparse/sparse.h"

lethe_status lethe_omnikv_parse_layers(const char *text, int32_t n_layers, bool *full); /* omnikv.c */

enum { ST_BUF = 0, ST_CENTER = 1, ST_LATENT = 2 }; /* per-slot state */
enum { TILE = 1024 };                              /* block tokens per father search */

typedef struct dkv_layer {
    void *dk, *dv, *uk, *uv;  /* Down split [lat, kvd] for k and v; Up split [kvd, lat] */
    void *rawk, *rawv;        /* raw store [n_raw, kvd] (act) */
    float *cnorm;             /* host [n_raw] |x|^2 of raw rows, NAN = not computed */
    int32_t *fathers;         /* host [n_slots, K] raw rows */
} dkv_layer;

typedef struct dkv_priv {
    lethe_knob_values kv;
    bool *full;               /* [n_layers] */
    int32_t first_dl;         /* first DeltaKV layer, -1 without one */
    int32_t lat, K, stride, kvd;
    dkv_layer *layers;
    /* raw store: host bookkeeping, allocated at the first store */
    int64_t reserve_rows;     /* kv_reserve_bytes' rows, -1 = not asked (raw rows for every slot) */
    int32_t n_slots, n_raw;
    int32_t *raw_of;          /* [n_slots] raw row or -1 */
    uint8_t *state;           /* [n_slots] ST_* */
    int32_t *slot_pos;        /* [n_slots] position the slot was stored at */
    int32_t *raw_free, n_free;
    int32_t *slot_of_raw;     /* [n_raw] the slot a raw row belongs to */
    /* the step's selection: per sequence, picked entries of the last filter layer */
    const lethe_sparse_step *st;
    int32_t cap_seqs, *pick_begin, *pick_n, *buf_start, *picks, cap_picks;
    bool *valid;
    /* scratch */
    lethe_dev_buf krot, ks, vs, zs, z2, sc, sc2;
    int32_t cap_h, *perm, *ridx, *cslot, *fidx, *spos;
    float *hrow;
    int32_t cap_hrow;
} dkv_priv;
#define PRIV(m) ((dkv_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"deltakv_compressor", LETHE_KNOB_STR, "none", 0, 0,
     "folder of deltakv.json + deltakv.safetensors (`lethe fit deltakv`), @identity (exact), or @random "
     "(seeded random projections: speed measurements only); none = refuse"},
    {"deltakv_latent", LETHE_KNOB_INT, "0", 0, 65536,
     "latent dims kept per token (0 = the compressor's; @random: 128); at most the compressor's"},
    {"deltakv_neighbors", LETHE_KNOB_INT, "4", 1, 16, "fathers per compressed token (nearest centers)"},
    {"deltakv_center_ratio", LETHE_KNOB_FLOAT, "0.1", 0.001, 1, "share of block tokens kept raw as centers"},
    {"deltakv_full_layers", LETHE_KNOB_STR, "auto", 0, 0,
     "full-attention layers with raw KV: auto or a list 0:1:2:8 (OmniKV's)"},
    {"deltakv_seed", LETHE_KNOB_INT, "0", 0, 1 << 30, "seed of @random"},
};

static void grow_i32(int32_t **p, int32_t *cap, int32_t n) {
    if (n <= *cap) return;
    *cap = LETHE_MAX(n, *cap + *cap / 2);
    *p = lethe_xrealloc(*p, (size_t)*cap * sizeof(int32_t));
}

static void reserve(lethe_sparse_method *m, lethe_dev_buf *b, size_t elems, size_t esize) {
    lethe_status st = lethe_dev_buf_reserve(m, b, (elems ? elems : 1) * esize);
    LETHE_ASSERT(st == LETHE_OK); /* scratch of one step's tokens */
}

static lethe_status dkv_init(lethe_sparse_method *m) {
    dkv_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    p->full = lethe_xcalloc((size_t)m->env.n_layers, sizeof(bool));
    p->reserve_rows = -1;
    m->priv = p;
    return LETHE_OK;
}

static void dkv_destroy(lethe_sparse_method *m) {
    dkv_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    for (int32_t l = 0; p->layers && l < m->env.n_layers; l++) {
        dkv_layer *L = &p->layers[l];
        void *w[6] = {L->dk, L->dv, L->uk, L->uv, L->rawk, L->rawv};
        for (int i = 0; i < 6; i++)
            if (w[i]) be->ops->release(be, w[i]);
        free(L->cnorm), free(L->fathers);
    }
    lethe_dev_buf *bufs[7] = {&p->krot, &p->ks, &p->vs, &p->zs, &p->z2, &p->sc, &p->sc2};
    for (int i = 0; be && i < 7; i++) lethe_dev_buf_free(m, bufs[i]);
    free(p->layers), free(p->full), free(p->raw_of), free(p->state), free(p->slot_pos), free(p->raw_free), free(p->slot_of_raw);
    free(p->pick_begin), free(p->pick_n), free(p->buf_start), free(p->picks), free(p->valid);
    free(p->perm), free(p->ridx), free(p->cslot), free(p->fidx), free(p->spos), free(p->hrow);
    free(p);
    m->priv = NULL;
}

static lethe_status dkv_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

/* ---- the compressor ---- */

static lethe_status upload(const lethe_sparse_method *m, const float *host, size_t n, void **out) {
    return m->env.be->ops->weight_upload(m->env.be, host, n, out);
}

/* down [lat][2 kvd] (row-major, over [k ; v]) and up [2 kvd][lat] -> the four split weights */
static lethe_status load_layer(lethe_sparse_method *m, int32_t l, const float *down, const float *up,
                               int32_t lat_file) {
    dkv_priv *p = PRIV(m);
    const int32_t kvd = p->kvd, lat = p->lat, D = 2 * kvd;
    float *dk = lethe_xmalloc((size_t)lat * kvd * sizeof(float)), *dv = lethe_xmalloc((size_t)lat * kvd * sizeof(float));
    float *uk = lethe_xmalloc((size_t)kvd * lat * sizeof(float)), *uv = lethe_xmalloc((size_t)kvd * lat * sizeof(float));
    for (int32_t i = 0; i < lat; i++) /* the leading lat rows of Down */
        for (int32_t c = 0; c < kvd; c++) {
            dk[(size_t)i * kvd + c] = down[(size_t)i * D + c];
            dv[(size_t)i * kvd + c] = down[(size_t)i * D + kvd + c];
        }
    for (int32_t c = 0; c < kvd; c++) /* the leading lat columns of Up */
        for (int32_t i = 0; i < lat; i++) {
            uk[(size_t)c * lat + i] = up[(size_t)c * lat_file + i];
            uv[(size_t)c * lat + i] = up[(size_t)(kvd + c) * lat_file + i];
        }
    dkv_layer *L = &p->layers[l];
    lethe_status st = upload(m, dk, (size_t)lat * kvd, &L->dk);
    if (st == LETHE_OK) st = upload(m, dv, (size_t)lat * kvd, &L->dv);
    if (st == LETHE_OK) st = upload(m, uk, (size_t)kvd * lat, &L->uk);
    if (st == LETHE_OK) st = upload(m, uv, (size_t)kvd * lat, &L->uv);
    free(dk), free(dv), free(uk), free(uv);
    return st;
}

static lethe_status load_builtin(lethe_sparse_method *m, bool identity) {
    dkv_priv *p = PRIV(m);
    const int32_t D = 2 * p->kvd, lat = p->lat;
    float *down = lethe_xcalloc((size_t)lat * D, sizeof(float)), *up = lethe_xcalloc((size_t)D * lat, sizeof(float));
    uint64_t rng = 0x5eed0000ull + (uint64_t)lethe_knob_num(m->ops, &p->kv, "deltakv_seed");
    lethe_status st = LETHE_OK;
    for (int32_t l = 0; l < m->env.n_layers && st == LETHE_OK; l++) {
        if (p->full[l]) continue;
        for (int32_t i = 0; i < lat; i++)
            for (int32_t c = 0; c < D; c++) {
                float w = identity ? (float)(i == c)
                                   : (float)(((lethe_splitmix64(&rng) >> 40) * 0x1p-24 * 2 - 1) * sqrt(3.0 / D));
                down[(size_t)i * D + c] = w;
                up[(size_t)c * lat + i] = w;
            }
        st = load_layer(m, l, down, up, lat);
    }
    free(down), free(up);
    return st;
}

static int32_t json_int(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
}

static const lethe_st_tensor *want(const lethe_safetensors *sf, const char *path, int32_t l, const char *what,
                                   int64_t d0, int64_t d1, lethe_status *err) {
    char name[64];
    snprintf(name, sizeof(name), "layers.%d.%s", l, what);
    const lethe_st_tensor *t = lethe_st_find(sf, name);
    if (!t || t->n_dims != 2 || t->shape[0] != d0 || t->shape[1] != d1) {
        *err = lethe_errorf(LETHE_ERR_FORMAT, "deltakv: %s: tensor %s %s (want [%lld, %lld])", path, name,
                            t ? "has another shape" : "is missing", (long long)d0, (long long)d1);
        return NULL;
    }
    return t;
}

static lethe_status load_dir(lethe_sparse_method *m, const char *dir) {
    dkv_priv *p = PRIV(m);
    const lethe_sparse_env *env = &m->env;
    char path[1024], tpath[1024];
    snprintf(path, sizeof(path), "%s/deltakv.json", dir);
    snprintf(tpath, sizeof(tpath), "%s/deltakv.safetensors", dir);
    char *text = NULL;
    size_t n = 0;
    if (lethe_read_file(path, &text, &n) != LETHE_OK)
        return lethe_errorf(LETHE_ERR_IO, "deltakv: no compressor at %s: make one with `lethe fit deltakv MODEL "
                            "--calib TEXT --out %s`", path, dir);
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    lethe_status st = LETHE_OK;
    const cJSON *fmt = root ? cJSON_GetObjectItemCaseSensitive(root, "format") : NULL;
    if (!root || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, "lethe-deltakv-1")) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "deltakv: %s is not a lethe-deltakv-1 compressor file", path);
        goto out;
    }
    const int32_t lat_file = json_int(root, "latent"), D = 2 * p->kvd;
    if (json_int(root, "n_layers") != env->n_layers || json_int(root, "n_kv_heads") != env->n_kv_heads ||
        json_int(root, "head_dim") != env->head_dim || lat_file < 1 || lat_file > D) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "deltakv: %s was fitted for another shape (layers %d, KV heads %d, "
                          "head_dim %d, latent %d; this model: %d, %d, %d, latent in [1, %d])", path,
                          json_int(root, "n_layers"), json_int(root, "n_kv_heads"), json_int(root, "head_dim"),
                          lat_file, env->n_layers, env->n_kv_heads, env->head_dim, D);
        goto out;
    }
    const int32_t want_lat = (int32_t)lethe_knob_num(m->ops, &p->kv, "deltakv_latent");
    if (want_lat > lat_file) {
        st = lethe_errorf(LETHE_ERR_INVALID, "--sparse-config deltakv_latent=%d: %s has latent %d (fit a larger "
                          "--latent)", want_lat, path, lat_file);
        goto out;
    }
    p->lat = want_lat ? want_lat : lat_file;
    lethe_safetensors sf;
    memset(&sf, 0, sizeof(sf));
    if ((st = lethe_st_open_file(tpath, &sf)) != LETHE_OK) {
        st = lethe_errorf(st, "deltakv: %s", lethe_last_error());
        goto out;
    }
    for (int32_t l = 0; l < env->n_layers && st == LETHE_OK; l++) {
        const lethe_st_tensor *td = want(&sf, tpath, l, "down", lat_file, D, &st);
        const lethe_st_tensor *tu = td ? want(&sf, tpath, l, "up", D, lat_file, &st) : NULL;
        if (!td || !tu) break;
        float *down = lethe_xmalloc(td->n_elems * sizeof(float)), *up = lethe_xmalloc(tu->n_elems * sizeof(float));
        st = lethe_st_to_f32(&sf, td, down);
        if (st == LETHE_OK) st = lethe_st_to_f32(&sf, tu, up);
        for (size_t i = 0; st == LETHE_OK && i < td->n_elems; i++)
            if (!isfinite(down[i]) || !isfinite(up[i]))
                st = lethe_errorf(LETHE_ERR_FORMAT, "deltakv: %s: layer %d holds a non-finite weight", tpath, l);
        if (st == LETHE_OK && !p->full[l]) st = load_layer(m, l, down, up, lat_file); /* full layers: validated only */
        free(down), free(up);
    }
    lethe_st_close(&sf);
out:
    cJSON_Delete(root);
    return st;
}

static lethe_status dkv_configure(lethe_sparse_method *m) {
    dkv_priv *p = PRIV(m);
    const lethe_sparse_env *env = &m->env;
    p->kvd = env->n_kv_heads * env->head_dim;
    p->K = (int32_t)lethe_knob_num(m->ops, &p->kv, "deltakv_neighbors");
    p->stride = LETHE_MAX(1, (int32_t)floor(1.0 / lethe_knob_num(m->ops, &p->kv, "deltakv_center_ratio") + 1e-9));
    lethe_status st = lethe_omnikv_parse_layers(lethe_knob_str(m->ops, &p->kv, "deltakv_full_layers"),
                                                env->n_layers, p->full);
    if (st != LETHE_OK) return lethe_errorf(st, "%s", lethe_last_error()); /* names the omnikv knob's syntax */
    p->first_dl = -1;
    for (int32_t l = env->n_layers - 1; l >= 0; l--)
        if (!p->full[l]) p->first_dl = l;
    if (m->knobs.recent_keep_tokens < 1)
        return lethe_errorf(LETHE_ERR_INVALID, "deltakv: recent_keep_tokens must be >= 1 (the buffer is compressed "
                            "in multiples of it)");
    const char *src = lethe_knob_str(m->ops, &p->kv, "deltakv_compressor");
    if (!*src || !strcmp(src, "none"))
        return lethe_errorf(LETHE_ERR_INVALID, "deltakv needs its compressor: --sparse-config "
                            "deltakv_compressor=DIR (the folder `lethe fit deltakv MODEL --calib TEXT` writes), "
                            "@identity (no compression) or @random (speed measurements only)");
    const int32_t want_lat = (int32_t)lethe_knob_num(m->ops, &p->kv, "deltakv_latent");
    if (!strcmp(src, "@identity")) {
        if (want_lat && want_lat != 2 * p->kvd)
            return lethe_errorf(LETHE_ERR_INVALID, "deltakv: @identity has latent 2 KH hd = %d", 2 * p->kvd);
        p->lat = 2 * p->kvd;
    } else if (!strcmp(src, "@random")) {
        p->lat = want_lat ? want_lat : LETHE_MIN(128, 2 * p->kvd);
    }
    if (!env->be) { /* the fake model: bookkeeping only */
        if (!p->lat) p->lat = 2 * p->kvd;
        return LETHE_OK;
    }
    p->layers = lethe_xcalloc((size_t)env->n_layers, sizeof(dkv_layer));
    if (src[0] == '@') {
        if (strcmp(src, "@identity") && strcmp(src, "@random"))
            return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config deltakv_compressor=%s: expected a folder, "
                                "@identity or @random", src);
        return load_builtin(m, !strcmp(src, "@identity"));
    }
    return load_dir(m, src);
}

/* ---- capacity ---- */

static bool dkv_layout(const lethe_sparse_method *m, int32_t layer, lethe_kv_layout *out) {
    const dkv_priv *p = PRIV(m);
    if (!m->env.be) return false;
    const size_t ks = m->env.be->ops->kv_size;
    if (p->full[layer])
        *out = (lethe_kv_layout){.n_planes = 2, .planes = {{"k", p->kvd * ks}, {"v", p->kvd * ks}}};
    else
        *out = (lethe_kv_layout){.n_planes = 1, .planes = {{"z", p->lat * ks}}};
    return true;
}

static int32_t n_dlayers(const lethe_sparse_method *m) {
    int32_t n = 0;
    for (int32_t l = 0; l < m->env.n_layers; l++) n += !PRIV(m)->full[l];
    return n;
}

/* raw bytes of one token over the DeltaKV layers (K and V) */
static size_t raw_token_bytes(const lethe_sparse_method *m) {
    return m->env.be ? (size_t)n_dlayers(m) * 2 * PRIV(m)->kvd * m->env.be->ops->act_size : 0;
}

static size_t dkv_slot_overhead(const lethe_sparse_method *m) {
    const dkv_priv *p = PRIV(m);
    if (!m->env.be) return 0;
    return raw_token_bytes(m) / p->stride + (size_t)n_dlayers(m) * p->K * sizeof(int32_t);
}

static size_t dkv_reserve(lethe_sparse_method *m, int32_t max_seqs, int32_t max_batched) {
    dkv_priv *p = PRIV(m);
    p->reserve_rows = (int64_t)max_seqs * (m->knobs.sink_keep_tokens + 2 * m->knobs.recent_keep_tokens + 1) +
                      max_batched;
    return (size_t)p->reserve_rows * raw_token_bytes(m);
}

/* the raw store, sized on first use: the centers' share of the slots + the
 * reserve (every slot when the reserve was not asked: the contract harness) */
static void raw_init(lethe_sparse_method *m) {
    dkv_priv *p = PRIV(m);
    if (p->raw_of) return;
    lethe_backend *be = m->env.be;
    p->n_slots = lethe_kv_n_slots(m->env.pool);
    int64_t n_raw = p->reserve_rows < 0 ? p->n_slots : (int64_t)p->n_slots / p->stride + p->reserve_rows;
    p->n_raw = (int32_t)LETHE_MIN(n_raw, (int64_t)p->n_slots);
    p->raw_of = lethe_xmalloc((size_t)p->n_slots * sizeof(int32_t));
    p->state = lethe_xcalloc((size_t)p->n_slots, 1);
    p->slot_pos = lethe_xcalloc((size_t)p->n_slots, sizeof(int32_t));
    for (int32_t i = 0; i < p->n_slots; i++) p->raw_of[i] = -1;
    p->raw_free = lethe_xmalloc((size_t)p->n_raw * sizeof(int32_t));
    p->slot_of_raw = lethe_xcalloc((size_t)p->n_raw, sizeof(int32_t));
    for (int32_t i = 0; i < p->n_raw; i++) p->raw_free[i] = p->n_raw - 1 - i;
    p->n_free = p->n_raw;
    for (int32_t l = 0; l < m->env.n_layers; l++) {
        if (p->full[l]) continue;
        dkv_layer *L = &p->layers[l];
        const size_t b = (size_t)p->n_raw * p->kvd * be->ops->act_size;
        lethe_status st = be->ops->alloc(be, b, &L->rawk);
        if (st == LETHE_OK) st = be->ops->alloc(be, b, &L->rawv);
        if (st != LETHE_OK) fprintf(stderr, "deltakv: raw store of %d rows: %s\n", p->n_raw, lethe_last_error());
        LETHE_ASSERT(st == LETHE_OK); /* budgeted: slot_overhead_bytes + kv_reserve_bytes */
        L->cnorm = lethe_xmalloc((size_t)p->n_raw * sizeof(float));
        for (int32_t i = 0; i < p->n_raw; i++) L->cnorm[i] = NAN;
        L->fathers = lethe_xcalloc((size_t)p->n_slots * p->K, sizeof(int32_t));
    }
}

static void raw_release(dkv_priv *p, int32_t slot) {
    const int32_t r = p->raw_of[slot];
    if (r < 0) return;
    p->raw_free[p->n_free++] = r;
    p->raw_of[slot] = -1;
}

/* a raw row for a slot being stored: its own (a reused slot), a free one, or
 * one reclaimed from slots no row holds any more */
static int32_t raw_take(lethe_sparse_method *m, int32_t slot) {
    dkv_priv *p = PRIV(m);
    if (p->raw_of[slot] >= 0) return p->raw_of[slot];
    if (!p->n_free)
        for (int32_t s = 0; s < p->n_slots; s++)
            if (p->raw_of[s] >= 0 && lethe_kv_refcount(m->env.pool, 0, s) == 0) raw_release(p, s);
    if (!p->n_free) fprintf(stderr, "deltakv: raw store of %d rows exhausted\n", p->n_raw);
    LETHE_ASSERT(p->n_free > 0); /* the reserve bounds the raw rows of running requests */
    const int32_t r = p->raw_free[--p->n_free];
    for (int32_t l = 0; l < m->env.n_layers; l++)
        if (!p->full[l]) p->layers[l].cnorm[r] = NAN;
    p->slot_of_raw[r] = slot;
    return p->raw_of[slot] = r;
}

/* for tests: the state of `slot` (0 buffer, 1 raw center / sink, 2 latent),
 * its stored position, and for a latent token its K fathers' positions in
 * DeltaKV layer `layer` (father_pos may be NULL); -1 before any store */
int32_t lethe_deltakv_slot_state(const lethe_sparse_method *m, int32_t layer, int32_t slot, int32_t *pos,
                                 int32_t *father_pos);
int32_t lethe_deltakv_slot_state(const lethe_sparse_method *m, int32_t layer, int32_t slot, int32_t *pos,
                                 int32_t *father_pos) {
    const dkv_priv *p = PRIV(m);
    if (!p->raw_of || slot < 0 || slot >= p->n_slots) return -1;
    if (pos) *pos = p->slot_pos[slot];
    if (father_pos && p->state[slot] == ST_LATENT && !p->full[layer])
        for (int32_t k = 0; k < p->K; k++)
            father_pos[k] = p->slot_pos[p->slot_of_raw[p->layers[layer].fathers[(size_t)slot * p->K + k]]];
    return p->state[slot];
}

/* ---- store ---- */

static void dkv_store(lethe_sparse_method *m, int32_t layer, const void *k, const void *v, const int32_t *slots,
                      const int32_t *pos, int32_t n) {
    dkv_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    lethe_kv_pool *pool = m->env.pool;
    if (n <= 0) return;
    raw_init(m);
    if (p->full[layer]) { /* K after RoPE, as dense stores it */
        reserve(m, &p->krot, (size_t)n * p->kvd, be->ops->act_size);
        be->ops->copy_block(be, p->krot.p, p->kvd, 0, NULL, k, p->kvd, n, p->kvd);
        if (m->env.rope) be->ops->rope(be, p->krot.p, pos, n, m->env.n_kv_heads, m->env.head_dim, m->env.rope);
        be->ops->kv_store(be, lethe_kv_plane_buf(pool, layer, 0), lethe_kv_plane_buf(pool, layer, 1), p->krot.p, v,
                          slots, n, p->kvd);
        return;
    }
    grow_i32(&p->ridx, &p->cap_h, n);
    if (layer == p->first_dl) /* (prepare reset their state) */
        for (int32_t i = 0; i < n; i++) {
            raw_take(m, slots[i]);
            p->slot_pos[slots[i]] = pos[i];
            p->state[slots[i]] = pos[i] < m->knobs.sink_keep_tokens ? ST_CENTER : ST_BUF;
        }
    for (int32_t i = 0; i < n; i++) p->ridx[i] = p->raw_of[slots[i]];
    const dkv_layer *L = &p->layers[layer];
    be->ops->copy_block(be, L->rawk, p->kvd, 0, p->ridx, k, p->kvd, n, p->kvd);
    be->ops->copy_block(be, L->rawv, p->kvd, 0, p->ridx, v, p->kvd, n, p->kvd);
}

/* ---- attend: gather raw rows, reconstruct latent ones, RoPE, attention ---- */

static void dkv_attend(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a) {
    dkv_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    if (p->full[layer]) {
        be->ops->attention(be, a);
        return;
    }
    const dkv_layer *L = &p->layers[layer];
    const int32_t n_sel = a->sel_begin[a->n_seqs], kvd = p->kvd, K = p->K;
    const size_t as = be->ops->act_size;
    if (n_sel > p->cap_h) {
        p->cap_h = LETHE_MAX(n_sel, p->cap_h + p->cap_h / 2);
        p->ridx = lethe_xrealloc(p->ridx, (size_t)p->cap_h * sizeof(int32_t));
    }
    int32_t cap = p->cap_h;
    p->perm = lethe_xrealloc(p->perm, (size_t)cap * sizeof(int32_t));
    p->cslot = lethe_xrealloc(p->cslot, (size_t)cap * sizeof(int32_t));
    p->spos = lethe_xrealloc(p->spos, (size_t)cap * sizeof(int32_t));
    p->fidx = lethe_xrealloc(p->fidx, (size_t)cap * K * sizeof(int32_t));
    int32_t n_raw = 0, n_lat = 0;
    for (int32_t e = 0; e < n_sel; e++) /* raw rows first in the scratch, latent ones after */
        if (p->raw_of[a->sel_slots[e]] >= 0) n_raw++;
    for (int32_t e = 0, ir = 0, il = 0; e < n_sel; e++) {
        const int32_t s = a->sel_slots[e];
        if (p->raw_of[s] >= 0) {
            p->ridx[ir] = p->raw_of[s];
            p->spos[ir] = p->slot_pos[s];
            p->perm[e] = ir++;
        } else {
            LETHE_ASSERT(p->state[s] == ST_LATENT);
            p->cslot[il] = s;
            memcpy(p->fidx + (size_t)il * K, L->fathers + (size_t)s * K, (size_t)K * sizeof(int32_t));
            p->spos[n_raw + il] = p->slot_pos[s];
            p->perm[e] = n_raw + il++;
        }
        n_lat = il;
    }
    reserve(m, &p->ks, (size_t)n_sel * kvd, as);
    reserve(m, &p->vs, (size_t)n_sel * kvd, as);
    be->ops->gather_rows(be, p->ks.p, L->rawk, p->ridx, n_raw, kvd);
    be->ops->gather_rows(be, p->vs.p, L->rawv, p->ridx, n_raw, kvd);
    if (n_lat) {
        void *kl = (char *)p->ks.p + (size_t)n_raw * kvd * as, *vl = (char *)p->vs.p + (size_t)n_raw * kvd * as;
        reserve(m, &p->zs, (size_t)n_lat * p->lat, as);
        be->ops->gather_rows(be, p->zs.p, lethe_kv_plane_buf(m->env.pool, layer, 0), p->cslot, n_lat, p->lat);
        be->ops->matmul(be, kl, p->zs.p, L->uk, n_lat, kvd, p->lat); /* Up z, then + the fathers' mean */
        be->ops->matmul(be, vl, p->zs.p, L->uv, n_lat, kvd, p->lat);
        be->ops->gather_sum(be, kl, L->rawk, p->fidx, n_lat, K, kvd, 1.0f / K);
        be->ops->gather_sum(be, vl, L->rawv, p->fidx, n_lat, K, kvd, 1.0f / K);
    }
    if (m->env.rope) be->ops->rope(be, p->ks.p, p->spos, n_sel, m->env.n_kv_heads, m->env.head_dim, m->env.rope);
    lethe_attn_args d = *a; /* the same sequences over scratch rows */
    d.k_cache = p->ks.p;
    d.v_cache = p->vs.p;
    d.sel_slots = p->perm;
    d.kvq = NULL;
    be->ops->attention(be, &d);
}

/* ---- SE: compress the buffer in multiples of r ---- */

/* |x|^2 of raw rows rows[0..n) of layer L whose norm is not known yet */
static void fill_norms(lethe_sparse_method *m, dkv_layer *L, const int32_t *rows, int32_t n) {
    dkv_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    int32_t nm = 0;
    int32_t *miss = lethe_xmalloc((size_t)(n ? n : 1) * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++)
        if (isnan(L->cnorm[rows[i]])) miss[nm++] = rows[i];
    for (int32_t i0 = 0; i0 < nm; i0 += TILE) {
        const int32_t nt = LETHE_MIN(TILE, nm - i0);
        reserve(m, &p->ks, (size_t)nt * p->kvd, be->ops->act_size);
        reserve(m, &p->vs, (size_t)nt * p->kvd, be->ops->act_size);
        if ((size_t)nt * p->kvd * 2 > (size_t)p->cap_hrow) {
            p->cap_hrow = nt * p->kvd * 2;
            p->hrow = lethe_xrealloc(p->hrow, (size_t)p->cap_hrow * sizeof(float));
        }
        be->ops->gather_rows(be, p->ks.p, L->rawk, miss + i0, nt, p->kvd);
        be->ops->gather_rows(be, p->vs.p, L->rawv, miss + i0, nt, p->kvd);
        be->ops->act_to_host(be, p->hrow, p->ks.p, (size_t)nt * p->kvd);
        be->ops->act_to_host(be, p->hrow + (size_t)nt * p->kvd, p->vs.p, (size_t)nt * p->kvd);
        for (int32_t i = 0; i < nt; i++) {
            double s = 0;
            for (int32_t c = 0; c < p->kvd; c++) {
                const double x = p->hrow[(size_t)i * p->kvd + c], y = p->hrow[(size_t)(nt + i) * p->kvd + c];
                s += x * x + y * y;
            }
            L->cnorm[miss[i0 + i]] = (float)s;
        }
    }
    free(miss);
}

/* One layer's block: the fathers of the non-centers tok[0..nb) (row entries
 * ent[], candidates cand[0..nc) = entries of sinks and centers, ascending,
 * cent_raw their raw rows), their latents into the z plane. */
static void compress_layer(lethe_sparse_method *m, int32_t layer, const int32_t *slots, const int32_t *tok,
                           int32_t nb, const int32_t *cand, const int32_t *cand_raw, int32_t nc) {
    dkv_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    dkv_layer *L = &p->layers[layer];
    const int32_t kvd = p->kvd, K = p->K;
    const size_t as = be->ops->act_size;
    fill_norms(m, L, cand_raw, nc);
    const int32_t tn = LETHE_MIN(TILE, nb);
    /* host scratch of one tile: its raw rows, then slots; K best candidates; limits; -|c|^2 */
    int32_t *rows = lethe_xmalloc((size_t)tn * sizeof(int32_t)), *fid = lethe_xmalloc((size_t)tn * K * sizeof(int32_t));
    int32_t *best = lethe_xmalloc((size_t)tn * K * sizeof(int32_t)), *lim = lethe_xmalloc((size_t)tn * sizeof(int32_t));
    float *bias = lethe_xmalloc((size_t)nc * sizeof(float));
    for (int32_t c = 0; c < nc; c++) bias[c] = -L->cnorm[cand_raw[c]];
    for (int32_t t0 = 0, ncc = 0; t0 < nb; t0 += TILE) {
        const int32_t nt = LETHE_MIN(TILE, nb - t0);
        /* per token the candidates before it (tokens ascend, so do the counts) */
        for (int32_t i = 0; i < nt; i++) {
            while (ncc < nc && cand[ncc] < tok[t0 + i]) ncc++;
            lim[i] = ncc;
            LETHE_ASSERT(ncc > 0);
        }
        for (int32_t i = 0; i < nt; i++) rows[i] = p->raw_of[slots[tok[t0 + i]]];
        /* scores x . c over k and v: [nt, ncc], ncc = the tile's last token's candidates */
        reserve(m, &p->ks, (size_t)nt * kvd, as);
        reserve(m, &p->vs, (size_t)nt * kvd, as);
        reserve(m, &p->zs, (size_t)ncc * kvd, as);
        reserve(m, &p->z2, (size_t)ncc * kvd, as);
        reserve(m, &p->sc, (size_t)nt * ncc, as);
        reserve(m, &p->sc2, (size_t)nt * ncc, as);
        be->ops->gather_rows(be, p->ks.p, L->rawk, rows, nt, kvd);
        be->ops->gather_rows(be, p->vs.p, L->rawv, rows, nt, kvd);
        be->ops->gather_rows(be, p->zs.p, L->rawk, cand_raw, ncc, kvd);
        be->ops->gather_rows(be, p->z2.p, L->rawv, cand_raw, ncc, kvd);
        be->ops->matmul(be, p->sc.p, p->ks.p, p->zs.p, nt, ncc, kvd);
        be->ops->matmul(be, p->sc2.p, p->vs.p, p->z2.p, nt, ncc, kvd);
        be->ops->add(be, p->sc.p, p->sc2.p, (size_t)nt * ncc);
        /* per token: the K best of 2 x.c - |c|^2 among candidates before it
         * (ties to the earlier center), on the backend; fewer candidates than
         * K repeat them in rank order */
        be->ops->row_topk(be, best, p->sc.p, nt, ncc, lim, K, 2.0f, bias);
        for (int32_t i = 0; i < nt; i++) {
            const int32_t nv = LETHE_MIN(K, lim[i]), *b = best + (size_t)i * K;
            for (int32_t k = 0; k < K; k++) fid[(size_t)i * K + k] = cand_raw[b[k < nv ? k : k % nv]];
            memcpy(L->fathers + (size_t)slots[tok[t0 + i]] * K, fid + (size_t)i * K, (size_t)K * sizeof(int32_t));
        }
        /* z = Dk (k - mean k_f) + Dv (v - mean v_f) into the plane */
        be->ops->gather_sum(be, p->ks.p, L->rawk, fid, nt, K, kvd, -1.0f / K);
        be->ops->gather_sum(be, p->vs.p, L->rawv, fid, nt, K, kvd, -1.0f / K);
        reserve(m, &p->zs, (size_t)nt * p->lat, as);
        reserve(m, &p->z2, (size_t)nt * p->lat, as);
        be->ops->matmul(be, p->zs.p, p->ks.p, L->dk, nt, p->lat, kvd);
        be->ops->matmul(be, p->z2.p, p->vs.p, L->dv, nt, p->lat, kvd);
        be->ops->add(be, p->zs.p, p->z2.p, (size_t)nt * p->lat);
        for (int32_t i = 0; i < nt; i++) rows[i] = slots[tok[t0 + i]];
        be->ops->copy_block(be, lethe_kv_plane_buf(m->env.pool, layer, 0), p->lat, 0, rows, p->zs.p, p->lat, nt,
                            p->lat);
    }
    free(rows), free(fid), free(best), free(lim), free(bias);
}

/* the first entry of the row's buffer (trailing entries never compressed) */
static int32_t buffer_start(const dkv_priv *p, const int32_t *slots, int32_t L) {
    int32_t b = L;
    while (b > 0 && p->state[slots[b - 1]] == ST_BUF) b--;
    return b;
}

static void compress_seq(lethe_sparse_method *m, const lethe_sparse_seq *q) {
    dkv_priv *p = PRIV(m);
    const int32_t r = m->knobs.recent_keep_tokens;
    const int32_t L = lethe_kv_row_len(m->env.pool, 0, q->row);
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, 0, q->row);
    const int32_t b0 = buffer_start(p, slots, L), nb = L - b0;
    if (nb <= r) return;
    const int32_t n_c = (nb - r) / r * r, b1 = b0 + n_c;
    /* centers: every stride-th block entry from its first; candidates: every raw
     * entry before b1 that is a sink / center (ascending) */
    for (int32_t e = b0; e < b1; e += p->stride) p->state[slots[e]] = ST_CENTER;
    int32_t *cand = lethe_xmalloc((size_t)b1 * sizeof(int32_t)), *craw = lethe_xmalloc((size_t)b1 * sizeof(int32_t));
    int32_t *tok = lethe_xmalloc((size_t)n_c * sizeof(int32_t)), nc = 0, nt = 0;
    for (int32_t e = 0; e < b1; e++)
        if (p->state[slots[e]] == ST_CENTER) {
            LETHE_ASSERT(p->raw_of[slots[e]] >= 0);
            cand[nc] = e, craw[nc++] = p->raw_of[slots[e]];
        }
    for (int32_t e = b0; e < b1; e++)
        if (p->state[slots[e]] == ST_BUF) tok[nt++] = e;
    for (int32_t l = 0; l < m->env.n_layers; l++)
        if (!p->full[l] && nt) compress_layer(m, l, slots, tok, nt, cand, craw, nc);
    for (int32_t i = 0; i < nt; i++) { /* the latent replaces the raw row */
        p->state[slots[tok[i]]] = ST_LATENT;
        raw_release(p, slots[tok[i]]);
    }
    free(cand), free(craw), free(tok);
}

static void dkv_finish(lethe_sparse_method *m, const lethe_sparse_step *st) {
    dkv_priv *p = PRIV(m);
    p->st = NULL;
    if (!m->env.be || p->first_dl < 0 || !p->raw_of) return;
    for (int32_t i = 0; i < st->n_seqs; i++) compress_seq(m, &st->seqs[i]);
}

/* ---- decode selection (OmniKV at the full layers) ---- */

static void dkv_prepare(lethe_sparse_method *m, const lethe_sparse_step *st) {
    dkv_priv *p = PRIV(m);
    p->st = st;
    if (st->n_seqs > p->cap_seqs) {
        p->cap_seqs = LETHE_MAX(st->n_seqs, 2 * p->cap_seqs);
        p->pick_begin = lethe_xrealloc(p->pick_begin, (size_t)p->cap_seqs * sizeof(int32_t));
        p->pick_n = lethe_xrealloc(p->pick_n, (size_t)p->cap_seqs * sizeof(int32_t));
        p->buf_start = lethe_xrealloc(p->buf_start, (size_t)p->cap_seqs * sizeof(int32_t));
        p->valid = lethe_xrealloc(p->valid, (size_t)p->cap_seqs * sizeof(bool));
    }
    memset(p->valid, 0, (size_t)st->n_seqs * sizeof(bool));
    /* the new tokens' slots may carry a previous owner's state: they are
     * buffer (or sink) tokens from now on, before any layer selects */
    if (!m->env.be || p->first_dl < 0) return;
    raw_init(m);
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        const int32_t L = lethe_kv_row_len(m->env.pool, 0, q->row);
        const int32_t *slots = lethe_kv_row_slots(m->env.pool, 0, q->row), *pos = lethe_kv_row_pos(m->env.pool, 0, q->row);
        for (int32_t e = L - q->n_new; e < L; e++) {
            p->state[slots[e]] = pos[e] < m->knobs.sink_keep_tokens ? ST_CENTER : ST_BUF;
            p->slot_pos[slots[e]] = pos[e];
        }
    }
}

static bool is_filter(const lethe_sparse_method *m, int32_t l) {
    const bool *full = PRIV(m)->full;
    return full[l] && l + 1 < m->env.n_layers && !full[l + 1];
}

static bool dkv_needs_scores(lethe_sparse_method *m, int32_t layer) {
    const dkv_priv *p = PRIV(m);
    if (!p->st || !m->env.be || !is_filter(m, layer) || !p->raw_of) return false;
    for (int32_t i = 0; i < p->st->n_seqs; i++)
        if (!p->st->seqs[i].is_prefill) return true;
    return false;
}

static void dkv_after_attn(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st,
                           const lethe_attn_args *attn) {
    dkv_priv *p = PRIV(m);
    if (!attn) return;
    const int32_t s = m->knobs.sink_keep_tokens, K = m->knobs.decode_keep_tokens;
    lethe_score_seq *req = lethe_xmalloc((size_t)st->n_seqs * sizeof(*req));
    int32_t n = 0, n_scores = 0, *which = lethe_xmalloc((size_t)st->n_seqs * sizeof(int32_t));
    for (int32_t i = 0; i < st->n_seqs; i++) {
        const lethe_sparse_seq *q = &st->seqs[i];
        p->valid[i] = false;
        if (q->is_prefill) continue;
        const int32_t L = lethe_kv_row_len(m->env.pool, 0, q->row);
        const int32_t b0 = buffer_start(p, lethe_kv_row_slots(m->env.pool, 0, q->row), L);
        if (b0 - s <= K) continue; /* every compressed token is read */
        LETHE_ASSERT(attn->sel_begin[i + 1] - attn->sel_begin[i] == L); /* a full layer reads all */
        p->buf_start[i] = b0;
        req[n] = (lethe_score_seq){.q_row = q->q_row + q->n_new - 1, .n_rows = 1, .key_begin = attn->sel_begin[i],
                                   .n_keys = L, .c0 = s, .c1 = b0,
                                   .mode = LETHE_SCORES_PROB_MAX | LETHE_SCORES_CAND_DENOM};
        which[n++] = i;
        n_scores += b0 - s;
    }
    float *sc = lethe_xmalloc((size_t)(n_scores ? n_scores : 1) * sizeof(float));
    if (n && lethe_sparse_scores(m, attn, req, n, 1, sc)) {
        grow_i32(&p->picks, &p->cap_picks, n * K);
        for (int32_t j = 0, off = 0, o = 0; j < n; j++) {
            const int32_t i = which[j], nc = req[j].c1 - req[j].c0;
            p->pick_begin[i] = o;
            p->pick_n[i] = lethe_topk_indices(sc + off, nc, K, p->picks + o); /* ascending */
            for (int32_t t = o; t < o + p->pick_n[i]; t++) p->picks[t] += s; /* row entries */
            o += p->pick_n[i];
            off += nc;
            p->valid[i] = true;
        }
    }
    free(sc), free(req), free(which);
}

/* DeltaKV layers of a published decode sequence read sink + picks + buffer */
static int32_t dkv_decode_sel(lethe_sparse_method *m, int32_t layer, const lethe_sparse_step *st, int32_t seq,
                              const void *q, int32_t *sel, int32_t cap) {
    dkv_priv *p = PRIV(m);
    const lethe_sparse_seq *sq = &st->seqs[seq];
    if (p->full[layer] || !p->valid || !p->valid[seq]) return lethe_sparse_select_all(m, layer, sq->row, sel, cap);
    const int32_t L = lethe_kv_row_len(m->env.pool, 0, sq->row), s = m->knobs.sink_keep_tokens;
    const int32_t *slots = lethe_kv_row_slots(m->env.pool, 0, sq->row), b0 = p->buf_start[seq];
    int32_t n = 0;
    for (int32_t e = 0; e < s && e < L; e++) sel[n++] = slots[e];
    for (int32_t t = 0; t < p->pick_n[seq]; t++) sel[n++] = slots[p->picks[p->pick_begin[seq] + t]];
    for (int32_t e = b0; e < L; e++) sel[n++] = slots[e];
    LETHE_ASSERT(n <= cap);
    return n;
}

const lethe_sparse_ops lethe_sparse_deltakv = {
    .name = "deltakv",
    .summary = "residual latents of pre-RoPE KV against nearest center tokens (fitted compressor); full layers "
               "pick the top tokens the others reconstruct",
    .kind = LETHE_SPARSE_KIND_COMPRESSION,
    .flags = LETHE_SPARSE_KV_PRE_ROPE,
    .shared_knobs = LETHE_USES_SINK | LETHE_USES_RECENT | LETHE_USES_KEEP,
    .knob_table = knobs,
    .n_knob_table = (int32_t)LETHE_ARRAY_LEN(knobs),
    /* identity: a buffer longer than any test context (nothing compressed, raw
     * reads equal dense's bit for bit); small: identity compressor, blocks of
     * 8, top-16 selection (compression, fathers and selection all run) */
    .test_configs = {.identity = "deltakv_compressor=@identity,recent_keep_tokens=256,deltakv_full_layers=0",
                     .small = "deltakv_compressor=@identity,sink_keep_tokens=4,recent_keep_tokens=8,"
                              "decode_keep_tokens=16,deltakv_full_layers=0"},
    .init = dkv_init,
    .configure = dkv_configure,
    .destroy = dkv_destroy,
    .set_knob = dkv_set_knob,
    .slot_overhead_bytes = dkv_slot_overhead,
    .kv_reserve_bytes = dkv_reserve,
    .kv_layout = dkv_layout,
    .kv_store = dkv_store,
    .kv_attend = dkv_attend,
    .prepare = dkv_prepare,
    .finish_step = dkv_finish,
    .needs_scores = dkv_needs_scores,
    .after_attn = dkv_after_attn,
    .build_decode_selection = dkv_decode_sel,
};
