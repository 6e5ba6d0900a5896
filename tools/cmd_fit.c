/* cmd_fit.c - `lethe fit <method> MODEL ...`: fits the offline assets a
 * sparse method needs from the model's own weights and a calibration text,
 * so no checkpoint made elsewhere is required. One file per method
 * (fit_<method>.c); this file dispatches and holds what they share: the
 * model on a backend (CPU by default, --device cuda for big models), the calibration tokens, and a forward over them
 * that hands every layer's pre-RoPE k and v to a callback. */
#include "fit.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "commands.h"
#include "core/util.h"

/* ---- calibration text ---- */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* the text of FILE, or of every *.txt in DIR (sorted by name), concatenated */
static lethe_status read_calib(const char *path, lethe_sbuf *out) {
    DIR *d = opendir(path);
    if (!d) {
        char *t = NULL;
        size_t n = 0;
        if (lethe_read_file(path, &t, &n) != LETHE_OK)
            return lethe_errorf(LETHE_ERR_IO, "--calib %s: %s", path, lethe_last_error());
        lethe_sbuf_add(out, t, n);
        lethe_sbuf_add(out, "\n\n", 2);
        free(t);
        return LETHE_OK;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".txt")) continue;
        if (n == cap) names = lethe_xrealloc(names, (cap = cap ? 2 * cap : 64) * sizeof(char *));
        names[n++] = lethe_xstrdup(e->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof(char *), cmp_str);
    lethe_status st = n ? LETHE_OK : lethe_errorf(LETHE_ERR_IO, "--calib %s: no .txt files", path);
    for (size_t i = 0; i < n; i++) {
        char full[4096];
        snprintf(full, sizeof(full), "%s/%s", path, names[i]);
        if (st == LETHE_OK) st = read_calib(full, out);
        free(names[i]);
    }
    free(names);
    return st;
}

static bool is_ids(const char *path) {
    const size_t n = strlen(path);
    return n > 4 && !strcmp(path + n - 4, ".ids");
}

/* token ids of a .ids file (whitespace-separated integers in [0, n_vocab)),
 * appended to c->ids: calibration for models without a tokenizer */
static lethe_status read_ids(const char *path, int32_t n_vocab, lethe_fit_ctx *c, int32_t *cap) {
    char *t = NULL;
    size_t n = 0;
    if (lethe_read_file(path, &t, &n) != LETHE_OK)
        return lethe_errorf(LETHE_ERR_IO, "--calib %s: %s", path, lethe_last_error());
    lethe_status st = LETHE_OK;
    for (char *p = t, *end; st == LETHE_OK; p = end) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (!*p) break;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v >= n_vocab) {
            st = lethe_errorf(LETHE_ERR_INVALID, "--calib %s: token %d is not an id below the vocabulary "
                              "size %d", path, c->n_ids, n_vocab);
            break;
        }
        if (c->n_ids == *cap) c->ids = lethe_xrealloc(c->ids, (size_t)(*cap = *cap ? 2 * *cap : 4096) * sizeof(int32_t));
        c->ids[c->n_ids++] = (int32_t)v;
    }
    free(t);
    return st;
}

lethe_status lethe_fit_open(const lethe_fit_params *fp, lethe_fit_ctx *c) {
    memset(c, 0, sizeof(*c));
    lethe_backend_params bp = {.device = fp->device ? fp->device : "cpu", .n_threads = fp->threads};
    lethe_status st = lethe_backend_create(&bp, &c->be);
    if (st != LETHE_OK) return st;
    lethe_model_load_params lp = {.path = fp->model, .format = LETHE_LOAD_AUTO, .seed = fp->seed};
    if (fp->load_format && (st = lethe_load_format_parse(fp->load_format, &lp.format)) != LETHE_OK) return st;
    if ((st = lethe_model_load(&lp, c->be, &c->model)) != LETHE_OK) return st;
    c->loaded = true;
    if ((st = lethe_model_workspace_init(&c->model, fp->seq_len)) != LETHE_OK) return st;
    /* token ids (*.ids: models without a tokenizer, e.g. the tests' tiny
     * checkpoints) or text; not both */
    int n_ids_files = 0;
    for (int i = 0; i < fp->n_calib; i++) n_ids_files += is_ids(fp->calib[i]);
    if (n_ids_files && n_ids_files != fp->n_calib)
        return lethe_errorf(LETHE_ERR_INVALID, "lethe fit: --calib mixes .ids files and text");
    if (n_ids_files) {
        int32_t cap = 0;
        for (int i = 0; i < fp->n_calib && st == LETHE_OK; i++)
            st = read_ids(fp->calib[i], c->model.cfg.n_vocab, c, &cap);
        if (st != LETHE_OK) return st;
    } else if ((st = lethe_tokenizer_load(fp->tokenizer ? fp->tokenizer : fp->model, &c->tok)) != LETHE_OK)
        return lethe_errorf(st, "lethe fit: the calibration text needs the model's tokenizer: %s", lethe_last_error());
    if (!n_ids_files) {
        lethe_sbuf text = {0};
        for (int i = 0; i < fp->n_calib && st == LETHE_OK; i++) st = read_calib(fp->calib[i], &text);
        if (st == LETHE_OK && !text.n) st = lethe_errorf(LETHE_ERR_INVALID, "lethe fit: no calibration text (--calib)");
        if (st == LETHE_OK) st = lethe_tokenize(c->tok, text.s, text.n, false, false, &c->ids, &c->n_ids);
        free(text.s);
        if (st != LETHE_OK) return st;
    }
    const int64_t want = (int64_t)fp->samples * fp->seq_len;
    if (c->n_ids < fp->seq_len)
        return lethe_errorf(LETHE_ERR_INVALID, "lethe fit: %d calibration tokens, fewer than --seq-len %d", c->n_ids,
                            fp->seq_len);
    c->n_samples = (int32_t)LETHE_MIN((int64_t)fp->samples, c->n_ids / fp->seq_len);
    if (c->n_samples * (int64_t)fp->seq_len < want)
        fprintf(stderr, "lethe fit: %d calibration tokens: %d samples of %d (asked %d)\n", c->n_ids, c->n_samples,
                fp->seq_len, fp->samples);
    return LETHE_OK;
}

void lethe_fit_close(lethe_fit_ctx *c) {
    if (c->loaded) lethe_model_free(&c->model);
    if (c->tok) lethe_tokenizer_free(c->tok);
    free(c->ids);
    lethe_backend_destroy(c->be);
    memset(c, 0, sizeof(*c));
}

/* ---- the forward: dense attention over a private cache, k / v to the callback ---- */

typedef struct fwd_ctx {
    lethe_fit_ctx *c;
    const lethe_fit_params *fp;
    lethe_fit_kv_fn fn;
    void *user;
    int32_t T;
    int32_t *slots, sel_begin[2];
    void **kc, **vc; /* [n_layers] caches [T, kv_dim] */
    float *hk, *hv;  /* host copies [T, kv_dim] */
    void *krot;      /* backend copy of k to rotate */
    lethe_kv_path path;
} fwd_ctx;

static void fwd_store(void *ctx, int32_t layer, const void *k, const void *v, const int32_t *slots,
                      const int32_t *pos, int32_t n) {
    fwd_ctx *f = ctx;
    lethe_backend *be = f->c->be;
    const lethe_model_config *cfg = &f->c->model.cfg;
    const size_t kvd = (size_t)cfg->n_kv_heads * cfg->head_dim;
    be->ops->act_to_host(be, f->hk, k, (size_t)n * kvd);
    be->ops->act_to_host(be, f->hv, v, (size_t)n * kvd);
    f->fn(f->user, layer, f->hk, f->hv, n);
    be->ops->act_from_host(be, f->krot, f->hk, (size_t)n * kvd); /* the model's RoPE, then the cache */
    be->ops->rope(be, f->krot, pos, n, cfg->n_kv_heads, cfg->head_dim, &cfg->rope);
    be->ops->kv_store(be, f->kc[layer], f->vc[layer], f->krot, v, slots, n, (int32_t)kvd);
}

static void fwd_attend(void *ctx, int32_t layer, const lethe_attn_args *a) {
    fwd_ctx *f = ctx;
    f->c->be->ops->attention(f->c->be, a);
}

static void fwd_plan(void *ctx, int32_t layer, const lethe_fwd_batch *b, const void *q, lethe_layer_plan *out) {
    fwd_ctx *f = ctx;
    *out = (lethe_layer_plan){.store_slots = f->slots, .sel_begin = f->sel_begin, .sel_slots = f->slots,
                              .path = &f->path};
}

lethe_status lethe_fit_forward(lethe_fit_ctx *c, const lethe_fit_params *fp, lethe_fit_kv_fn fn, void *user) {
    const lethe_model_config *cfg = &c->model.cfg;
    lethe_backend *be = c->be;
    const int32_t T = fp->seq_len, L = cfg->n_layers;
    const size_t kvd = (size_t)cfg->n_kv_heads * cfg->head_dim;
    fwd_ctx f = {.c = c, .fp = fp, .fn = fn, .user = user, .T = T, .sel_begin = {0, T}};
    f.path = (lethe_kv_path){.ctx = &f, .k_pre_rope = true, .store = fwd_store, .attend = fwd_attend};
    f.slots = lethe_xmalloc((size_t)T * sizeof(int32_t));
    for (int32_t i = 0; i < T; i++) f.slots[i] = i;
    f.kc = lethe_xcalloc((size_t)L, sizeof(void *));
    f.vc = lethe_xcalloc((size_t)L, sizeof(void *));
    f.hk = lethe_xmalloc((size_t)T * kvd * sizeof(float));
    f.hv = lethe_xmalloc((size_t)T * kvd * sizeof(float));
    lethe_status st = be->ops->alloc(be, (size_t)T * kvd * be->ops->act_size, &f.krot);
    for (int32_t l = 0; l < L && st == LETHE_OK; l++) {
        st = be->ops->alloc(be, (size_t)T * kvd * be->ops->kv_size, &f.kc[l]);
        if (st == LETHE_OK) st = be->ops->alloc(be, (size_t)T * kvd * be->ops->kv_size, &f.vc[l]);
    }
    int32_t *pos = lethe_xmalloc((size_t)T * sizeof(int32_t)), seq_begin[2] = {0, T};
    for (int32_t i = 0; i < T; i++) pos[i] = i;
    const lethe_fwd_hooks hooks = {.ctx = &f, .plan_layer = fwd_plan};
    for (int32_t s = 0; s < c->n_samples && st == LETHE_OK; s++) {
        lethe_fwd_batch b = {.n_tokens = T, .tokens = c->ids + (size_t)s * T, .pos = pos, .n_seqs = 1,
                             .seq_begin = seq_begin, .n_logits = 0};
        lethe_model_forward(&c->model, &b, f.kc, f.vc, &hooks, NULL);
        fprintf(stderr, "\rlethe fit: calibration sample %d / %d", s + 1, c->n_samples);
    }
    fprintf(stderr, "\n");
    for (int32_t l = 0; l < L; l++) {
        if (f.kc[l]) be->ops->release(be, f.kc[l]);
        if (f.vc[l]) be->ops->release(be, f.vc[l]);
    }
    if (f.krot) be->ops->release(be, f.krot);
    free(f.kc), free(f.vc), free(f.hk), free(f.hv), free(f.slots), free(pos);
    return st;
}

/* cyclic Jacobi: A [n][n] symmetric (destroyed) -> eigenvalues w (descending)
 * and eigenvectors as the columns of V */
void lethe_fit_jacobi(double *A, int n, double *w, double *V) {
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) V[i * n + j] = i == j;
    for (int sweep = 0; sweep < 60; sweep++) {
        double off = 0, diag = 0;
        for (int i = 0; i < n; i++) {
            diag += A[i * n + i] * A[i * n + i];
            for (int j = i + 1; j < n; j++) off += A[i * n + j] * A[i * n + j];
        }
        if (off <= 1e-30 * diag) break;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                const double apq = A[p * n + q];
                if (fabs(apq) < 1e-300) continue;
                const double theta = (A[q * n + q] - A[p * n + p]) / (2 * apq);
                const double t = (theta >= 0 ? 1 : -1) / (fabs(theta) + sqrt(theta * theta + 1));
                const double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) { /* A = J^T A J */
                    const double akp = A[k * n + p], akq = A[k * n + q];
                    A[k * n + p] = c * akp - s * akq;
                    A[k * n + q] = s * akp + c * akq;
                }
                for (int k = 0; k < n; k++) {
                    const double apk = A[p * n + k], aqk = A[q * n + k];
                    A[p * n + k] = c * apk - s * aqk;
                    A[q * n + k] = s * apk + c * aqk;
                }
                for (int k = 0; k < n; k++) {
                    const double vkp = V[k * n + p], vkq = V[k * n + q];
                    V[k * n + p] = c * vkp - s * vkq;
                    V[k * n + q] = s * vkp + c * vkq;
                }
            }
    }
    int *ord = lethe_xmalloc((size_t)n * sizeof(int));
    for (int i = 0; i < n; i++) ord[i] = i;
    for (int i = 0; i < n; i++) /* selection sort, descending (n <= 256) */
        for (int j = i + 1; j < n; j++)
            if (A[ord[j] * n + ord[j]] > A[ord[i] * n + ord[i]]) {
                int t = ord[i];
                ord[i] = ord[j], ord[j] = t;
            }
    double *Vs = lethe_xmalloc((size_t)n * n * sizeof(double));
    for (int i = 0; i < n; i++) {
        w[i] = A[ord[i] * n + ord[i]];
        for (int k = 0; k < n; k++) Vs[k * n + i] = V[k * n + ord[i]];
    }
    memcpy(V, Vs, (size_t)n * n * sizeof(double));
    free(Vs), free(ord);
}

/* ---- safetensors writer: u64 header length, JSON header (8-byte padded), F32 data ---- */

lethe_status lethe_fit_write_safetensors(const char *path, const lethe_fit_tensor *e, size_t n_e,
                                         const char *meta_json) {
    lethe_sbuf h = {0};
    lethe_sbuf_puts(&h, "{\"__metadata__\":");
    lethe_sbuf_puts(&h, meta_json);
    size_t off = 0;
    char tmp[256];
    for (size_t i = 0; i < n_e; i++) {
        LETHE_ASSERT(e[i].n_dims >= 1 && e[i].n_dims <= 3);
        snprintf(tmp, sizeof(tmp), ",\"%s\":{\"dtype\":\"F32\",\"shape\":[", e[i].name);
        lethe_sbuf_puts(&h, tmp);
        for (int d = 0; d < e[i].n_dims; d++) {
            snprintf(tmp, sizeof(tmp), "%s%lld", d ? "," : "", (long long)e[i].shape[d]);
            lethe_sbuf_puts(&h, tmp);
        }
        snprintf(tmp, sizeof(tmp), "],\"data_offsets\":[%zu,%zu]}", off, off + e[i].n * sizeof(float));
        lethe_sbuf_puts(&h, tmp);
        off += e[i].n * sizeof(float);
    }
    lethe_sbuf_puts(&h, "}");
    while (h.n % 8) lethe_sbuf_puts(&h, " ");
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(h.s);
        return lethe_errorf(LETHE_ERR_IO, "lethe fit: cannot write %s: %s", path, strerror(errno));
    }
    const uint64_t hl = h.n;
    bool ok = fwrite(&hl, 8, 1, f) == 1 && fwrite(h.s, 1, h.n, f) == h.n;
    for (size_t i = 0; ok && i < n_e; i++) ok = fwrite(e[i].data, sizeof(float), e[i].n, f) == e[i].n;
    ok = fclose(f) == 0 && ok;
    free(h.s);
    return ok ? LETHE_OK : lethe_errorf(LETHE_ERR_IO, "lethe fit: writing %s failed", path);
}

/* ---- the command lines of the methods ---- */

int lethe_fit_opts_calib(lethe_opt *rows, const char **calib) {
    rows[0] = (lethe_opt){"--calib", NULL, LETHE_OPT_STRLIST, calib, "PATH",
                          "calibration text: a file or a folder of .txt, or token ids (*.ids, "
                          "whitespace-separated; repeatable)", 1, 0};
    return 1;
}

int lethe_fit_opts_common(lethe_opt *rows, lethe_fit_params *fp, const char **out, const char *out_help) {
    int n = 0;
    rows[n++] = (lethe_opt){"--samples", NULL, LETHE_OPT_INT, &fp->samples, "N", "calibration windows", 1, 1 << 20};
    rows[n++] = (lethe_opt){"--seq-len", NULL, LETHE_OPT_INT, &fp->seq_len, "T", "tokens per calibration window",
                            16, 1 << 16};
    rows[n++] = (lethe_opt){"--out", "-o", LETHE_OPT_STR, out, "DIR", out_help, 1, 0};
    rows[n++] = (lethe_opt){"--load-format", NULL, LETHE_OPT_STR, &fp->load_format, "F", "auto | gguf | hf | dummy",
                            1, 0};
    rows[n++] = (lethe_opt){"--tokenizer", NULL, LETHE_OPT_STR, &fp->tokenizer, "PATH",
                            "tokenizer folder / .gguf instead of the model's own (dummy weights)", 1, 0};
    rows[n++] = (lethe_opt){"--device", NULL, LETHE_OPT_STR, &fp->device, "DEV",
                            "cpu | cuda: where the calibration forward runs (default cpu)", 1, 0};
    rows[n++] = (lethe_opt){"--seed", NULL, LETHE_OPT_U64, &fp->seed, "S", "weights seed with --load-format dummy",
                            1, 0};
    rows[n++] = (lethe_opt){"--threads", NULL, LETHE_OPT_INT, &fp->threads, "N", "CPU threads (0 = all cores)", 0,
                            1024};
    return n;
}

int lethe_fit_args(const char *method, const char *const *pos, int n_pos, const char *const *calib,
                   lethe_fit_params *fp) {
    if (n_pos != 1 || !calib[0]) {
        fprintf(stderr, "lethe fit %s: needs MODEL and at least one --calib PATH (see --help)\n", method);
        return 2;
    }
    fp->model = pos[0];
    for (int i = 0; i < LETHE_MAX_STOP && calib[i] && fp->n_calib < LETHE_FIT_MAX_CALIB; i++)
        fp->calib[fp->n_calib++] = calib[i];
    return 0;
}

lethe_status lethe_fit_out_dir(const char *method, const char *out, const char *model, const char *suffix,
                               char *dir, size_t cap) {
    if (out) {
        snprintf(dir, cap, "%s", out);
    } else {
        size_t n = strlen(model);
        while (n > 1 && model[n - 1] == '/') n--;
        if (n > 5 && !strncmp(model + n - 5, ".gguf", 5)) n -= 5;
        snprintf(dir, cap, "%.*s%s", (int)n, model, suffix);
    }
    if (mkdir(dir, 0755) && errno != EEXIST)
        return lethe_errorf(LETHE_ERR_IO, "lethe fit %s: mkdir %s: %s", method, dir, strerror(errno));
    return LETHE_OK;
}

cJSON *lethe_fit_json_calibration(cJSON *j, const lethe_fit_params *fp, const lethe_fit_ctx *c, int64_t n_tok) {
    cJSON *cal = cJSON_AddObjectToObject(j, "calibration");
    cJSON *files = cJSON_AddArrayToObject(cal, "paths");
    for (int i = 0; i < fp->n_calib; i++) cJSON_AddItemToArray(files, cJSON_CreateString(fp->calib[i]));
    cJSON_AddNumberToObject(cal, "samples", c->n_samples);
    cJSON_AddNumberToObject(cal, "seq_len", fp->seq_len);
    cJSON_AddNumberToObject(cal, "tokens", (double)n_tok);
    return cal;
}

lethe_status lethe_fit_write_json(const char *method, const char *path, const cJSON *j) {
    char *txt = cJSON_Print(j);
    lethe_status st = LETHE_OK;
    FILE *f = fopen(path, "w");
    if (!f || fputs(txt, f) < 0 || fputc('\n', f) < 0)
        st = lethe_errorf(LETHE_ERR_IO, "lethe fit %s: cannot write %s", method, path);
    if (f && fclose(f) && st == LETHE_OK) st = lethe_errorf(LETHE_ERR_IO, "lethe fit %s: writing %s failed", method, path);
    free(txt);
    return st;
}

/* ---- the command ---- */

static const char *k_usage = "lethe fit <method> MODEL [options]";

int lethe_cmd_fit(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fprintf(argc < 2 ? stderr : stdout,
                "usage: %s\n\nFits the offline assets of a sparse method from the model's weights and a "
                "calibration text.\nmethods:\n  palu      low-rank K / V factors (whitened SVD per head group)\n"
                "  deltakv   residual compressor (PCA of KV minus the mean of its nearest centers)\n"
                "`lethe fit METHOD --help` for its options.\n", k_usage);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "palu")) return lethe_fit_palu(argc - 1, argv + 1);
    if (!strcmp(argv[1], "deltakv")) return lethe_fit_deltakv(argc - 1, argv + 1);
    fprintf(stderr, "lethe fit: no fitting for method '%s' (methods: palu, deltakv)\n", argv[1]);
    return 2;
}
