/* fit_palu.c - `lethe fit palu MODEL`: Palu's low-rank factors (methods.md
 * §14) from the model's weights and a calibration text, written as
 * palu.safetensors + palu.json (the format src/sparse/palu.c reads).
 *
 * Whitened SVD per layer and group of gs KV heads: Palu factors the group's
 * projection W [gs hd, D] as W S = U Sigma V^T with S S^T = X^T X (X the
 * calibration inputs of k_proj / v_proj), keeps rank r and sets
 * L = U_r Sigma_r^(1/2), R = Sigma_r^(1/2) V_r^T S^-1, so the latent is
 * h = R x and the reconstruction L h. Since (W S)(W S)^T = W X^T X W^T =
 * K^T K with K = X W^T the group's calibration keys, U and Sigma^2 are the
 * eigenvectors and eigenvalues of the key covariance C = K^T K, and
 * R x = Sigma_r^(-1/2) U_r^T W x = Sigma_r^(-1/2) U_r^T k: the whitened SVD
 * is computed here from C (accumulated in double over the calibration
 * forward, keys before RoPE, eigenvectors by cyclic Jacobi), and stored as
 * k_down = Sigma_r^(-1/2) U_r^T [r, gs hd] (applied to the pre-RoPE keys the
 * model computes anyway) and k_up = U_r Sigma_r^(1/2) [gs hd, r]; values
 * likewise. Rank from the target ratio as SparseEngine: r = floor(gs hd
 * ratio / 16) 16, at least min(16, gs hd), at most min(gs hd, 256) and, for
 * palu's absorbed values, head_dim. At ratio 1 the factors are a rotation:
 * reconstruction equals the keys up to float rounding. No Fisher rank search
 * (uniform ranks). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/util.h"
#include "fit.h"
#include "options.h"

typedef struct palu_acc {
    int32_t L, KH, hd, gs, ng, gd;
    double *ck, *cv; /* [L][ng][gd][gd] */
    int64_t n_tok;
} palu_acc;

static void acc_kv(void *user, int32_t layer, const float *k, const float *v, int32_t n) {
    palu_acc *a = user;
    const int32_t gd = a->gd, kvd = a->KH * a->hd;
    for (int which = 0; which < 2; which++) {
        const float *x = which ? v : k;
        double *C = (which ? a->cv : a->ck) + (size_t)layer * a->ng * gd * gd;
        for (int32_t g = 0; g < a->ng; g++) {
            double *Cg = C + (size_t)g * gd * gd;
            for (int32_t t = 0; t < n; t++) {
                const float *r = x + (size_t)t * kvd + (size_t)g * gd;
                for (int32_t i = 0; i < gd; i++) {
                    const double ri = r[i];
                    double *row = Cg + (size_t)i * gd;
                    for (int32_t j = i; j < gd; j++) row[j] += ri * r[j];
                }
            }
        }
    }
    if (layer == 0) a->n_tok += n;
}

/* down [r][gd] = Sigma_r^(-1/2) U_r^T, up [gd][r] = U_r Sigma_r^(1/2) with
 * Sigma = sqrt(eigenvalues of the normalized covariance); returns the energy kept */
static double factor(double *C, int gd, int r, int64_t n_tok, float *down, float *up) {
    for (int i = 0; i < gd; i++)
        for (int j = 0; j < i; j++) C[i * gd + j] = C[j * gd + i]; /* the upper triangle was accumulated */
    for (int i = 0; i < gd * gd; i++) C[i] /= (double)n_tok;
    double *w = lethe_xmalloc((size_t)gd * sizeof(double)), *U = lethe_xmalloc((size_t)gd * gd * sizeof(double));
    lethe_fit_jacobi(C, gd, w, U);
    double total = 0, kept = 0;
    for (int i = 0; i < gd; i++) total += fmax(w[i], 0);
    const double floor_ = fmax(w[0], 1e-30) * 1e-10; /* rank-deficient directions: bounded scale */
    for (int i = 0; i < r; i++) {
        kept += fmax(w[i], 0);
        const double sig = sqrt(fmax(w[i], floor_)), sq = sqrt(sig);
        for (int c = 0; c < gd; c++) {
            down[(size_t)i * gd + c] = (float)(U[c * gd + i] / sq);
            up[(size_t)c * r + i] = (float)(U[c * gd + i] * sq);
        }
    }
    free(w), free(U);
    return total > 0 ? kept / total : 1.0;
}

static int32_t rank_of(int32_t gd, int32_t hd, double ratio) {
    int32_t r = (int32_t)floor(gd * ratio / 16.0) * 16;
    r = LETHE_MAX(r, LETHE_MIN(16, gd));
    return LETHE_MIN(r, LETHE_MIN(LETHE_MIN(gd, 256), hd));
}

/* default output folder: next to the model, "<model without .gguf>.palu-<ratio>" */
int lethe_fit_palu(int argc, char **argv) {
    lethe_fit_params fp = {.samples = 8, .seq_len = 512, .threads = 0, .seed = 0};
    float ratio = 0.5f;
    int32_t gs = 1;
    const char *out = NULL, *calib[LETHE_MAX_STOP] = {0};
    lethe_opt opts[16];
    int no = lethe_fit_opts_calib(opts, calib);
    opts[no++] = (lethe_opt){"--rank-ratio", NULL, LETHE_OPT_FLOAT, &ratio, "R",
                             "kept rank / (group size x head_dim), K and V", 0.01, 1};
    opts[no++] = (lethe_opt){"--group-size", NULL, LETHE_OPT_INT, &gs, "G",
                             "KV heads per factor group (must divide the KV heads)", 1, 64};
    no += lethe_fit_opts_common(opts + no, &fp, &out, "output folder (default: next to the model, MODEL.palu-R)");
    const char *pos[2];
    int n_pos = 0;
    int rc = lethe_opts_parse(opts, no, argc, argv, "lethe fit palu MODEL --calib PATH [options]",
                              "Palu factors (whitened SVD per KV head group) for --sparse-method palu "
                              "--sparse-config palu_factors=DIR.", pos, &n_pos, 1);
    if (rc) return rc > 0 ? 0 : 2;
    if ((rc = lethe_fit_args("palu", pos, n_pos, calib, &fp))) return rc;
    lethe_fit_ctx c;
    lethe_status st = lethe_fit_open(&fp, &c);
    const lethe_model_config *cfg = &c.model.cfg;
    if (st == LETHE_OK && (cfg->n_kv_heads % gs))
        st = lethe_errorf(LETHE_ERR_INVALID, "--group-size %d does not divide the %d KV heads", gs, cfg->n_kv_heads);
    if (st != LETHE_OK) {
        fprintf(stderr, "lethe fit palu: %s\n", lethe_last_error());
        lethe_fit_close(&c);
        return 1;
    }
    palu_acc a = {.L = cfg->n_layers, .KH = cfg->n_kv_heads, .hd = cfg->head_dim, .gs = gs};
    a.ng = a.KH / gs, a.gd = gs * a.hd;
    const size_t per_layer = (size_t)a.ng * a.gd * a.gd;
    a.ck = lethe_xcalloc((size_t)a.L * per_layer, sizeof(double));
    a.cv = lethe_xcalloc((size_t)a.L * per_layer, sizeof(double));
    st = lethe_fit_forward(&c, &fp, acc_kv, &a);
    const int32_t r = rank_of(a.gd, a.hd, ratio);
    char dir[2048], path[2100], suffix[32];
    snprintf(suffix, sizeof(suffix), ".palu-%.2f", ratio);
    if (st == LETHE_OK) st = lethe_fit_out_dir("palu", out, fp.model, suffix, dir, sizeof(dir));
    lethe_fit_tensor *ents = lethe_xcalloc((size_t)a.L * 4, sizeof(lethe_fit_tensor));
    float *bufs = lethe_xmalloc((size_t)a.L * 4 * a.ng * r * a.gd * sizeof(float));
    double ek = 0, ev = 0, ek_min = 1, ev_min = 1;
    for (int32_t l = 0; l < a.L && st == LETHE_OK; l++) {
        float *kd = bufs + (size_t)(4 * l) * a.ng * r * a.gd, *ku = kd + (size_t)a.ng * r * a.gd;
        float *vd = ku + (size_t)a.ng * r * a.gd, *vu = vd + (size_t)a.ng * r * a.gd;
        for (int32_t g = 0; g < a.ng; g++) {
            const size_t o = (size_t)g * r * a.gd;
            const double e1 = factor(a.ck + l * per_layer + (size_t)g * a.gd * a.gd, a.gd, r, a.n_tok, kd + o, ku + o);
            const double e2 = factor(a.cv + l * per_layer + (size_t)g * a.gd * a.gd, a.gd, r, a.n_tok, vd + o, vu + o);
            ek += e1, ev += e2, ek_min = fmin(ek_min, e1), ev_min = fmin(ev_min, e2);
        }
        const char *what[4] = {"k_down", "k_up", "v_down", "v_up"};
        float *data[4] = {kd, ku, vd, vu};
        for (int i = 0; i < 4; i++) {
            lethe_fit_tensor *e = &ents[4 * l + i];
            snprintf(e->name, sizeof(e->name), "layers.%d.%s", l, what[i]);
            const bool down = i % 2 == 0;
            e->n_dims = 3, e->shape[0] = a.ng, e->shape[1] = down ? r : a.gd, e->shape[2] = down ? a.gd : r;
            e->data = data[i];
            e->n = (size_t)a.ng * r * a.gd;
        }
    }
    const double n_groups_total = (double)a.L * a.ng;
    if (st == LETHE_OK) {
        snprintf(path, sizeof(path), "%s/palu.safetensors", dir);
        st = lethe_fit_write_safetensors(path, ents, (size_t)a.L * 4, "{\"format\":\"lethe-palu-1\"}");
    }
    if (st == LETHE_OK) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "format", "lethe-palu-1");
        cJSON_AddStringToObject(j, "model", fp.model);
        cJSON_AddNumberToObject(j, "n_layers", a.L);
        cJSON_AddNumberToObject(j, "n_kv_heads", a.KH);
        cJSON_AddNumberToObject(j, "head_dim", a.hd);
        cJSON_AddNumberToObject(j, "group_size", gs);
        cJSON_AddNumberToObject(j, "rank_ratio", ratio);
        cJSON *rk = cJSON_AddArrayToObject(j, "ranks");
        for (int32_t l = 0; l < a.L; l++) cJSON_AddItemToArray(rk, cJSON_CreateNumber(r));
        cJSON_AddStringToObject(j, "fit", "whitened SVD per KV head group from the pre-RoPE key / value "
                                          "covariance of the calibration forward (tools/fit_palu.c)");
        lethe_fit_json_calibration(j, &fp, &c, a.n_tok);
        cJSON *en = cJSON_AddObjectToObject(j, "energy_kept");
        cJSON_AddNumberToObject(en, "k_mean", ek / n_groups_total);
        cJSON_AddNumberToObject(en, "k_min", ek_min);
        cJSON_AddNumberToObject(en, "v_mean", ev / n_groups_total);
        cJSON_AddNumberToObject(en, "v_min", ev_min);
        cJSON_AddNumberToObject(j, "latent_fraction", (double)r / a.gd);
        snprintf(path, sizeof(path), "%s/palu.json", dir);
        st = lethe_fit_write_json("palu", path, j);
        cJSON_Delete(j);
    }
    if (st == LETHE_OK)
        printf("palu factors: %s (rank %d of %d per group, %d layers, %lld calibration tokens; energy kept K %.4f "
               "(min %.4f), V %.4f (min %.4f))\n", dir, r, a.gd, a.L, (long long)a.n_tok, ek / n_groups_total, ek_min,
               ev / n_groups_total, ev_min);
    else
        fprintf(stderr, "lethe fit palu: %s\n", lethe_last_error());
    free(ents), free(bufs), free(a.ck), free(a.cv);
    lethe_fit_close(&c);
    return st == LETHE_OK ? 0 : 1;
}
