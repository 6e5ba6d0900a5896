/* test_cuda_sparse.c - the scored sparse methods (snapkv, pyramidkv, h2o,
 * omnikv, kvzip, rkv, skipkv) through the real engine on the CUDA backend, so their scores come
 * from the CUDA attn_scores op (backend/cuda/scores.cu):
 *
 *  - identity: with budgets >= the context each method's greedy tokens and
 *    logits are bit-identical to dense on CUDA (scores are computed at every
 *    final chunk / filter layer and must not disturb anything);
 *  - compaction: a 120-token prompt in chunks of 48 with small budgets; right
 *    after the final chunk the resident slots (summed over the per-layer slot
 *    spaces) equal what the method's budget says (snapkv s + k + r per layer,
 *    pyramidkv its per-layer schedule, h2o its decode budget, kvzip its token
 *    budget after the replay; its pair level per-head entries), decode
 *    eviction keeps every step within [budget, budget + interval), omnikv
 *    frees nothing; the engine's ownership checker (lethe_kv_check) runs
 *    after every step; the pool is empty at the end.
 * Model: tests/data/tiny-llama (2 layers, 4/2 heads, head_dim 16) with dummy
 * weights. Needs a CUDA device (make test-gpu); LETHE_TEST_DEVICE=cpu runs the
 * same expectations on the CPU backend. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "sparse/select_util.h"
#include "test.h"

#define TINY "tests/data/tiny-llama/config.json"
enum { NPROMPT = 120, NGEN = 6, NL = 2, VOCAB = 256 };

typedef struct run_out {
    int32_t tokens[NGEN];
    float logits[NGEN][VOCAB];
    int n;
} run_out;

static void on_event(void *user, const lethe_event *ev) {
    run_out *o = user;
    if (ev->n_tokens != 1 || o->n >= NGEN) return;
    CHECK(ev->logits && ev->n_vocab == VOCAB);
    o->tokens[o->n] = ev->token;
    memcpy(o->logits[o->n], ev->logits, sizeof(o->logits[0]));
    o->n++;
}

static lethe_engine *open_engine(const char *method, const char *cfg) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.load_format = "dummy";
    p.seed = 11;
    const char *dev = getenv("LETHE_TEST_DEVICE"); /* "cpu": check the expectations without a GPU */
    p.device = dev ? dev : "cuda";
    p.kv_cache_bytes = (size_t)16 << 20;
    p.max_model_len = 128;
    p.max_num_batched_tokens = 48;
    p.gpu_memory_utilization = 0.05f;
    p.enable_prefix_caching = false;
    p.sparse_method = method;
    p.sparse_config = cfg;
    p.check_invariants = true;
    lethe_engine *e = NULL;
    int rc = lethe_engine_create(&p, &e);
    CHECK_MSG(rc == 0, "%s %s: %s", method, cfg ? cfg : "", lethe_engine_last_error());
    return e;
}

static int64_t used(lethe_engine *e) {
    lethe_engine_stats st;
    lethe_engine_get_stats(e, &st);
    return st.kv_slots_used;
}

/* One request to completion. after_prefill: resident slots right after the
 * step that completed the prompt (its first token); lo/hi: the range of
 * resident slots over the decode steps that follow. */
static void run(const char *method, const char *cfg, run_out *o, int64_t *after_prefill, int64_t *lo,
                int64_t *hi) {
    memset(o, 0, sizeof(*o));
    lethe_engine *e = open_engine(method, cfg);
    int32_t ids[NPROMPT];
    for (int i = 0; i < NPROMPT; i++) ids[i] = 3 + (int32_t)((i * 37 + 5) % 250);
    lethe_request_params rp = {.prompt = ids, .n_prompt = NPROMPT, .cb = on_event, .user = o,
                               .want_logits = true};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = NGEN;
    rp.sampling.ignore_eos = true;
    uint64_t id;
    CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    *after_prefill = -1, *lo = INT64_MAX, *hi = 0;
    while (lethe_engine_has_work(e)) {
        int before = o->n;
        CHECK_MSG(lethe_engine_step(e) == 0, "%s: %s", method, lethe_engine_last_error());
        if (before == 0 && o->n == 1) *after_prefill = used(e);
        else if (o->n > 1 && o->n < NGEN) {
            int64_t u = used(e);
            *lo = u < *lo ? u : *lo;
            *hi = u > *hi ? u : *hi;
        }
    }
    CHECK_EQ_INT(o->n, NGEN);
    CHECK_EQ_INT(used(e), 0); /* every slot back in the pool */
    lethe_engine_destroy(e);
}

static void test_identity(void) {
    static run_out dense, o;
    int64_t a, lo, hi;
    run("dense", NULL, &dense, &a, &lo, &hi);
    CHECK_EQ_INT(a, NPROMPT); /* one shared slot space */
    static const char *const cases[][2] = {
        {"snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=4096,snapkv_decode_eviction=true"},
        {"pyramidkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=100000"},
        {"h2o", "h2o_prefill_budget=4096,h2o_decode_budget=4096,h2o_decode_eviction=true"},
        {"h2o", "h2o_prefill_budget=4096,h2o_decode_budget=4096,sparse_prefill_score_mode=probability,"
                "h2o_prefill_score_window=0"},
        {"omnikv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=4096,omnikv_full_layers=0"},
        {"kvzip", "kvzip_token_budget=4096"},
        {"kvzip", "kvzip_level=pair,kvzip_ratio=1"},
        {"rkv", "decode_keep_tokens=100000"},
        {"skipkv", "decode_keep_tokens=100000"},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) {
        fprintf(stderr, "    %s %s\n", cases[i][0], cases[i][1]);
        run(cases[i][0], cases[i][1], &o, &a, &lo, &hi);
        CHECK_MSG(!memcmp(o.tokens, dense.tokens, sizeof(o.tokens)), "%s tokens", cases[i][0]);
        CHECK_MSG(!memcmp(o.logits, dense.logits, sizeof(o.logits)), "%s logits", cases[i][0]);
    }
}

static void test_compaction(void) {
    static run_out o;
    int64_t a, lo, hi;
    /* snapkv: B = 4 + 20 + 8 per layer, decode appends */
    run("snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=20,snapkv_window_size=8", &o,
        &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * 32);
    CHECK_EQ_INT(lo, NL * 33); /* the second token's slot */
    /* snapkv with decode eviction in probability mode: back to B at B + 2 */
    run("snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=20,snapkv_decode_eviction=true,"
                  "decode_eviction_interval=2,sparse_prefill_score_mode=probability", &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * 32);
    CHECK(lo >= NL * 32 && hi < NL * 34);
    /* pyramidkv: the per-layer schedule, decode eviction every 3 */
    int32_t b[NL];
    lethe_pyramid_budgets(NL, 2, 40, 6, 0.6f, 0.01f, b);
    run("pyramidkv", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=40,decode_eviction_interval=3",
        &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, b[0] + b[1]);
    CHECK(lo >= b[0] + b[1] && hi < b[0] + b[1] + NL * 3);
    /* h2o: 48 -> 40, 88 -> 40, final 64 -> 24 per layer; decode eviction at 24 + 4 */
    run("h2o", "h2o_prefill_budget=40,h2o_decode_budget=24,h2o_decode_eviction=true,"
               "h2o_decode_eviction_interval=4", &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * 24);
    CHECK(lo >= NL * 24 && hi < NL * 28);
    run("h2o", "h2o_prefill_budget=40,h2o_decode_budget=24,sparse_prefill_score_mode=probability", &o, &a,
        &lo, &hi);
    CHECK_EQ_INT(a, NL * 24);
    /* omnikv: logical, the sparse layer reads 2 + 8 + 6 of 120 but nothing is freed */
    run("omnikv", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,omnikv_full_layers=0", &o, &a,
        &lo, &hi);
    CHECK_EQ_INT(a, NPROMPT);
    CHECK_EQ_INT(lo, NPROMPT + 1);
    /* kvzip shared: the replay (chunks of 32 + postfix 4, split into forwards of
     * 48) leaves nothing behind, 24 prompt tokens per layer, decode appends */
    run("kvzip", "kvzip_token_budget=24,kvzip_chunk_size=32,kvzip_postfix=4", &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * 24);
    CHECK_EQ_INT(lo, NL * 25);
    /* kvzip pair: per-head entries (30% of them); a slot stays while some head
     * of its layer keeps it, attention reads per KV head (attention_varlen.cu) */
    run("kvzip", "kvzip_level=pair,kvzip_ratio=0.3,kvzip_chunk_size=64", &o, &a, &lo, &hi);
    CHECK(a > NL * 4 && a < NL * NPROMPT);
    CHECK_EQ_INT(lo, a + NL);
    /* rkv: the prompt stays whole; from the first decode step the rows cycle
     * in [B, B + interval) (B = 24, interval 4; scores: attn_scores over the
     * ring's queries, key_redundancy) */
    run("rkv", "sink_keep_tokens=0,recent_keep_tokens=4,decode_keep_tokens=20,rkv_observation_tokens=4,"
               "rkv_compression_interval=4", &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * NPROMPT);
    CHECK(lo >= NL * 24 && hi < NL * 28);
    /* skipkv: whole 4-token spans, rows in (B - 4, B + interval) (B = 26) */
    run("skipkv", "sink_keep_tokens=2,recent_keep_tokens=4,decode_keep_tokens=20,skipkv_compression_interval=4,"
                  "skipkv_segment=4", &o, &a, &lo, &hi);
    CHECK_EQ_INT(a, NL * NPROMPT);
    CHECK(lo > NL * 22 && hi < NL * 30);
}

int main(void) {
    TEST_RUN(test_identity);
    TEST_RUN(test_compaction);
    fprintf(stderr, "test_cuda_sparse: all passed\n");
    return 0;
}
