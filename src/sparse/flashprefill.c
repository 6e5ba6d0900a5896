/* flashprefill.c - block-sparse prefill attention (methods.md §18.5,
 * SparseEngine's flashprefill_v2), a prefill-axis method: only what prefill
 * attention reads changes; the KV stays whole and decode is dense.
 *
 * Every prefill chunk of at least flashprefill_min_q tokens attends
 * block-sparse (backend.h lethe_block_sparse, computed inside the backend's
 * attention: CPU backend/cpu/attention_bsp.c, CUDA backend/cuda/
 * attention_bsp.cu): 128 x 128 blocks; per query block and KV head the
 * block scores are a softmax of the mean query against the mean key of
 * every visible key block (max over the group's query heads); the sink
 * blocks, the last window blocks, the diagonal and the last query blocks of
 * the prompt (flashprefill_last_q_scope=prompt, the default: only in the
 * chunk that completes it, whose last queries give the logits; =chunk: of
 * every chunk, which with 8K chunks makes 1/8 of every chunk dense) are
 * always read, the other key blocks when their score reaches
 * flashprefill_threshold. Mean correction (on by default) stands in for each
 * skipped block with one pseudo-entry: its mean key and mean value, weighted
 * by the block's size (logit + ln 128), so the softmax keeps the skipped
 * blocks' approximate mass instead of renormalizing over the read ones.
 * (That is lethe's reading of the anchor's "mean correction"; the anchor's
 * external kernel is not public.) threshold 0 reads every block: the output
 * is dense attention's, bit-identical on the CPU. The threshold must be
 * calibrated per model (the anchor quotes 0.002 for Qwen3-4B). */
#include <string.h>

#include "core/util.h"
#include "sparse/sparse.h"

typedef struct fp_priv {
    lethe_knob_values kv;
    lethe_block_sparse bsp;
    bool prompt_scope;         /* last query blocks dense in a prompt's last chunk only */
    bool *prompt_end;          /* [cap]: the step's sequences (bsp.prompt_end) */
    int32_t cap;
} fp_priv;
#define PRIV(m) ((fp_priv *)(m)->priv)

static const lethe_sparse_knob knobs[] = {
    {"flashprefill_threshold", LETHE_KNOB_FLOAT, "0.002", 0, 1,
     "key blocks whose score (block softmax, max over the group's heads) reaches it are read"},
    {"flashprefill_sink_blocks", LETHE_KNOB_INT, "2", 1, 1 << 20, "first key blocks always read"},
    {"flashprefill_window_blocks", LETHE_KNOB_INT, "4", 2, 1 << 20,
     "last key blocks of each query block always read (the diagonal included)"},
    {"flashprefill_last_q_blocks", LETHE_KNOB_INT, "8", 0, 1 << 20,
     "last query blocks attend densely (of the prompt, or of every chunk: flashprefill_last_q_scope)"},
    {"flashprefill_last_q_scope", LETHE_KNOB_STR, "prompt", 0, 0,
     "prompt: only the prompt's last chunk has dense last query blocks | chunk: every chunk"},
    {"flashprefill_min_q", LETHE_KNOB_INT, "4096", 2, 1 << 30,
     "chunks with fewer new tokens attend densely"},
    {"flashprefill_mean_correction", LETHE_KNOB_BOOL, "true", 0, 1,
     "skipped blocks enter the softmax as their mean key / value, weighted by the block size"},
    {"flashprefill_block", LETHE_KNOB_INT, "128", 32, 1024,
     "block size, a multiple of 32 (the CUDA kernel: 128 only)"},
};

static lethe_status fp_init(lethe_sparse_method *m) {
    fp_priv *p = lethe_xcalloc(1, sizeof(*p));
    lethe_knobs_defaults(m->ops, &p->kv);
    m->priv = p;
    return LETHE_OK;
}
static void fp_destroy(lethe_sparse_method *m) {
    fp_priv *p = PRIV(m);
    if (p) free(p->prompt_end);
    free(p);
    m->priv = NULL;
}
static lethe_status fp_set_knob(lethe_sparse_method *m, const char *key, const char *value) {
    return lethe_knobs_set(m->ops, &PRIV(m)->kv, key, value);
}

static lethe_status fp_configure(lethe_sparse_method *m) {
    fp_priv *p = PRIV(m);
#define K(name) lethe_knob_num(m->ops, &p->kv, "flashprefill_" name)
    p->bsp = (lethe_block_sparse){.block = (int32_t)K("block"),
                                  .sink_blocks = (int32_t)K("sink_blocks"),
                                  .window_blocks = (int32_t)K("window_blocks"),
                                  .last_q_blocks = (int32_t)K("last_q_blocks"),
                                  .min_q = (int32_t)K("min_q"),
                                  .threshold = (float)K("threshold"),
                                  .mean_correction = K("mean_correction") != 0};
#undef K
    const char *scope = lethe_knob_str(m->ops, &p->kv, "flashprefill_last_q_scope");
    if (strcmp(scope, "prompt") && strcmp(scope, "chunk"))
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config flashprefill_last_q_scope=%s: expected "
                            "prompt or chunk", scope);
    p->prompt_scope = !strcmp(scope, "prompt");
    if (p->bsp.block % 32)
        return lethe_errorf(LETHE_ERR_INVALID, "--sparse-config flashprefill_block=%d: expected a "
                            "multiple of 32", p->bsp.block);
    if (m->env.be && !lethe_sparse_kv_host_ok(m) && p->bsp.block != 128)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "--sparse-config flashprefill_block=%d: the %s "
                            "backend's block-sparse kernel has 128-token blocks only",
                            p->bsp.block, m->env.be->ops->name);
    return LETHE_OK;
}

/* the step's prompt_end flags (prompt scope): a chunk that completes its
 * prompt (is_final_chunk; never an auxiliary prefill's) */
static const lethe_block_sparse *fp_block_sparse(const lethe_sparse_method *m, int32_t layer,
                                                 const lethe_sparse_step *st) {
    (void)layer;
    fp_priv *p = PRIV(m);
    p->bsp.prompt_end = NULL;
    if (!p->prompt_scope || !st) return &p->bsp;
    if (st->n_seqs > p->cap) {
        p->cap = LETHE_MAX(st->n_seqs, 2 * p->cap);
        p->prompt_end = lethe_xrealloc(p->prompt_end, (size_t)p->cap * sizeof(bool));
    }
    for (int32_t i = 0; i < st->n_seqs; i++) p->prompt_end[i] = st->seqs[i].is_final_chunk && !st->seqs[i].is_aux;
    p->bsp.prompt_end = p->prompt_end;
    return &p->bsp;
}

const lethe_sparse_ops lethe_sparse_flashprefill = {
    .name = "flashprefill",
    .aliases = {"flashprefill_v2", "block_sparse_prefill", NULL},
    .summary = "block-sparse prefill attention (128 x 128 blocks, sink/window/last-query blocks "
               "always, a threshold on block scores, mean correction); decode dense, KV whole",
    .kind = LETHE_SPARSE_KIND_SELECTION,
    .flags = LETHE_SPARSE_PREFILL_AXIS, /* pairs with decode methods: flashprefill+snapkv */
    .knob_table = knobs,
    .n_knob_table = (int32_t)(sizeof(knobs) / sizeof(knobs[0])),
    .test_configs = {.identity = "flashprefill_threshold=0,flashprefill_min_q=2,flashprefill_block=32",
                     .small = "flashprefill_threshold=1,flashprefill_min_q=2,flashprefill_block=32,"
                              "flashprefill_sink_blocks=1,flashprefill_window_blocks=2,"
                              "flashprefill_last_q_blocks=0"},
    .init = fp_init,
    .configure = fp_configure,
    .destroy = fp_destroy,
    .set_knob = fp_set_knob,
    .block_sparse = fp_block_sparse,
};
