/* test_engine_real.c - the engine on the real CPU forward: greedy outputs
 * (and the logits behind them) must not depend on how requests are batched,
 * chunked, cached or preempted.
 *
 *  - tests/data/tiny-llama (HF checkpoint, 2 layers, vocab 256, 128 positions):
 *    16 mixed-length requests alone vs together (chunked, mixed steps), with
 *    the prefix cache on vs off (shared prefixes, staggered arrivals), and in
 *    a KV pool so small that requests are preempted and recomputed;
 *  - tiny-llama with decode batches padded to CUDA-graph bucket sizes
 *    (pad_decode_batches, the CPU stand-in for graph decode): every logit
 *    bit-identical to unpadded, the scratch slot never leaks;
 *  - models/SmolLM2-135M-Instruct.Q4_1.gguf (the default model): a short
 *    chat case, alone vs batched with a shared system prompt. */
#include <string.h>
#include <sys/stat.h>

#include "core/util.h"
#include "engine/engine_internal.h"
#include "test.h"

#define TINY "tests/data/tiny-llama"
#define SMOL "models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define NREQ 16
#define MAXT 128

typedef struct out {
    int32_t tokens[MAXT];
    float logits[MAXT][8];  /* the first 8 logits behind each token */
    int32_t n, cached;
    bool done;
    lethe_finish_reason why;
    char text[1024];
} out;

static void on_event(void *user, const lethe_event *ev) {
    out *o = user;
    if (ev->n_tokens) {
        CHECK(o->n < MAXT);
        if (ev->logits) memcpy(o->logits[o->n], ev->logits, sizeof(o->logits[0]));
        o->tokens[o->n++] = ev->token;
    }
    if (ev->text) strncat(o->text, ev->text, sizeof(o->text) - strlen(o->text) - 1);
    o->cached = ev->cached_tokens;
    if (ev->finished) {
        o->done = true;
        o->why = ev->finish_reason;
    }
}

static lethe_engine *mk(const char *model, size_t kv_bytes, int32_t budget, int32_t max_seqs, bool prefix) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = model;
    p.kv_cache_bytes = kv_bytes;
    p.max_num_batched_tokens = budget;
    p.max_num_seqs = max_seqs;
    p.enable_prefix_caching = prefix;
    p.check_invariants = true;
    p.n_threads = 2;
    p.max_model_len = strstr(model, ".gguf") ? 512 : 0;
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    return e;
}

typedef struct job {
    int32_t prompt[MAXT];
    int32_t n, max_tokens;
} job;

static void make_jobs(job *jobs, bool shared_prefixes) {
    uint64_t rng = shared_prefixes ? 77 : 41;
    for (int i = 0; i < NREQ; i++) {
        job *j = &jobs[i];
        j->n = 4 + (int32_t)(lethe_splitmix64(&rng) % 88);
        j->max_tokens = 1 + (int32_t)(lethe_splitmix64(&rng) % 30);
        int32_t family = i % 3, shared = shared_prefixes ? 40 + 8 * family : 0;
        for (int32_t k = 0; k < j->n; k++)
            j->prompt[k] = k < shared ? (family * 31 + k * 7) % 256 : (int32_t)(lethe_splitmix64(&rng) % 256);
    }
}

static void submit(lethe_engine *e, const job *j, out *o) {
    lethe_request_params rp = {0};
    lethe_sampling_default_params(&rp.sampling);
    rp.sampling.temperature = 0;
    rp.sampling.max_tokens = j->max_tokens;
    rp.prompt = j->prompt;
    rp.n_prompt = j->n;
    rp.want_logits = true;
    rp.cb = on_event;
    rp.user = o;
    uint64_t id;
    int st = lethe_engine_add_request(e, &rp, &id);
    CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
}

static void drain(lethe_engine *e) {
    while (lethe_engine_has_work(e)) {
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
}

/* all 16 at once, or staggered: one new request per step */
static lethe_engine_stats run_batch(lethe_engine *e, const job *jobs, out *outs, bool staggered) {
    memset(outs, 0, sizeof(out) * NREQ);
    int next = 0;
    if (!staggered)
        for (; next < NREQ; next++) submit(e, &jobs[next], &outs[next]);
    while (lethe_engine_has_work(e) || next < NREQ) {
        if (next < NREQ) { submit(e, &jobs[next], &outs[next]); next++; }
        int st = lethe_engine_step(e);
        CHECK_MSG(st == 0, "%s", lethe_engine_last_error());
    }
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    return s;
}

static void same(const out *a, const out *b, int i) {
    CHECK(a->done && b->done);
    CHECK_MSG(a->n == b->n, "request %d: %d vs %d tokens", i, a->n, b->n);
    for (int32_t t = 0; t < a->n; t++) {
        CHECK_MSG(a->tokens[t] == b->tokens[t], "request %d token %d: %d vs %d", i, t, a->tokens[t], b->tokens[t]);
        /* the CPU backend computes each row independently of the batch: bit-equal logits */
        CHECK_MSG(!memcmp(a->logits[t], b->logits[t], sizeof(a->logits[t])),
                  "request %d token %d: logits differ (%.9g vs %.9g)", i, t, a->logits[t][0], b->logits[t][0]);
    }
    CHECK_EQ_INT(a->why, b->why);
}

static out g_alone[NREQ], g_batch[NREQ];
static job g_jobs[NREQ];

static void test_alone_vs_batch(void) {
    make_jobs(g_jobs, false);
    memset(g_alone, 0, sizeof(g_alone));
    lethe_engine *e = mk(TINY, 1 << 20, 2048, 1, false);
    for (int i = 0; i < NREQ; i++) {
        submit(e, &g_jobs[i], &g_alone[i]);
        drain(e);
    }
    lethe_engine_destroy(e);
    /* budget 32: prompts are chunked and share steps with decodes */
    e = mk(TINY, 1 << 20, 32, 16, false);
    lethe_engine_stats s = run_batch(e, g_jobs, g_batch, false);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_batch[i], i);
    CHECK_EQ_INT(s.n_requests_finished, NREQ);
    lethe_engine_destroy(e);
    /* anchor-style split steps give the same tokens too */
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY;
    p.max_num_batched_tokens = 48;
    p.split_prefill_decode = true;
    p.check_invariants = true;
    CHECK(lethe_engine_create(&p, &e) == 0);
    run_batch(e, g_jobs, g_batch, true);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_batch[i], i);
    lethe_engine_destroy(e);
}

static void test_prefix_cache_on_off(void) {
    make_jobs(g_jobs, true);
    lethe_engine *e = mk(TINY, 1 << 20, 64, 16, false);
    run_batch(e, g_jobs, g_alone, true);
    lethe_engine_destroy(e);
    e = mk(TINY, 1 << 20, 64, 16, true);
    lethe_engine_stats s = run_batch(e, g_jobs, g_batch, true);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_batch[i], i);
    CHECK(s.prefix_hit_tokens >= 3 * 32);
    int with_hits = 0;
    for (int i = 0; i < NREQ; i++) with_hits += g_batch[i].cached > 0;
    CHECK(with_hits >= 6);
    fprintf(stderr, "    prefix cache: %lld of %lld prompt tokens reused, %d requests hit\n",
            (long long)s.prefix_hit_tokens, (long long)s.prefix_queries_tokens, with_hits);
    lethe_engine_destroy(e);
}

static void test_preemption_same_output(void) {
    make_jobs(g_jobs, false);
    lethe_engine *e = mk(TINY, 1 << 20, 256, 16, true);
    run_batch(e, g_jobs, g_alone, false);
    lethe_engine_destroy(e);
    /* 160 slots (512 B each) for 16 requests of up to 120 tokens */
    e = mk(TINY, 160 * 512, 256, 16, true);
    CHECK_EQ_INT(lethe_kv_n_slots(e->pool), 160);
    lethe_engine_stats s = run_batch(e, g_jobs, g_batch, false);
    CHECK(s.n_preemptions > 0);
    fprintf(stderr, "    small pool: %lld preemptions\n", (long long)s.n_preemptions);
    for (int i = 0; i < NREQ; i++) same(&g_alone[i], &g_batch[i], i);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    lethe_engine_destroy(e);
}

/* Decode batches padded to graph buckets (engine_forward.c) on the CPU
 * backend, where no graph runs but the padding is the same: the full logits
 * of every token equal the unpadded run's bit for bit. max_num_seqs 13 is not
 * a bucket (largest bucket 16); as requests finish the decode batch shrinks
 * through many sizes that are and are not buckets. */
typedef struct fullout {
    int32_t tokens[MAXT];
    float logits[MAXT][256];
    int32_t n;
    bool done;
} fullout;

static void on_full(void *user, const lethe_event *ev) {
    fullout *o = user;
    if (ev->n_tokens) {
        CHECK(o->n < MAXT && ev->logits && ev->n_vocab == 256);
        memcpy(o->logits[o->n], ev->logits, sizeof(o->logits[0]));
        o->tokens[o->n++] = ev->token;
    }
    if (ev->finished) o->done = true;
}

static lethe_engine_stats run_padded_method(bool pad, fullout *outs, const char *method,
                                            const char *config, lethe_engine_sparse_stats *sp) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.sparse_method = method;
    p.sparse_config = config;
    /* radix reuse is refused with evicting methods */
    p.enable_prefix_caching = !method || !strcmp(method, "quest");
    p.model = TINY;
    p.kv_cache_bytes = 1 << 20;
    p.max_num_batched_tokens = 96;
    p.max_num_seqs = 13;
    p.check_invariants = true; /* includes the scratch slot's accounting */
    p.n_threads = 2;
    p.pad_decode_batches = pad;
    lethe_engine *e = NULL;
    CHECK_MSG(lethe_engine_create(&p, &e) == 0, "%s", lethe_engine_last_error());
    CHECK_EQ_INT(lethe_kv_scratch_slot(e->pool) >= 0, pad);
    memset(outs, 0, sizeof(fullout) * NREQ);
    for (int i = 0; i < NREQ; i++) {
        lethe_request_params rp = {0};
        lethe_sampling_default_params(&rp.sampling);
        rp.sampling.temperature = 0;
        rp.sampling.max_tokens = g_jobs[i].max_tokens;
        rp.sampling.ignore_eos = true;
        rp.prompt = g_jobs[i].prompt;
        rp.n_prompt = g_jobs[i].n;
        rp.want_logits = true;
        rp.cb = on_full;
        rp.user = &outs[i];
        uint64_t id;
        CHECK(lethe_engine_add_request(e, &rp, &id) == 0);
    }
    drain(e);
    lethe_engine_stats s;
    lethe_engine_get_stats(e, &s);
    CHECK_EQ_INT(s.kv_slots_used, 0);
    CHECK_EQ_INT(s.graph_replays + s.graph_captures, 0); /* the CPU backend has no graphs */
    CHECK_EQ_INT(s.eager_steps, s.n_steps);
    if (sp) lethe_engine_get_sparse_stats(e, sp);
    lethe_engine_destroy(e);
    return s;
}

static lethe_engine_stats run_padded(bool pad, fullout *outs) {
    return run_padded_method(pad, outs, NULL, NULL, NULL);
}

static void test_padded_decode_same_logits(void) {
    make_jobs(g_jobs, false);
    static fullout plain[NREQ], padded[NREQ];
    lethe_engine_stats s0 = run_padded(false, plain);
    lethe_engine_stats s1 = run_padded(true, padded);
    CHECK_EQ_INT(s0.padded_seqs, 0);
    CHECK(s1.padded_seqs > 0);
    CHECK_EQ_INT(s0.n_steps, s1.n_steps);
    for (int i = 0; i < NREQ; i++) {
        CHECK(plain[i].done && padded[i].done);
        CHECK_EQ_INT(plain[i].n, padded[i].n);
        for (int32_t t = 0; t < plain[i].n; t++) {
            CHECK_MSG(plain[i].tokens[t] == padded[i].tokens[t], "request %d token %d", i, t);
            CHECK_MSG(!memcmp(plain[i].logits[t], padded[i].logits[t], sizeof(plain[i].logits[t])),
                      "request %d token %d: padded logits differ", i, t);
        }
    }
    fprintf(stderr, "    padded decode: %lld dummy sequences over %lld steps, logits bit-identical\n",
            (long long)s1.padded_seqs, (long long)s1.n_steps);
}

/* The graph decode plans of sparse methods (sparse.h graph_step) against
 * their per-layer eager path. Quest plans one selection per step for every
 * layer, padded to the bucket; the evicting methods' decode steps read each
 * layer's resident row, built and staged for all layers at once, with their
 * compaction in finish_step between steps; fp8_kv takes dense's uniform
 * plan with each layer's codes and scales. On the CPU backend the padded
 * steps run those plans eagerly, so every logit must be bit-identical, and
 * the methods really select / evict (checked through the sparse stats). */
static void check_padded_method(const char *method, const char *cfg, bool drops) {
    make_jobs(g_jobs, false);
    static fullout plain[NREQ], padded[NREQ];
    lethe_engine_sparse_stats sp0, sp1;
    lethe_engine_stats s0 = run_padded_method(false, plain, method, cfg, &sp0);
    lethe_engine_stats s1 = run_padded_method(true, padded, method, cfg, &sp1);
    CHECK_EQ_INT(s0.padded_seqs, 0);
    CHECK_MSG(s1.padded_seqs > 0, "%s: no graph plan ran (only they pad a sparse method)", method);
    CHECK_EQ_INT(s0.n_steps, s1.n_steps);
    if (drops) CHECK(sp0.selected_slots < sp0.resident_slots || sp0.evicted_slots > 0);
    CHECK_EQ_INT(sp0.selected_slots, sp1.selected_slots);
    CHECK_EQ_INT(sp0.resident_slots, sp1.resident_slots);
    CHECK_EQ_INT(sp0.evicted_slots, sp1.evicted_slots);
    for (int i = 0; i < NREQ; i++) {
        CHECK(plain[i].done && padded[i].done);
        CHECK_EQ_INT(plain[i].n, padded[i].n);
        for (int32_t t = 0; t < plain[i].n; t++) {
            CHECK_MSG(plain[i].tokens[t] == padded[i].tokens[t], "%s: request %d token %d", method, i, t);
            CHECK_MSG(!memcmp(plain[i].logits[t], padded[i].logits[t], sizeof(plain[i].logits[t])),
                      "%s: request %d token %d: graph-plan logits differ", method, i, t);
        }
    }
    fprintf(stderr, "    %s graph plan: %lld dummy sequences, read %lld of %lld entries, %lld evicted, "
                    "logits bit-identical\n", method, (long long)s1.padded_seqs,
            (long long)sp1.selected_slots, (long long)sp1.resident_slots, (long long)sp1.evicted_slots);
}

static void test_padded_methods_same_logits(void) {
    check_padded_method("quest", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,quest_skip_layers=1", true);
    /* per-KV-head lists: one plan per step too (head lists staged with the step's arrays) */
    check_padded_method("quest", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,quest_skip_layers=1,"
                                 "quest_granularity=head", true);
    check_padded_method("snapkv", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8", true);
    /* (decode eviction scores every decode step: those steps stay eager) */
    check_padded_method("pyramidkv", "sink_keep_tokens=2,recent_keep_tokens=6,decode_keep_tokens=8,"
                                     "pyramidkv_decode_eviction=false", true);
    check_padded_method("h2o", "sink_keep_tokens=2,recent_keep_tokens=6,h2o_decode_budget=16", true);
    /* trims rows back to s + r in finish_step whenever they reach 2 (s + r) */
    check_padded_method("streamingllm", "sink_keep_tokens=2,recent_keep_tokens=6", true);
    /* FP8 KV: the uniform plan, each layer reading its own codes and scales */
    check_padded_method("fp8_kv", NULL, false);
}

/* the default model: chat prompts with a shared system message */
static void test_smollm2_chat(void) {
    static const char *questions[] = {"What is the capital of France?", "Name a primary color.",
                                      "What is 2 + 2?", "Say hello."};
    static out alone[4], batch[4];
    memset(alone, 0, sizeof(alone));
    memset(batch, 0, sizeof(batch));
    lethe_engine *e = mk(SMOL, 64 << 20, 512, 8, true);
    int32_t *ids[4], n_ids[4];
    for (int i = 0; i < 4; i++) {
        const char *roles[] = {"system", "user"};
        const char *contents[] = {"You are a concise assistant. Answer in one short sentence.", questions[i]};
        char *text = NULL;
        CHECK(lethe_engine_apply_chat(e, roles, contents, 2, true, &text) == 0);
        CHECK(lethe_engine_tokenize(e, text, false, true, &ids[i], &n_ids[i]) == 0);
        free(text);
    }
    job j[4];
    for (int i = 0; i < 4; i++) {
        memcpy(j[i].prompt, ids[i], (size_t)n_ids[i] * sizeof(int32_t));
        j[i].n = n_ids[i];
        j[i].max_tokens = 8;
    }
    for (int i = 0; i < 4; i++) {
        submit(e, &j[i], &alone[i]);
        drain(e);
    }
    for (int i = 0; i < 4; i++) submit(e, &j[i], &batch[i]);
    drain(e);
    for (int i = 0; i < 4; i++) {
        same(&alone[i], &batch[i], i);
        CHECK(!strcmp(alone[i].text, batch[i].text));
        CHECK(batch[i].cached > 0); /* the system prompt came from the cache */
        fprintf(stderr, "    %s -> %s\n", questions[i], batch[i].text);
    }
    CHECK_STR_CONTAINS(alone[0].text, "Paris");
    for (int i = 0; i < 4; i++) free(ids[i]);
    lethe_engine_destroy(e);
}

/* A tokenizer larger than the model's vocabulary is refused, and the message
 * names both sizes (the model's was once read after the model was freed). */
static void test_tokenizer_vocab_mismatch(void) {
    lethe_engine_params p;
    lethe_engine_default_params(&p);
    p.model = TINY; /* vocab_size 256 */
    struct stat sb;
    p.tokenizer = stat("../shared/data/tokenizers/llama3", &sb) == 0 ? "../shared/data/tokenizers/llama3"
                                                                      : "/work/shared/data/tokenizers/llama3";
    lethe_engine *e = NULL;
    int st = lethe_engine_create(&p, &e);
    CHECK(st != 0 && !e);
    CHECK_STR_CONTAINS(lethe_engine_last_error(), "but the model's vocabulary is 256");
}

int main(void) {
    TEST_RUN(test_tokenizer_vocab_mismatch);
    TEST_RUN(test_alone_vs_batch);
    TEST_RUN(test_prefix_cache_on_off);
    TEST_RUN(test_preemption_same_output);
    TEST_RUN(test_padded_decode_same_logits);
    TEST_RUN(test_padded_methods_same_logits);
    TEST_RUN(test_smollm2_chat);
    return 0;
}
