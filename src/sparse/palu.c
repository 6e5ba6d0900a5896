/* palu.c - Palu (methods.md §14): low-rank latent KV.
 *
 * Per layer and group of gs KV heads (G-LRD; gs = 1 is SparseEngine's
 * default), offline factors from `lethe fit palu` (tools/fit_palu.c:
 * whitened SVD of the group's k_proj / v_proj rows): k_down [r, gs hd] maps
 * the group's pre-RoPE keys to an r-dim latent, k_up [gs hd, r]
 * reconstructs them (likewise v_down / v_up). The slot stores only the
 * latents (a payload layout of its own: planes "k_latent" and "v_latent",
 * n_groups r kv elements each per layer), so a token costs
 * 2 L n_groups r kv_size bytes instead of 2 L KH hd kv_size.
 *
 * Store (kv_store, keys before RoPE: LETHE_SPARSE_KV_PRE_ROPE): latents =
 * k k_down^T, v v_down^T ([n, n_groups r], one matmul each with the
 * block-diagonal down matrices) into the planes; the slot's position is kept
 * in a host table (RoPE is applied at read time).
 * Attend (kv_attend): the selection's latents are gathered ([n_sel, n_groups
 * r]), keys reconstructed (k_up) and RoPE'd at their own positions (RoPE
 * cannot be absorbed), values stay latent: each KV head's row of a scratch V
 * holds its group's latent in its first r dims (a 0/1 embedding matmul), so
 * the backend's attention op yields, per query head h, a_h = sum_j p_hj
 * h_v,j (zero-padded); the output projection is the absorbed W'_o = W_o
 * blockdiag_h(v_up rows of h's KV head) ([dim, n_heads hd], computed once on
 * the backend: kv_out_proj), so out = W'_o a = W_o (v_up a) without ever
 * reconstructing a value. Needs r <= head_dim for the padding.
 *
 * Factors: palu_factors=DIR with DIR/palu.json ({"format": "lethe-palu-1",
 * n_layers, n_kv_heads, head_dim, group_size, ranks: [r per layer], ...})
 * and DIR/palu.safetensors (F32 "layers.L.k_down" [n_groups, r, gs hd],
 * "layers.L.k_up" [n_groups, gs hd, r], "layers.L.v_down", "layers.L.v_up").
 * palu_rank=R keeps the leading R latent dims of fitted factors (the rank-R
 * whitened SVD: one full-rank fit serves every compression level).
 * palu_factors=@identity: full rank, identity factors (no compression; equals
 * dense bit for bit on the CPU: the test configuration). Without factors the
 * method refuses to start, naming `lethe fit palu`.
 *
 * Limits: reconstruction scratch per layer of n_sel x (2 n_groups r + 2 KH
 * hd) activations (all of a step's selected tokens); ranks per layer equal
 * for K and V; no latent quantization; no Fisher rank search. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/json.h"
#include "core/util.h"
#include "model/safetensors.h"
#include "sparse/sparse.h"

typedef struct palu_layer {
    int32_t r;          /* latent dims per group, K and V */
    void *k_down, *v_down; /* weights [n_groups r, kv_dim] block diagonal */
    void *k_up;         /* [kv_dim, n_groups r] */
    void *v_embed;      /* [kv_dim, n_groups r]: group latent -> first r dims of each member head */
    void *wo;           /* absorbed output projection [dim, n_heads hd], NULL without a model */
} palu_layer;

typedef struct palu_priv {
    lethe_knob_values kv;
    int32_t gs, n_groups, kv_dim;
    palu_layer *layers;
    bool identity;
    /* device scratch */
    lethe_dev_buf lat_k, lat_v, gk, gv, krec, vpad;
    /* host: position of every slot (written at store), positions / identity selection of a call */
    int32_t *slot_pos, n_slot_pos;
    int32_t *sel_pos, *iota, cap_sel;
} palu_priv;
#define PRIV(m) ((palu_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"palu_factors", LETHE_KNOB_STR, "none", 0, 0,
     "folder of palu.json + palu.safetensors (`lethe fit palu`), or @identity (full rank); none = refuse"},
    {"palu_rank", LETHE_KNOB_INT, "0", 0, 4096,
     "keep the first palu_rank latent dims of every group (0 = the file's ranks; at most them)"},
};

static lethe_status palu_init(lethe_sparse_method *m) {
    palu_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}

static void palu_destroy(lethe_sparse_method *m) {
    palu_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    for (int32_t l = 0; p->layers && l < m->env.n_layers; l++) {
        void *w[5] = {p->layers[l].k_down, p->layers[l].v_down, p->layers[l].k_up, p->layers[l].v_embed,
                      p->layers[l].wo};
        for (int i = 0; i < 5; i++)
            if (w[i]) be->ops->release(be, w[i]);
    }
    lethe_dev_buf *bufs[6] = {&p->lat_k, &p->lat_v, &p->gk, &p->gv, &p->krec, &p->vpad};
    for (int i = 0; i < 6; i++) lethe_dev_buf_free(m, bufs[i]);
    free(p->layers), free(p->slot_pos), free(p->sel_pos), free(p->iota);
    free(p);
    m->priv = NULL;
}

static lethe_status palu_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

/* ---- factors -> backend weights ---- */

static lethe_status upload(const lethe_sparse_method *m, const float *host, size_t n, void **out) {
    return m->env.be->ops->weight_upload(m->env.be, host, n, out);
}

/* per-group blocks [n_groups][rows][cols] -> block-diagonal [n_groups rows, n_groups cols] */
static float *block_diag(const float *blocks, int32_t n_groups, int32_t rows, int32_t cols) {
    const size_t R = (size_t)n_groups * rows, C = (size_t)n_groups * cols;
    float *w = lethe_xcalloc(R * C, sizeof(float));
    for (int32_t g = 0; g < n_groups; g++)
        for (int32_t i = 0; i < rows; i++)
            memcpy(w + ((size_t)g * rows + i) * C + (size_t)g * cols, blocks + ((size_t)g * rows + i) * cols,
                   (size_t)cols * sizeof(float));
    return w;
}

/* The absorbed W'_o = W_o B with B [H hd, H hd] block diagonal over query
 * heads: block h = v_up rows of h's KV head [hd, r] padded to hd columns.
 * On the backend: matmul(y = x W^T) with x = W_o (a weight in the backend's
 * activation format: f32 on the CPU, bf16 on CUDA, the same element type)
 * and W = B^T. */
static lethe_status absorb_wo(lethe_sparse_method *m, int32_t l, const float *v_up) {
    palu_priv *p = PRIV(m);
    const lethe_sparse_env *env = &m->env;
    const int32_t hd = env->head_dim, H = env->n_heads, G = H / env->n_kv_heads, r = p->layers[l].r;
    const int32_t gd = p->gs * hd, qd = H * hd;
    float *bt = lethe_xcalloc((size_t)qd * qd, sizeof(float)); /* B^T [(h, i), (h, c)] = v_up_h[c][i] */
    for (int32_t h = 0; h < H; h++) {
        const int32_t kh = h / G, g = kh / p->gs, mi = kh % p->gs;
        const float *up = v_up + (size_t)g * gd * r; /* [gd, r] */
        for (int32_t i = 0; i < r; i++)
            for (int32_t c = 0; c < hd; c++)
                bt[((size_t)h * hd + i) * qd + (size_t)h * hd + c] = up[(size_t)(mi * hd + c) * r + i];
    }
    void *w = NULL;
    lethe_status st = upload(m, bt, (size_t)qd * qd, &w);
    free(bt);
    if (st != LETHE_OK) return st;
    lethe_backend *be = env->be;
    st = be->ops->alloc(be, (size_t)env->dim * qd * be->ops->act_size, &p->layers[l].wo);
    if (st == LETHE_OK) be->ops->matmul(be, p->layers[l].wo, env->model->w.layers[l].wo, w, env->dim, qd, qd);
    be->ops->sync(be);
    be->ops->release(be, w);
    return st;
}

/* one layer's factors (blocks as in the file) onto the backend */
static lethe_status load_layer(lethe_sparse_method *m, int32_t l, int32_t r, const float *k_down,
                               const float *k_up, const float *v_down, const float *v_up) {
    palu_priv *p = PRIV(m);
    const int32_t hd = m->env.head_dim, gd = p->gs * hd, ng = p->n_groups;
    if (r < 1 || r > hd)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "palu: layer %d rank %d: must be in [1, head_dim %d] (the "
                            "values' latent is padded into a head)", l, r, hd);
    palu_layer *L = &p->layers[l];
    L->r = r;
    float *w;
    lethe_status st;
    w = block_diag(k_down, ng, r, gd);
    st = upload(m, w, (size_t)ng * r * p->kv_dim, &L->k_down);
    free(w);
    if (st == LETHE_OK) {
        w = block_diag(v_down, ng, r, gd);
        st = upload(m, w, (size_t)ng * r * p->kv_dim, &L->v_down);
        free(w);
    }
    if (st == LETHE_OK) {
        w = block_diag(k_up, ng, gd, r);
        st = upload(m, w, (size_t)p->kv_dim * ng * r, &L->k_up);
        free(w);
    }
    if (st == LETHE_OK) { /* E[(kh, i), (g, j)] = 1 for g = group of kh, i = j < r */
        w = lethe_xcalloc((size_t)p->kv_dim * ng * r, sizeof(float));
        for (int32_t kh = 0; kh < m->env.n_kv_heads; kh++)
            for (int32_t i = 0; i < r; i++) w[((size_t)kh * hd + i) * ng * r + (size_t)(kh / p->gs) * r + i] = 1.0f;
        st = upload(m, w, (size_t)p->kv_dim * ng * r, &L->v_embed);
        free(w);
    }
    if (st == LETHE_OK && m->env.model) st = absorb_wo(m, l, v_up);
    return st;
}

static lethe_status load_identity(lethe_sparse_method *m) {
    const int32_t hd = m->env.head_dim, KH = m->env.n_kv_heads;
    float *eye = lethe_xcalloc((size_t)KH * hd * hd, sizeof(float)); /* KH blocks of I [hd, hd] */
    for (int32_t g = 0; g < KH; g++)
        for (int32_t i = 0; i < hd; i++) eye[((size_t)g * hd + i) * hd + i] = 1.0f;
    lethe_status st = LETHE_OK;
    for (int32_t l = 0; l < m->env.n_layers && st == LETHE_OK; l++) st = load_layer(m, l, hd, eye, eye, eye, eye);
    free(eye);
    return st;
}

static const lethe_st_tensor *want_tensor(const lethe_safetensors *st, const char *path, int32_t l,
                                          const char *what, int64_t d0, int64_t d1, int64_t d2,
                                          lethe_status *err) {
    char name[64];
    snprintf(name, sizeof(name), "layers.%d.%s", l, what);
    const lethe_st_tensor *t = lethe_st_find(st, name);
    if (!t || t->n_dims != 3 || t->shape[0] != d0 || t->shape[1] != d1 || t->shape[2] != d2) {
        *err = lethe_errorf(LETHE_ERR_FORMAT, "palu: %s: tensor %s %s (want [%lld, %lld, %lld])", path, name,
                            t ? "has another shape" : "is missing", (long long)d0, (long long)d1, (long long)d2);
        return NULL;
    }
    return t;
}

static int32_t json_int(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
}

/* the leading r2 of r latent dims (the factors are ordered by singular value,
 * so this is the rank-r2 solution): down [ng][r][gd] -> [ng][r2][gd], up
 * [ng][gd][r] -> [ng][gd][r2], in place */
static void truncate_rank(float *down, float *up, int32_t ng, int32_t gd, int32_t r, int32_t r2) {
    for (int32_t g = 0; g < ng; g++)
        memmove(down + (size_t)g * r2 * gd, down + (size_t)g * r * gd, (size_t)r2 * gd * sizeof(float));
    for (int32_t g = 0; g < ng; g++)
        for (int32_t c = 0; c < gd; c++)
            memmove(up + ((size_t)g * gd + c) * r2, up + ((size_t)g * gd + c) * r, (size_t)r2 * sizeof(float));
}

static lethe_status load_dir(lethe_sparse_method *m, const char *dir) {
    palu_priv *p = PRIV(m);
    const lethe_sparse_env *env = &m->env;
    char path[1024], tpath[1024];
    snprintf(path, sizeof(path), "%s/palu.json", dir);
    snprintf(tpath, sizeof(tpath), "%s/palu.safetensors", dir);
    char *text = NULL;
    size_t n = 0;
    if (lethe_read_file(path, &text, &n) != LETHE_OK)
        return lethe_errorf(LETHE_ERR_IO, "palu: no factors at %s: make them with `lethe fit palu MODEL --calib "
                            "TEXT --out %s`", path, dir);
    cJSON *root = cJSON_ParseWithLength(text, n);
    free(text);
    lethe_status st = LETHE_OK;
    const cJSON *fmt = root ? cJSON_GetObjectItemCaseSensitive(root, "format") : NULL;
    const cJSON *ranks = root ? cJSON_GetObjectItemCaseSensitive(root, "ranks") : NULL;
    if (!root || !cJSON_IsString(fmt) || strcmp(fmt->valuestring, "lethe-palu-1") || !cJSON_IsArray(ranks)) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "palu: %s is not a lethe-palu-1 factors file", path);
        goto out;
    }
    p->gs = json_int(root, "group_size");
    if (json_int(root, "n_layers") != env->n_layers || json_int(root, "n_kv_heads") != env->n_kv_heads ||
        json_int(root, "head_dim") != env->head_dim || p->gs < 1 || env->n_kv_heads % p->gs ||
        cJSON_GetArraySize(ranks) != env->n_layers) {
        st = lethe_errorf(LETHE_ERR_FORMAT, "palu: %s was fitted for another shape (layers %d, KV heads %d, "
                          "head_dim %d, group %d; this model: %d, %d, %d)", path, json_int(root, "n_layers"),
                          json_int(root, "n_kv_heads"), json_int(root, "head_dim"), p->gs, env->n_layers,
                          env->n_kv_heads, env->head_dim);
        goto out;
    }
    p->n_groups = env->n_kv_heads / p->gs;
    lethe_safetensors sf;
    memset(&sf, 0, sizeof(sf));
    if ((st = lethe_st_open_file(tpath, &sf)) != LETHE_OK) {
        st = lethe_errorf(st, "palu: %s", lethe_last_error());
        goto out;
    }
    const int32_t gd = p->gs * env->head_dim, ng = p->n_groups;
    for (int32_t l = 0; l < env->n_layers && st == LETHE_OK; l++) {
        const int32_t r = (int32_t)cJSON_GetArrayItem(ranks, l)->valuedouble;
        const lethe_st_tensor *t[4] = {
            want_tensor(&sf, tpath, l, "k_down", ng, r, gd, &st), want_tensor(&sf, tpath, l, "k_up", ng, gd, r, &st),
            want_tensor(&sf, tpath, l, "v_down", ng, r, gd, &st), want_tensor(&sf, tpath, l, "v_up", ng, gd, r, &st)};
        if (!t[0] || !t[1] || !t[2] || !t[3]) break;
        float *f[4];
        for (int i = 0; i < 4; i++) {
            f[i] = lethe_xmalloc(t[i]->n_elems * sizeof(float));
            if (st == LETHE_OK) st = lethe_st_to_f32(&sf, t[i], f[i]);
        }
        const int32_t want = (int32_t)lethe_knob_num(m->ops, &p->kv, "palu_rank"), r2 = want ? want : r;
        if (st == LETHE_OK && r2 > r)
            st = lethe_errorf(LETHE_ERR_INVALID, "--sparse-config palu_rank=%d: %s layer %d has rank %d (fit a "
                              "higher --rank-ratio)", want, tpath, l, r);
        if (st == LETHE_OK && r2 < r) {
            truncate_rank(f[0], f[1], ng, gd, r, r2);
            truncate_rank(f[2], f[3], ng, gd, r, r2);
        }
        if (st == LETHE_OK) st = load_layer(m, l, r2, f[0], f[1], f[2], f[3]);
        for (int i = 0; i < 4; i++) free(f[i]);
    }
    lethe_st_close(&sf);
out:
    cJSON_Delete(root);
    return st;
}

static lethe_status palu_configure(lethe_sparse_method *m) {
    palu_priv *p = PRIV(m);
    const char *src = lethe_knob_str(m->ops, &p->kv, "palu_factors");
    p->kv_dim = m->env.n_kv_heads * m->env.head_dim;
    if (!*src || !strcmp(src, "none"))
        return lethe_errorf(LETHE_ERR_INVALID, "palu needs its factors: --sparse-config palu_factors=DIR (the "
                            "folder `lethe fit palu MODEL` writes), or palu_factors=@identity (full rank, no "
                            "compression)");
    if (!m->env.be) return LETHE_OK; /* the fake model: bookkeeping only */
    p->layers = lethe_xcalloc((size_t)m->env.n_layers, sizeof(palu_layer));
    p->identity = !strcmp(src, "@identity");
    if (p->identity) {
        p->gs = 1;
        p->n_groups = m->env.n_kv_heads;
        return load_identity(m);
    }
    return load_dir(m, src);
}

/* ---- the payload and its path ---- */

static bool palu_layout(const lethe_sparse_method *m, int32_t layer, lethe_kv_layout *out) {
    const palu_priv *p = PRIV(m);
    if (!m->env.be) return false;
    const size_t b = (size_t)p->n_groups * p->layers[layer].r * m->env.be->ops->kv_size;
    *out = (lethe_kv_layout){.n_planes = 2, .planes = {{"k_latent", b}, {"v_latent", b}}};
    return true;
}

static void reserve(lethe_sparse_method *m, lethe_dev_buf *b, size_t elems) {
    lethe_status st = lethe_dev_buf_reserve(m, b, elems * m->env.be->ops->act_size);
    LETHE_ASSERT(st == LETHE_OK); /* scratch of one step's tokens */
}

static void palu_store(lethe_sparse_method *m, int32_t layer, const void *k, const void *v,
                       const int32_t *slots, const int32_t *pos, int32_t n) {
    palu_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    const palu_layer *L = &p->layers[layer];
    const int32_t rt = p->n_groups * L->r;
    if (p->n_slot_pos < lethe_kv_n_slots(m->env.pool)) {
        p->n_slot_pos = lethe_kv_n_slots(m->env.pool);
        p->slot_pos = lethe_xrealloc(p->slot_pos, (size_t)p->n_slot_pos * sizeof(int32_t));
    }
    for (int32_t i = 0; i < n; i++) p->slot_pos[slots[i]] = pos[i];
    reserve(m, &p->lat_k, (size_t)n * rt);
    reserve(m, &p->lat_v, (size_t)n * rt);
    be->ops->matmul(be, p->lat_k.p, k, L->k_down, n, rt, p->kv_dim); /* [n, rt] = k k_down^T */
    be->ops->matmul(be, p->lat_v.p, v, L->v_down, n, rt, p->kv_dim);
    be->ops->kv_store(be, lethe_kv_plane_buf(m->env.pool, layer, 0), lethe_kv_plane_buf(m->env.pool, layer, 1),
                      p->lat_k.p, p->lat_v.p, slots, n, rt);
}

static void palu_attend(lethe_sparse_method *m, int32_t layer, const lethe_attn_args *a) {
    palu_priv *p = PRIV(m);
    lethe_backend *be = m->env.be;
    const palu_layer *L = &p->layers[layer];
    const int32_t rt = p->n_groups * L->r, n_sel = a->sel_begin[a->n_seqs];
    if (n_sel > p->cap_sel) {
        p->cap_sel = LETHE_MAX(n_sel, p->cap_sel + p->cap_sel / 4);
        p->sel_pos = lethe_xrealloc(p->sel_pos, (size_t)p->cap_sel * sizeof(int32_t));
        p->iota = lethe_xrealloc(p->iota, (size_t)p->cap_sel * sizeof(int32_t));
        for (int32_t i = 0; i < p->cap_sel; i++) p->iota[i] = i;
    }
    for (int32_t e = 0; e < n_sel; e++) p->sel_pos[e] = p->slot_pos[a->sel_slots[e]];
    reserve(m, &p->gk, (size_t)n_sel * rt);
    reserve(m, &p->gv, (size_t)n_sel * rt);
    reserve(m, &p->krec, (size_t)n_sel * p->kv_dim);
    reserve(m, &p->vpad, (size_t)n_sel * p->kv_dim);
    /* latents of the selection (kv elements = activations on both backends) */
    be->ops->gather_rows(be, p->gk.p, a->k_cache, a->sel_slots, n_sel, rt);
    be->ops->gather_rows(be, p->gv.p, a->v_cache, a->sel_slots, n_sel, rt);
    be->ops->matmul(be, p->krec.p, p->gk.p, L->k_up, n_sel, p->kv_dim, rt); /* keys, pre-RoPE */
    if (m->env.rope)
        be->ops->rope(be, p->krec.p, p->sel_pos, n_sel, m->env.n_kv_heads, m->env.head_dim, m->env.rope);
    be->ops->matmul(be, p->vpad.p, p->gv.p, L->v_embed, n_sel, p->kv_dim, rt); /* latents, padded */
    lethe_attn_args d = *a; /* the same sequences over scratch rows 0 .. n_sel - 1 */
    d.k_cache = p->krec.p;
    d.v_cache = p->vpad.p;
    d.sel_slots = p->iota;
    d.kvq = NULL;
    be->ops->attention(be, &d);
}

static const void *palu_out_proj(lethe_sparse_method *m, int32_t layer) { return PRIV(m)->layers[layer].wo; }

const lethe_sparse_ops lethe_sparse_palu = {
    .name = "palu",
    .summary = "low-rank latent K and V (fitted factors): keys reconstructed and RoPE'd in attention, values "
               "absorbed into the output projection",
    .kind = LETHE_SPARSE_KIND_COMPRESSION,
    .flags = LETHE_SPARSE_PREFIX_CACHE | LETHE_SPARSE_KV_PRE_ROPE | LETHE_SPARSE_F32_WEIGHTS,
    .knob_table = knobs,
    .n_knob_table = (int32_t)LETHE_ARRAY_LEN(knobs),
    .test_configs = {.identity = "palu_factors=@identity"},
    .init = palu_init,
    .configure = palu_configure,
    .destroy = palu_destroy,
    .set_knob = palu_set_knob,
    .kv_layout = palu_layout,
    .kv_store = palu_store,
    .kv_attend = palu_attend,
    .kv_out_proj = palu_out_proj,
    .hybrid_refusal = "it folds its value factors into the output projection, so the per-head "
                      "attention outputs the output gate multiplies are never formed",
};
