/* test_cuda_graph_sparse.c - sparse methods on the CUDA-graph decode path
 * (sparse.h graph_step, src/engine/engine_forward.c graph_sel_forward) vs
 * their eager per-layer path.
 *
 * Model: dummy Llama-3.1-8B shape (configs/llama-3.1-8b-instruct, random
 * weights, seed 5). For each method with graph_step, batches of B = 1, 3,
 * 8, 13 requests (3 pads to bucket 4, 13 to 16), ragged random prompts of
 * 64 .. 191 tokens, 40 greedy tokens each (ignore_eos), budgets small enough
 * that pages really are dropped (the rows outgrow the budget), through three
 * engines:
 *   graphs       default: the method plans each pure decode step once for
 *                all layers (graph_step), the step replays one graph per
 *                bucket; steps the method declines (the first decode after
 *                a prefill refreshes every page's bounds) run eagerly
 *   eager        --enforce-eager: the per-layer path, no padding
 *   eager+pad    enforce_eager + pad_decode_batches: the graph run's plans
 *                and shapes launched eagerly
 * Checks: graphs vs eager: identical greedy tokens (bit-identical token
 * streams); graphs vs eager+pad: bit-identical logits of every token (a
 * replay computes exactly what the eager launch of the same plan does); the
 * graph engine replayed graphs, the eager ones never did; attention read
 * fewer entries than the rows held (Quest selected) or the method evicted
 * (SnapKV, PyramidKV, H2O, StreamingLLM: dense decode over compacted rows,
 * compaction between steps), the same counts in all three runs. Needs a CUDA device (make test-gpu).
 * LETHE_TEST_METHODS=quest,h2o runs only the named methods' cases (~30 s a
 * case; all of them take ~4 min of device time). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "test.h"

#define NB 4
#define MAXB 13
#define GEN 40
static const int g_sizes[NB] = {1, 3, 8, 13};

typedef struct method_case {
    const char *name, *config;
} method_case;
/* budgets of 2-4 pages / 48 tokens against rows of 64 .. 231 tokens */
static const method_case g_methods[] = {
    {"quest", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=16,quest_skip_layers=2"},
    /* per-KV-head lists (the varlen attention) inside the graph */
    {"quest", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=16,quest_skip_layers=2,"
              "quest_granularity=head"},
    /* eviction: compacted rows at prompt end (and StreamingLLM's trims in decode), dense decode */
    {"snapkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=16"},
    {"pyramidkv", "sink_keep_tokens=4,recent_keep_tokens=8,decode_keep_tokens=16,pyramidkv_decode_eviction=false"},
    {"h2o", "sink_keep_tokens=4,recent_keep_tokens=8,h2o_decode_budget=32"},
    {"streamingllm", "sink_keep_tokens=4,recent_keep_tokens=12"},
    /* FP8 KV: dense's uniform plan, each layer its own codes and scales (drops nothing) */
    {"fp8_kv", NULL},
};

typedef struct rec {
    int32_t tok[GEN];
    float *logits; /* [GEN, V] */
    int32_t n, V;
    bool done;
} rec;

static void on_ev(void *user, const lethe_event *ev) {
    rec *r = user;
    if (ev->n_tokens) {
        CHECK(r->n < GEN && ev->logits);
        r->V = ev->n_vocab;
        if (!r->logits) r->logits = lethe_xmalloc((size_t)GEN * (size_t)ev->n_vocab * sizeof(float));
        memcpy(r->logits + (size_t)r->n * ev->n_vocab, ev->logits, (size_t)ev->n_vocab * sizeof(float));
        r->tok[r->n++] = ev->token;
    }
    if (ev->finished) r->done = true;
}

/* runs every batch size through one engine; out[b][i] */
static void run_mode(const method_case *mc, bool eager, bool pad, rec out[NB][MAXB],
                     lethe_engine_stats *st, lethe_engine_sparse_stats *sp) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "configs/llama-3.1-8b-instruct/config.json";
    p.load_format = "dummy";
    p.seed = 5;
    p.device = "cuda";
    p.max_model_len = 256;
    p.max_num_seqs = 16;
    p.max_num_batched_tokens = 1024;
    p.gpu_memory_utilization = 0.5f;
    p.enable_prefix_caching = false;
    p.check_invariants = true;
    p.enforce_eager = eager;
    p.pad_decode_batches = pad;
    p.sparse_method = mc->name;
    p.sparse_config = mc->config;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    uint64_t rng = 77;
    for (int b = 0; b < NB; b++) {
        const int B = g_sizes[b];
        int32_t prompt[MAXB][192];
        for (int i = 0; i < B; i++) {
            const int32_t n = 64 + (int32_t)(lethe_splitmix64(&rng) % 128);
            for (int32_t j = 0; j < n; j++) prompt[i][j] = (int32_t)(lethe_splitmix64(&rng) % 128000);
            lethe_request_params rp = {0};
            lethe_sampling_default_params(&rp.sampling);
            rp.sampling.temperature = 0;
            rp.sampling.max_tokens = GEN;
            rp.sampling.ignore_eos = true;
            rp.prompt = prompt[i];
            rp.n_prompt = n;
            rp.want_logits = true;
            rp.cb = on_ev;
            rp.user = &out[b][i];
            uint64_t id;
            CHECK_MSG(lethe_engine_add_request(e, &rp, &id) == 0, "%s", lethe_engine_last_error());
        }
        while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
        for (int i = 0; i < B; i++) CHECK(out[b][i].done && out[b][i].n == GEN);
    }
    lethe_engine_get_stats(e, st);
    lethe_engine_get_sparse_stats(e, sp);
    CHECK_EQ_INT(st->kv_slots_used, 0);
    fprintf(stderr, "    %-6s %-9s %lld steps: %lld graph replays, %lld captures, %lld eager, %lld padding "
                    "seqs; read %lld of %lld entries, %lld evicted\n",
            mc->name, eager ? (pad ? "eager+pad" : "eager") : "graphs", (long long)st->n_steps,
            (long long)st->graph_replays, (long long)st->graph_captures, (long long)st->eager_steps,
            (long long)st->padded_seqs, (long long)sp->selected_slots, (long long)sp->resident_slots,
            (long long)sp->evicted_slots);
    lethe_engine_destroy(e);
}

static rec g_graph[NB][MAXB], g_eager[NB][MAXB], g_pad[NB][MAXB];

static void free_recs(void) {
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < MAXB; i++) {
            free(g_graph[b][i].logits), free(g_eager[b][i].logits), free(g_pad[b][i].logits);
            memset(&g_graph[b][i], 0, sizeof(rec));
            memset(&g_eager[b][i], 0, sizeof(rec));
            memset(&g_pad[b][i], 0, sizeof(rec));
        }
}

static void check_method(const method_case *mc) {
    lethe_engine_stats sg, se, sp;
    lethe_engine_sparse_stats xg, xe, xp;
    run_mode(mc, false, false, g_graph, &sg, &xg);
    run_mode(mc, true, false, g_eager, &se, &xe);
    run_mode(mc, true, true, g_pad, &sp, &xp);
    CHECK_MSG(sg.graph_replays > 0 && sg.graph_captures > 0 && sg.padded_seqs > 0,
              "%s: no decode graph replayed", mc->name);
    CHECK(se.graph_replays == 0 && se.graph_captures == 0 && se.padded_seqs == 0);
    CHECK(sp.graph_replays == 0 && sp.graph_captures == 0 && sp.padded_seqs == sg.padded_seqs);
    if (mc->config) /* (fp8_kv quantizes, it drops nothing) */
        CHECK_MSG(xg.selected_slots < xg.resident_slots || xg.evicted_slots > 0, "%s: nothing was dropped",
                  mc->name);
    CHECK_EQ_INT(xg.evicted_slots, xe.evicted_slots);
    CHECK_EQ_INT(xg.selected_slots, xe.selected_slots);
    CHECK_EQ_INT(xg.resident_slots, xe.resident_slots);
    CHECK_EQ_INT(xg.selected_slots, xp.selected_slots);
    for (int b = 0; b < NB; b++) {
        double max_diff = 0;
        for (int i = 0; i < g_sizes[b]; i++) {
            const rec *g = &g_graph[b][i], *e = &g_eager[b][i], *p = &g_pad[b][i];
            for (int t = 0; t < GEN; t++)
                CHECK_MSG(g->tok[t] == e->tok[t], "%s B=%d seq %d token %d: graph %d, eager %d", mc->name,
                          g_sizes[b], i, t, g->tok[t], e->tok[t]);
            CHECK_MSG(!memcmp(g->logits, p->logits, (size_t)GEN * g->V * sizeof(float)),
                      "%s B=%d seq %d: graph replay logits differ from the same plans run eagerly",
                      mc->name, g_sizes[b], i);
            for (size_t k = 0; k < (size_t)GEN * g->V; k++)
                max_diff = fmax(max_diff, fabs((double)g->logits[k] - (double)e->logits[k]));
        }
        fprintf(stderr, "    %s B=%2d: %d greedy tokens identical graphs vs eager; logits max |diff| vs "
                        "unpadded eager %.3g, vs padded eager 0\n",
                mc->name, g_sizes[b], g_sizes[b] * GEN, max_diff);
    }
    free_recs();
}

/* true when LETHE_TEST_METHODS is unset or lists `name` (comma separated) */
static bool method_selected(const char *name) {
    const char *only = getenv("LETHE_TEST_METHODS");
    if (!only || !*only) return true;
    const size_t n = strlen(name);
    for (const char *p = only; *p;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && !strncmp(p, name, n)) return true;
        if (!end) break;
        p = end + 1;
    }
    return false;
}

static void test_graph_vs_eager_methods(void) {
    int ran = 0;
    for (size_t i = 0; i < sizeof(g_methods) / sizeof(g_methods[0]); i++) {
        if (!method_selected(g_methods[i].name)) continue;
        check_method(&g_methods[i]);
        ran++;
    }
    CHECK_MSG(ran > 0, "LETHE_TEST_METHODS=%s names no method of this test", getenv("LETHE_TEST_METHODS"));
}

int main(void) {
    TEST_RUN(test_graph_vs_eager_methods);
    return 0;
}
