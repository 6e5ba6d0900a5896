/* fit_deltakv.c - `lethe fit deltakv MODEL`: DeltaKV's compressor
 * (methods.md §13) from the model and a calibration text, written as
 * deltakv.safetensors + deltakv.json (the format src/sparse/deltakv.c reads).
 *
 * The calibration forward (cmd_fit.c) hands every layer's pre-RoPE k and v
 * of each window; per layer the fit replays the method's coding on it:
 * x_t = [k_t ; v_t] (2 KH hd), sinks [0, s) and every stride-th token from s
 * are centers, every other token t gets its K nearest centers before it
 * (ranking 2 x.c - |c|^2, as the method) and the residual d_t = x_t - mean of
 * those fathers. The compressor is the linear map that reconstructs d best in
 * mean square at latent dims R: the top-R eigenvectors U_R of the residual
 * second moment E[d d^T] (accumulated in double, eigenvectors by cyclic
 * Jacobi), Down = U_R^T [R, 2 KH hd], Up = U_R [2 KH hd, R]. Rows are ordered
 * by eigenvalue, so the method's deltakv_latent=R' < R keeps the best R'-dim
 * compressor of the same fit. At R = 2 KH hd it is a rotation (exact).
 *
 * Not the paper's training: DeltaKV trains a (possibly MLP) compressor with a
 * loss that preserves next-token prediction; this is the closed-form linear
 * optimum of the reconstruction error of the residuals, no gradient steps. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend/topk.h"
#include "core/util.h"
#include "fit.h"
#include "options.h"

typedef struct dkv_acc {
    int32_t L, kvd, D, sink, stride, K;
    double *C;          /* [L][D][D] upper triangle of sum d d^T */
    int64_t *n_res;     /* [L] residuals accumulated */
    int64_t n_tok;
    float *x;           /* scratch [T][D] */
    int32_t cap_t;
} dkv_acc;

static void acc_kv(void *user, int32_t layer, const float *k, const float *v, int32_t n) {
    dkv_acc *a = user;
    const int32_t D = a->D, kvd = a->kvd, K = a->K;
    if (n > a->cap_t) {
        a->cap_t = n;
        a->x = lethe_xrealloc(a->x, (size_t)n * D * sizeof(float));
    }
    for (int32_t t = 0; t < n; t++) {
        memcpy(a->x + (size_t)t * D, k + (size_t)t * kvd, (size_t)kvd * sizeof(float));
        memcpy(a->x + (size_t)t * D + kvd, v + (size_t)t * kvd, (size_t)kvd * sizeof(float));
    }
    int32_t *cent = lethe_xmalloc((size_t)n * sizeof(int32_t)), nc = 0;
    float *cn = lethe_xmalloc((size_t)n * sizeof(float));
    double *d = lethe_xmalloc((size_t)D * sizeof(double));
    double *C = a->C + (size_t)layer * D * D;
    for (int32_t t = 0; t < n; t++) {
        const float *x = a->x + (size_t)t * D;
        const bool center = t < a->sink || (t - a->sink) % a->stride == 0;
        if (center) {
            double s = 0;
            for (int32_t c = 0; c < D; c++) s += (double)x[c] * x[c];
            cn[nc] = (float)s;
            cent[nc++] = t;
            continue;
        }
        int32_t best[16], nb = 0;
        float bs[16];
        for (int32_t c = 0; c < nc; c++) {
            const float *y = a->x + (size_t)cent[c] * D;
            double dot = 0;
            for (int32_t j = 0; j < D; j++) dot += (double)x[j] * y[j];
            const float s = (float)(2 * dot) - cn[c];
            int32_t j = nb < K ? nb++ : K;
            while (j > 0 && lethe_rank_before(s, c, bs[j - 1], best[j - 1])) {
                if (j < K) bs[j] = bs[j - 1], best[j] = best[j - 1];
                j--;
            }
            if (j < K) bs[j] = s, best[j] = c;
        }
        for (int32_t j = 0; j < D; j++) {
            double m = 0;
            for (int32_t f = 0; f < K; f++) m += a->x[(size_t)cent[best[f < nb ? f : f % nb]] * D + j];
            d[j] = x[j] - m / K;
        }
        for (int32_t i = 0; i < D; i++) {
            const double di = d[i];
            double *row = C + (size_t)i * D;
            for (int32_t j = i; j < D; j++) row[j] += di * d[j];
        }
        a->n_res[layer]++;
    }
    if (layer == 0) a->n_tok += n;
    free(cent), free(cn), free(d);
}

int lethe_fit_deltakv(int argc, char **argv) {
    lethe_fit_params fp = {.samples = 8, .seq_len = 512, .threads = 0, .seed = 0};
    int32_t latent = 128, K = 4, sink = 64;
    float ratio = 0.1f;
    const char *out = NULL, *calib[LETHE_MAX_STOP] = {0};
    lethe_opt opts[16];
    int no = lethe_fit_opts_calib(opts, calib);
    opts[no++] = (lethe_opt){"--latent", NULL, LETHE_OPT_INT, &latent, "R",
                             "latent dims per token (at most 2 x KV heads x head_dim)", 1, 65536};
    opts[no++] = (lethe_opt){"--neighbors", NULL, LETHE_OPT_INT, &K, "K",
                             "fathers per token (the method's deltakv_neighbors)", 1, 16};
    opts[no++] = (lethe_opt){"--center-ratio", NULL, LETHE_OPT_FLOAT, &ratio, "F",
                             "share of tokens that are centers (deltakv_center_ratio)", 0.001, 1};
    opts[no++] = (lethe_opt){"--sink-tokens", NULL, LETHE_OPT_INT, &sink, "S",
                             "first tokens kept raw (sink_keep_tokens)", 0, 1 << 20};
    no += lethe_fit_opts_common(opts + no, &fp, &out, "output folder (default: next to the model, MODEL.deltakv-R)");
    const char *pos[2];
    int n_pos = 0;
    int rc = lethe_opts_parse(opts, no, argc, argv,
                              "lethe fit deltakv MODEL --calib PATH [options]",
                              "DeltaKV compressor (PCA of each token's KV minus the mean of its nearest centers) for "
                              "--sparse-method deltakv --sparse-config deltakv_compressor=DIR.", pos, &n_pos, 1);
    if (rc) return rc > 0 ? 0 : 2;
    if ((rc = lethe_fit_args("deltakv", pos, n_pos, calib, &fp))) return rc;
    lethe_fit_ctx c;
    lethe_status st = lethe_fit_open(&fp, &c);
    const lethe_model_config *cfg = &c.model.cfg;
    dkv_acc a = {0};
    if (st == LETHE_OK) {
        a.L = cfg->n_layers, a.kvd = cfg->n_kv_heads * cfg->head_dim, a.D = 2 * a.kvd;
        a.sink = sink, a.K = K, a.stride = LETHE_MAX(1, (int32_t)floor(1.0 / ratio + 1e-9));
        if (latent > a.D)
            st = lethe_errorf(LETHE_ERR_INVALID, "--latent %d: at most 2 x %d KV heads x head_dim %d = %d", latent,
                              cfg->n_kv_heads, cfg->head_dim, a.D);
        else if (sink + a.stride >= fp.seq_len)
            st = lethe_errorf(LETHE_ERR_INVALID, "--seq-len %d leaves no compressed tokens after %d sinks", fp.seq_len,
                              sink);
    }
    if (st != LETHE_OK) {
        fprintf(stderr, "lethe fit deltakv: %s\n", lethe_last_error());
        lethe_fit_close(&c);
        return 1;
    }
    a.C = lethe_xcalloc((size_t)a.L * a.D * a.D, sizeof(double));
    a.n_res = lethe_xcalloc((size_t)a.L, sizeof(int64_t));
    st = lethe_fit_forward(&c, &fp, acc_kv, &a);
    char dir[2048], path[2100], suffix[32];
    snprintf(suffix, sizeof(suffix), ".deltakv-%d", latent);
    if (st == LETHE_OK) st = lethe_fit_out_dir("deltakv", out, fp.model, suffix, dir, sizeof(dir));
    const int32_t D = a.D, R = latent;
    float *w = lethe_xmalloc((size_t)a.L * 2 * R * D * sizeof(float));
    double *kept = lethe_xcalloc((size_t)a.L, sizeof(double));
    int32_t done = 0;
    /* one eigen-decomposition per layer, layers in parallel */
#pragma omp parallel for schedule(dynamic, 1)
    for (int32_t l = 0; l < (st == LETHE_OK ? a.L : 0); l++) {
        double *C = a.C + (size_t)l * D * D, *ev = lethe_xmalloc((size_t)D * sizeof(double));
        double *U = lethe_xmalloc((size_t)D * D * sizeof(double));
        const double nr = (double)LETHE_MAX(a.n_res[l], (int64_t)1);
        for (int32_t i = 0; i < D; i++)
            for (int32_t j = i; j < D; j++) C[(size_t)i * D + j] = C[(size_t)j * D + i] = C[(size_t)i * D + j] / nr;
        lethe_fit_jacobi(C, D, ev, U);
        double tot = 0, k = 0;
        for (int32_t i = 0; i < D; i++) tot += fmax(ev[i], 0), k += i < R ? fmax(ev[i], 0) : 0;
        kept[l] = tot > 0 ? k / tot : 1.0;
        float *down = w + (size_t)l * 2 * R * D, *up = down + (size_t)R * D;
        for (int32_t i = 0; i < R; i++)
            for (int32_t j = 0; j < D; j++) {
                down[(size_t)i * D + j] = (float)U[(size_t)j * D + i];
                up[(size_t)j * R + i] = (float)U[(size_t)j * D + i];
            }
        free(ev), free(U);
#pragma omp critical
        fprintf(stderr, "\rlethe fit deltakv: layer %d / %d factored", ++done, a.L);
    }
    if (st == LETHE_OK) fprintf(stderr, "\n");
    lethe_fit_tensor *ents = lethe_xcalloc((size_t)a.L * 2, sizeof(lethe_fit_tensor));
    double kmean = 0, kmin = 1;
    for (int32_t l = 0; l < a.L; l++) {
        kmean += kept[l] / a.L, kmin = fmin(kmin, kept[l]);
        for (int i = 0; i < 2; i++) {
            lethe_fit_tensor *e = &ents[2 * l + i];
            snprintf(e->name, sizeof(e->name), "layers.%d.%s", l, i ? "up" : "down");
            e->n_dims = 2, e->shape[0] = i ? D : R, e->shape[1] = i ? R : D;
            e->data = w + (size_t)l * 2 * R * D + (size_t)i * R * D;
            e->n = (size_t)R * D;
        }
    }
    if (st == LETHE_OK) {
        snprintf(path, sizeof(path), "%s/deltakv.safetensors", dir);
        st = lethe_fit_write_safetensors(path, ents, (size_t)a.L * 2, "{\"format\":\"lethe-deltakv-1\"}");
    }
    if (st == LETHE_OK) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "format", "lethe-deltakv-1");
        cJSON_AddStringToObject(j, "model", fp.model);
        cJSON_AddNumberToObject(j, "n_layers", a.L);
        cJSON_AddNumberToObject(j, "n_kv_heads", cfg->n_kv_heads);
        cJSON_AddNumberToObject(j, "head_dim", cfg->head_dim);
        cJSON_AddNumberToObject(j, "latent", R);
        cJSON_AddNumberToObject(j, "neighbors", K);
        cJSON_AddNumberToObject(j, "center_ratio", ratio);
        cJSON_AddNumberToObject(j, "sink_tokens", sink);
        cJSON_AddStringToObject(j, "fit", "linear: top eigenvectors of the second moment of x - mean(nearest centers), "
                                          "x = [k ; v] pre-RoPE, from the calibration forward (tools/fit_deltakv.c)");
        cJSON *cal = lethe_fit_json_calibration(j, &fp, &c, a.n_tok);
        cJSON_AddNumberToObject(cal, "residuals_per_layer", (double)a.n_res[0]);
        cJSON *en = cJSON_AddObjectToObject(j, "energy_kept");
        cJSON_AddNumberToObject(en, "mean", kmean);
        cJSON_AddNumberToObject(en, "min", kmin);
        snprintf(path, sizeof(path), "%s/deltakv.json", dir);
        st = lethe_fit_write_json("deltakv", path, j);
        cJSON_Delete(j);
    }
    if (st == LETHE_OK)
        printf("deltakv compressor: %s (latent %d of %d, %d layers, %lld calibration tokens; residual energy kept "
               "%.4f (min %.4f))\n", dir, R, D, a.L, (long long)a.n_tok, kmean, kmin);
    else
        fprintf(stderr, "lethe fit deltakv: %s\n", lethe_last_error());
    free(ents), free(w), free(kept), free(a.C), free(a.n_res), free(a.x);
    lethe_fit_close(&c);
    return st == LETHE_OK ? 0 : 1;
}
