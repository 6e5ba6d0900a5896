/* fit.h - what the `lethe fit` methods share (cmd_fit.c): the model on the
 * CPU backend, the calibration tokens, and a dense forward over them that
 * hands every layer's pre-RoPE k and v (host f32) to a callback. */
#ifndef LETHE_TOOLS_FIT_H
#define LETHE_TOOLS_FIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "core/json.h"
#include "core/status.h"
#include "model/model.h"
#include "options.h"
#include "tokenizer/tokenizer.h"

#define LETHE_FIT_MAX_CALIB 16

typedef struct lethe_fit_params {
    const char *model, *load_format;
    const char *tokenizer;    /* NULL = the model's own (dummy weights need one) */
    const char *device;       /* cpu (default) or cuda: where the calibration forward runs */
    const char *calib[LETHE_FIT_MAX_CALIB]; /* files or folders of .txt */
    int n_calib;
    int32_t samples, seq_len; /* calibration windows of seq_len tokens */
    int32_t threads;
    uint64_t seed;            /* dummy weights */
} lethe_fit_params;

typedef struct lethe_fit_ctx {
    lethe_backend *be;
    lethe_model model;
    bool loaded;
    lethe_tokenizer *tok;
    int32_t *ids, n_ids;      /* the calibration text's tokens */
    int32_t n_samples;        /* windows used: min(samples, n_ids / seq_len) */
} lethe_fit_ctx;

lethe_status lethe_fit_open(const lethe_fit_params *fp, lethe_fit_ctx *c);
void lethe_fit_close(lethe_fit_ctx *c);

/* k, v: host [n, n_kv_heads * head_dim] of one layer, k before RoPE */
typedef void (*lethe_fit_kv_fn)(void *user, int32_t layer, const float *k, const float *v, int32_t n);
/* Runs the model densely over every calibration window (seq_len tokens
 * from position 0), calling fn for every layer. */
lethe_status lethe_fit_forward(lethe_fit_ctx *c, const lethe_fit_params *fp, lethe_fit_kv_fn fn, void *user);

/* cyclic Jacobi: A [n][n] symmetric (destroyed) -> eigenvalues w
 * (descending) and eigenvectors as the columns of V [n][n] */
void lethe_fit_jacobi(double *A, int n, double *w, double *V);

/* one F32 tensor of an asset file */
typedef struct lethe_fit_tensor {
    char name[48];
    int n_dims;               /* 1 .. 3 */
    int64_t shape[3];
    const float *data;
    size_t n;                 /* elements */
} lethe_fit_tensor;
/* writes the tensors as a safetensors file with {"__metadata__": meta_json} */
lethe_status lethe_fit_write_safetensors(const char *path, const lethe_fit_tensor *e, size_t n_e,
                                         const char *meta_json);

/* ---- what every `lethe fit METHOD` command line shares ---- */

/* the --calib row (first in every method's table) and the rows after the
 * method's own: --samples, --seq-len, --out (out_help), --load-format,
 * --tokenizer, --device, --seed, --threads; each returns the rows written */
int lethe_fit_opts_calib(lethe_opt *rows, const char **calib);
int lethe_fit_opts_common(lethe_opt *rows, lethe_fit_params *fp, const char **out, const char *out_help);
/* after parsing: MODEL and the --calib paths into fp; 0, or 2 after a
 * usage message naming the method */
int lethe_fit_args(const char *method, const char *const *pos, int n_pos, const char *const *calib,
                   lethe_fit_params *fp);
/* the output folder: out, or next to the model "<model without .gguf><suffix>";
 * created if missing */
lethe_status lethe_fit_out_dir(const char *method, const char *out, const char *model, const char *suffix,
                               char *dir, size_t cap);
/* the asset JSON's "calibration" object (paths, samples, seq_len, tokens),
 * added to j and returned for method-specific fields */
cJSON *lethe_fit_json_calibration(cJSON *j, const lethe_fit_params *fp, const lethe_fit_ctx *c, int64_t n_tok);
/* writes j (pretty-printed, newline-terminated) to path */
lethe_status lethe_fit_write_json(const char *method, const char *path, const cJSON *j);

int lethe_fit_palu(int argc, char **argv);    /* fit_palu.c */
int lethe_fit_deltakv(int argc, char **argv); /* fit_deltakv.c */

#endif /* LETHE_TOOLS_FIT_H */
