/* test_cuda_engine.c - the engine's decode path on CUDA: CUDA graphs bucketed
 * by batch size with padding (src/engine/engine_forward.c) vs eager.
 *
 * Model: dummy Llama-3.1-8B shape (configs/llama-3.1-8b-instruct, random
 * weights, seed 5). Batches of B = 1, 3, 8, 13 requests (1 and 8 are buckets,
 * 3 pads to 4, 13 to 16), ragged random prompts, 24 greedy tokens each
 * (ignore_eos), run through three engines:
 *   graphs       default: padded decode steps replay one graph per bucket
 *   eager        --enforce-eager: no graphs, no padding
 *   eager+pad    enforce_eager + pad_decode_batches: the graph run's exact
 *                shapes launched eagerly
 * Checks: graphs vs eager: identical greedy tokens;
 * graphs vs eager+pad: bit-identical logits of every token (same kernels,
 * same shapes: a replay must compute exactly what the eager launch does);
 * the graph engine replayed graphs (stats.graph_replays > 0, padded_seqs >
 * 0), the eager ones never did. Also prints the largest logits difference
 * graphs vs eager (unpadded): cuBLAS may pick another kernel for 13 rows than
 * for 16, so those logits may differ in the last bf16 bits.
 *
 * Structured output on the device: the same model with the Llama-3 tokenizer
 * ($LETHE_TEST_TOKENIZER, else .deb/tokenizers/llama3 or
 * ../shared/data/tokenizers/llama3), 8 sampled requests (temperature 1,
 * seeds) under a JSON-schema grammar, run once with the token masks applied
 * by the CUDA sample op and once with LETHE_SAMPLE_ON_HOST=1 (the host twin
 * on the same logits): identical tokens, every output a complete JSON object
 * of the schema (finish STOP). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "lethe.h"
#include "test.h"

#define NB 4
#define MAXB 13
#define GEN 24
static const int g_sizes[NB] = {1, 3, 8, 13};

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
static void run_mode(bool eager, bool pad, rec out[NB][MAXB], lethe_engine_stats *st) {
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
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    uint64_t rng = 99;
    for (int b = 0; b < NB; b++) {
        const int B = g_sizes[b];
        int32_t prompt[MAXB][64];
        for (int i = 0; i < B; i++) {
            const int32_t n = 8 + (int32_t)(lethe_splitmix64(&rng) % 50);
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
    CHECK_EQ_INT(st->kv_slots_used, 0);
    fprintf(stderr, "    %-9s %lld steps: %lld graph replays, %lld captures, %lld eager, %lld padding seqs\n",
            eager ? (pad ? "eager+pad" : "eager") : "graphs", (long long)st->n_steps,
            (long long)st->graph_replays, (long long)st->graph_captures, (long long)st->eager_steps,
            (long long)st->padded_seqs);
    lethe_engine_destroy(e);
}

static rec g_graph[NB][MAXB], g_eager[NB][MAXB], g_pad[NB][MAXB];

static void test_graph_vs_eager(void) {
    lethe_engine_stats sg, se, sp;
    run_mode(false, false, g_graph, &sg);
    run_mode(true, false, g_eager, &se);
    run_mode(true, true, g_pad, &sp);
    CHECK(sg.graph_replays > 0 && sg.graph_captures > 0 && sg.padded_seqs > 0);
    CHECK(se.graph_replays == 0 && se.graph_captures == 0 && se.padded_seqs == 0);
    CHECK(sp.graph_replays == 0 && sp.graph_captures == 0 && sp.padded_seqs == sg.padded_seqs);
    for (int b = 0; b < NB; b++) {
        double max_diff = 0;
        int distinct = 0;
        for (int i = 0; i < g_sizes[b]; i++) {
            const rec *g = &g_graph[b][i], *e = &g_eager[b][i], *p = &g_pad[b][i];
            for (int t = 0; t < GEN; t++) {
                CHECK_MSG(g->tok[t] == e->tok[t], "B=%d seq %d token %d: graph %d, eager %d", g_sizes[b], i,
                          t, g->tok[t], e->tok[t]);
                /* dummy weights often repeat one greedy token, so "a real
                 * generation" is judged on the logits: they must change
                 * from step to step (each step sees a longer context) */
                distinct += memcmp(g->logits + (size_t)t * g->V, g->logits, (size_t)g->V * sizeof(float)) != 0;
            }
            CHECK_MSG(!memcmp(g->logits, p->logits, (size_t)GEN * g->V * sizeof(float)),
                      "B=%d seq %d: graph replay logits differ from the same padded shapes run eagerly",
                      g_sizes[b], i);
            for (size_t k = 0; k < (size_t)GEN * g->V; k++)
                max_diff = fmax(max_diff, fabs((double)g->logits[k] - (double)e->logits[k]));
        }
        CHECK(distinct > 0); /* a real generation, not a constant step */
        fprintf(stderr, "    B=%2d: %d greedy tokens identical graphs vs eager; logits max |diff| vs "
                        "unpadded eager %.3g, vs padded eager 0\n",
                g_sizes[b], g_sizes[b] * GEN, max_diff);
    }
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < MAXB; i++) free(g_graph[b][i].logits), free(g_eager[b][i].logits), free(g_pad[b][i].logits);
}

#define GR_N 8
#define GR_GEN 64
typedef struct gr_rec {
    int32_t tok[GR_GEN];
    char text[1024];
    int32_t n;
    size_t n_text;
    lethe_finish_reason fin;
} gr_rec;

static void gr_ev(void *user, const lethe_event *ev) {
    gr_rec *r = user;
    if (ev->n_tokens) {
        CHECK(r->n < GR_GEN);
        r->tok[r->n++] = ev->token;
    }
    size_t t = ev->text ? strlen(ev->text) : 0;
    CHECK(r->n_text + t < sizeof(r->text));
    memcpy(r->text + r->n_text, ev->text, t);
    r->n_text += t;
    r->text[r->n_text] = '\0';
    if (ev->finished) r->fin = ev->finish_reason;
}

static const char *tokenizer_dir(void) {
    static const char *const dirs[] = {".deb/tokenizers/llama3", "../shared/data/tokenizers/llama3",
                                       "/work/shared/data/tokenizers/llama3"};
    const char *env = getenv("LETHE_TEST_TOKENIZER");
    if (env && *env) return env;
    for (size_t i = 0; i < sizeof(dirs) / sizeof(dirs[0]); i++) {
        char p[512];
        snprintf(p, sizeof(p), "%s/tokenizer.json", dirs[i]);
        FILE *f = fopen(p, "rb");
        if (f) return fclose(f), dirs[i];
    }
    return NULL;
}

static void run_grammar(bool on_host, gr_rec out[GR_N]) {
    const char *tok = tokenizer_dir();
    CHECK_MSG(tok, "no Llama-3 tokenizer: set LETHE_TEST_TOKENIZER or carry .deb/tokenizers/llama3");
    if (on_host) setenv("LETHE_SAMPLE_ON_HOST", "1", 1);
    else unsetenv("LETHE_SAMPLE_ON_HOST");
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = "configs/llama-3.1-8b-instruct/config.json";
    p.load_format = "dummy";
    p.tokenizer = tok;
    p.seed = 5;
    p.device = "cuda";
    p.max_model_len = 256;
    p.max_num_seqs = 16;
    p.gpu_memory_utilization = 0.5f;
    p.enforce_eager = true;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    unsetenv("LETHE_SAMPLE_ON_HOST");
    static const char schema[] = "{\"type\": \"object\", \"properties\": {"
                                 "\"k\": {\"enum\": [\"red\", \"green\", \"blue\"]}, "
                                 "\"n\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 999}, "
                                 "\"ok\": {\"type\": \"boolean\"}}, "
                                 "\"required\": [\"k\", \"n\", \"ok\"], \"additionalProperties\": false}";
    lethe_grammar *g = NULL;
    CHECK_MSG(lethe_engine_compile_grammar(e, LETHE_GRAMMAR_JSON_SCHEMA, schema, &g) == 0, "%s",
              lethe_engine_last_error());
    uint64_t rng = 7;
    for (int i = 0; i < GR_N; i++) {
        int32_t prompt[32];
        const int32_t n = 4 + i;
        for (int32_t j = 0; j < n; j++) prompt[j] = (int32_t)(lethe_splitmix64(&rng) % 128000);
        lethe_request_params rp = {0};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 1.0f;
        rp.sampling.seed = 100 + (uint64_t)i, rp.sampling.has_seed = true;
        rp.sampling.max_tokens = GR_GEN;
        rp.prompt = prompt;
        rp.n_prompt = n;
        rp.grammar = g;
        rp.cb = gr_ev;
        rp.user = &out[i];
        uint64_t id;
        CHECK_MSG(lethe_engine_add_request(e, &rp, &id) == 0, "%s", lethe_engine_last_error());
    }
    lethe_grammar_free(g); /* each request holds its own reference */
    while (lethe_engine_has_work(e)) CHECK_MSG(lethe_engine_step(e) == 0, "%s", lethe_engine_last_error());
    lethe_engine_destroy(e);
}

static gr_rec g_gr_dev[GR_N], g_gr_host[GR_N];

static void test_grammar_device_vs_host(void) {
    run_grammar(false, g_gr_dev);
    run_grammar(true, g_gr_host);
    for (int i = 0; i < GR_N; i++) {
        const gr_rec *d = &g_gr_dev[i], *h = &g_gr_host[i];
        CHECK_MSG(d->fin == LETHE_FINISH_STOP, "request %d did not finish its JSON: %s", i, d->text);
        CHECK_EQ_INT(d->n, h->n);
        for (int32_t t = 0; t < d->n; t++)
            CHECK_MSG(d->tok[t] == h->tok[t], "request %d token %d: device mask %d, host %d", i, t, d->tok[t],
                      h->tok[t]);
        CHECK(!strcmp(d->text, h->text));
        /* the schema's object, keys in order, compact separators */
        CHECK_MSG(!strncmp(d->text, "{\"k\": \"", 7) && strstr(d->text, "\", \"n\": ") &&
                      strstr(d->text, ", \"ok\": ") && d->text[d->n_text - 1] == '}',
                  "request %d: %s", i, d->text);
        fprintf(stderr, "    grammar request %d: %d tokens, %s\n", i, d->n, d->text);
    }
}

int main(void) {
    TEST_RUN(test_graph_vs_eager);
    TEST_RUN(test_grammar_device_vs_host);
    fprintf(stderr, "test_cuda_engine: all passed\n");
    return 0;
}
