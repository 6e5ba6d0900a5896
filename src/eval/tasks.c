/* tasks.c - seeded generators of the synthetic long-context tasks (RULER style).
 *
 * A sample is built in two phases. plan_*() draws everything that does not
 * depend on length from the seed: needles (key, value, depth in [0, 1]),
 * answers, the haystack start sentence, the word lists. render() then lays
 * out the user message for a haystack of N units (N corpus sentences, or N
 * uncommon words for cwe) with each needle inserted at the sentence boundary
 * nearest to depth x (haystack bytes). The generator searches for the largest N whose measured
 * prompt fits the target (doubling, then bisection), so the result is
 * within one unit (one sentence, or three list entries) of the target.
 *
 * Prompts (instruction, question, answer prefix) follow RULER's templates:
 *   passkey        "The pass key is 71432. Remember it. 71432 is the pass key."
 *   niah_multikey  "One of the special magic numbers for KEY is: 1234567." x4, one asked
 *   vt             "VAR ABCDE = 12345." then "VAR FGHIJ = VAR ABCDE." ..., two chains
 *   cwe            "1. word 2. word ..." where 10 words appear F times, the rest 3 times */
#include "eval/eval.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

#define NIAH_KEYS 4         /* 1 asked + 3 distractors */
#define VT_CHAINS 2         /* 1 asked + 1 distractor */
#define VT_VARS 5           /* per chain: the value assignment + 4 hops */
#define CWE_COMMON 10
#define CWE_RARE_FREQ 3

static const char *const g_task_names[LETHE_EVAL_N_TASKS] = {"passkey", "niah_multikey", "vt", "cwe"};

const char *lethe_eval_task_name(lethe_eval_task t) {
    return (unsigned)t < LETHE_EVAL_N_TASKS ? g_task_names[t] : "?";
}

int lethe_eval_task_from_name(const char *name) {
    for (int i = 0; i < LETHE_EVAL_N_TASKS; i++)
        if (!strcmp(name, g_task_names[i])) return i;
    if (!strcmp(name, "niah")) return LETHE_EVAL_NIAH_MULTIKEY;
    if (!strcmp(name, "variable_tracking")) return LETHE_EVAL_VT;
    if (!strcmp(name, "common_words")) return LETHE_EVAL_CWE;
    return -1;
}

/* ---- string builder ----------------------------------------------------- */

typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static void sb_putn(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = LETHE_MAX(b->cap * 2, b->n + n + 1024);
        b->s = lethe_xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}
static void sb_puts(sbuf *b, const char *s) { sb_putn(b, s, strlen(s)); }
static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    LETHE_ASSERT(k >= 0 && (size_t)k < sizeof(tmp));
    sb_putn(b, tmp, (size_t)k);
}

/* ---- plan ---------------------------------------------------------------- */

typedef struct plan {
    lethe_eval_task task;
    char instruction[512];
    char question[512];
    char answer_prefix[512];
    char needle[LETHE_EVAL_MAX_NEEDLES][128]; /* needle sentences in insertion order */
    float depth[LETHE_EVAL_MAX_NEEDLES];      /* non-decreasing */
    int32_t n_needles;
    char answers[LETHE_EVAL_MAX_ANSWERS][64];
    int32_t n_answers;
    int32_t sent0;          /* first haystack sentence */
    int32_t max_units;
    int32_t max_new_tokens;
    /* cwe */
    int32_t common[CWE_COMMON];    /* word indices */
    int32_t *rare;                 /* [max_units] word indices in draw order */
    int32_t cwe_freq;              /* repetitions of each common word */
    uint64_t shuffle_seed;
} plan;

static uint64_t rnd(uint64_t *st) { return lethe_splitmix64(st); }
static uint32_t rnd_below(uint64_t *st, uint32_t n) { return (uint32_t)(rnd(st) % n); }
static float rnd_unit(uint64_t *st) { return (float)((rnd(st) >> 40) * (1.0 / 16777216.0)); }

static void rand_upper(uint64_t *st, char *out, int n) {
    for (int i = 0; i < n; i++) out[i] = (char)('A' + rnd_below(st, 26));
    out[n] = '\0';
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void plan_passkey(plan *p, uint64_t *st) {
    uint32_t key = 10000 + rnd_below(st, 90000);
    snprintf(p->instruction, sizeof(p->instruction),
             "There is an important pass key hidden inside a lot of irrelevant text. Find it and "
             "memorize it. I will quiz you about the pass key.");
    snprintf(p->question, sizeof(p->question), "What is the pass key?");
    snprintf(p->answer_prefix, sizeof(p->answer_prefix), "The pass key is");
    snprintf(p->needle[0], sizeof(p->needle[0]),
             "The pass key is %u. Remember it. %u is the pass key.", key, key);
    p->depth[0] = rnd_unit(st);
    p->n_needles = 1;
    snprintf(p->answers[0], sizeof(p->answers[0]), "%u", key);
    p->n_answers = 1;
    p->max_new_tokens = 12;
}

static void plan_niah(plan *p, const lethe_eval_corpus *c, uint64_t *st) {
    char keys[NIAH_KEYS][48];
    uint32_t vals[NIAH_KEYS];
    for (int k = 0; k < NIAH_KEYS; k++) {
        bool dup;
        do {
            snprintf(keys[k], sizeof(keys[k]), "%s-%s", c->words[rnd_below(st, (uint32_t)c->n_words)],
                     c->words[rnd_below(st, (uint32_t)c->n_words)]);
            vals[k] = 1000000 + rnd_below(st, 9000000);
            dup = false;
            for (int j = 0; j < k; j++) dup |= !strcmp(keys[j], keys[k]) || vals[j] == vals[k];
        } while (dup);
    }
    snprintf(p->instruction, sizeof(p->instruction),
             "Some special magic numbers are hidden within the following text. Make sure to memorize "
             "it. I will quiz you about the numbers afterwards.");
    snprintf(p->question, sizeof(p->question),
             "What is the special magic number for %s mentioned in the provided text?", keys[0]);
    snprintf(p->answer_prefix, sizeof(p->answer_prefix),
             "The special magic number for %s mentioned in the provided text is", keys[0]);
    snprintf(p->answers[0], sizeof(p->answers[0]), "%u", vals[0]);
    p->n_answers = 1;
    /* needle 0 (asked) keeps index 0 in the sample; depths are drawn, then
     * needles are sorted by depth for insertion while remembering which is asked */
    float d[NIAH_KEYS];
    for (int k = 0; k < NIAH_KEYS; k++) d[k] = rnd_unit(st);
    int order[NIAH_KEYS];
    for (int k = 0; k < NIAH_KEYS; k++) order[k] = k;
    for (int a = 1; a < NIAH_KEYS; a++) /* insertion sort by depth, stable */
        for (int b = a; b > 0 && d[order[b]] < d[order[b - 1]]; b--) {
            int t = order[b];
            order[b] = order[b - 1];
            order[b - 1] = t;
        }
    for (int i = 0; i < NIAH_KEYS; i++) {
        int k = order[i];
        snprintf(p->needle[i], sizeof(p->needle[i]), "One of the special magic numbers for %s is: %u.",
                 keys[k], vals[k]);
        p->depth[i] = d[k];
    }
    p->n_needles = NIAH_KEYS;
    p->max_new_tokens = 16;
}

static void plan_vt(plan *p, uint64_t *st) {
    char names[VT_CHAINS][VT_VARS][8];
    uint32_t value[VT_CHAINS];
    for (int ch = 0; ch < VT_CHAINS; ch++) {
        do value[ch] = 10000 + rnd_below(st, 90000);
        while (ch > 0 && value[ch] == value[0]);
        for (int v = 0; v < VT_VARS; v++) {
            bool dup;
            do {
                rand_upper(st, names[ch][v], 5);
                dup = false;
                for (int c2 = 0; c2 <= ch; c2++)
                    for (int v2 = 0; v2 < (c2 == ch ? v : VT_VARS); v2++)
                        dup |= !strcmp(names[c2][v2], names[ch][v]);
            } while (dup);
        }
    }
    /* each chain's statements at sorted random depths; then merge by depth */
    typedef struct vt_needle {
        float d;
        int ch, v;
    } vt_needle;
    vt_needle nd[VT_CHAINS * VT_VARS];
    int n = 0;
    for (int ch = 0; ch < VT_CHAINS; ch++) {
        float d[VT_VARS];
        for (int v = 0; v < VT_VARS; v++) d[v] = rnd_unit(st);
        qsort(d, VT_VARS, sizeof(float), cmp_float);
        for (int v = 0; v < VT_VARS; v++) nd[n++] = (vt_needle){d[v], ch, v};
    }
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0 && nd[b].d < nd[b - 1].d; b--) {
            vt_needle t = nd[b];
            nd[b] = nd[b - 1];
            nd[b - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        if (nd[i].v == 0)
            snprintf(p->needle[i], sizeof(p->needle[i]), "VAR %s = %u.", names[nd[i].ch][0],
                     value[nd[i].ch]);
        else
            snprintf(p->needle[i], sizeof(p->needle[i]), "VAR %s = VAR %s.", names[nd[i].ch][nd[i].v],
                     names[nd[i].ch][nd[i].v - 1]);
        p->depth[i] = nd[i].d;
    }
    p->n_needles = n;
    for (int v = 0; v < VT_VARS; v++) snprintf(p->answers[v], sizeof(p->answers[v]), "%.7s", names[0][v]);
    p->n_answers = VT_VARS;
    snprintf(p->instruction, sizeof(p->instruction),
             "Memorize and track the chain(s) of variable assignment hidden in the following text.");
    snprintf(p->question, sizeof(p->question),
             "Question: Find all variables that are assigned the value %u in the text above.", value[0]);
    snprintf(p->answer_prefix, sizeof(p->answer_prefix),
             "Answer: According to the chain(s) of variable assignment in the text above, %d variables "
             "are assigned the value %u, they are:",
             VT_VARS, value[0]);
    p->max_new_tokens = 32;
}

static void plan_cwe(plan *p, const lethe_eval_corpus *c, uint64_t *st, int32_t target_tokens) {
    /* a random permutation prefix of the word pool: common words first, then rare */
    int32_t n = c->n_words;
    int32_t *perm = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int32_t i = 0; i < n; i++) perm[i] = i;
    for (int32_t i = 0; i < n - 1; i++) {
        int32_t j = i + (int32_t)rnd_below(st, (uint32_t)(n - i));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int k = 0; k < CWE_COMMON; k++) {
        p->common[k] = perm[k];
        snprintf(p->answers[k], sizeof(p->answers[k]), "%s", c->words[perm[k]]);
    }
    p->n_answers = CWE_COMMON;
    p->max_units = n - CWE_COMMON;
    p->rare = lethe_xmalloc((size_t)LETHE_MAX(p->max_units, 1) * sizeof(int32_t));
    memcpy(p->rare, perm + CWE_COMMON, (size_t)p->max_units * sizeof(int32_t));
    free(perm);
    /* common words take roughly a fifth of the list: ~4 tokens per entry */
    p->cwe_freq = (int32_t)LETHE_MIN(30, LETHE_MAX(6, target_tokens / (CWE_COMMON * 20)));
    p->shuffle_seed = rnd(st);
    snprintf(p->instruction, sizeof(p->instruction),
             "Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.");
    snprintf(p->question, sizeof(p->question),
             "Question: What are the %d most common words in the above list?", CWE_COMMON);
    snprintf(p->answer_prefix, sizeof(p->answer_prefix),
             "Answer: The top %d words that appear most often in the list are:", CWE_COMMON);
    p->max_new_tokens = 64;
}

/* ---- render ------------------------------------------------------------- */

/* user message for N units; fills needle offsets into s when s != NULL */
static char *render(const plan *p, const lethe_eval_corpus *c, int32_t N, lethe_eval_sample *s) {
    sbuf b = {0};
    sb_puts(&b, p->instruction);
    sb_puts(&b, "\n\n");
    if (p->task == LETHE_EVAL_CWE) {
        int32_t total = CWE_COMMON * p->cwe_freq + N * CWE_RARE_FREQ;
        int32_t *list = lethe_xmalloc((size_t)LETHE_MAX(total, 1) * sizeof(int32_t));
        int32_t k = 0;
        for (int w = 0; w < CWE_COMMON; w++)
            for (int r = 0; r < p->cwe_freq; r++) list[k++] = p->common[w];
        for (int32_t w = 0; w < N; w++)
            for (int r = 0; r < CWE_RARE_FREQ; r++) list[k++] = p->rare[w];
        uint64_t st = p->shuffle_seed ^ (uint64_t)N;
        for (int32_t i = total - 1; i > 0; i--) {
            int32_t j = (int32_t)rnd_below(&st, (uint32_t)(i + 1));
            int32_t t = list[i];
            list[i] = list[j];
            list[j] = t;
        }
        for (int32_t i = 0; i < total; i++) {
            sb_printf(&b, "%d. ", i + 1);
            sb_puts(&b, c->words[list[i]]);
            sb_puts(&b, i + 1 < total ? " " : "");
        }
        free(list);
    } else {
        /* needle i goes before the unit boundary nearest to depth_i x haystack bytes */
        size_t *cum = lethe_xmalloc((size_t)(N + 1) * sizeof(size_t)); /* [N+1] bytes before unit u */
        cum[0] = 0;
        for (int32_t u = 0; u < N; u++)
            cum[u + 1] = cum[u] + strlen(c->sentences[(p->sent0 + u) % c->n_sentences]) + 1;
        int32_t slot[LETHE_EVAL_MAX_NEEDLES];
        for (int i = 0; i < p->n_needles; i++) {
            double want = (double)p->depth[i] * (double)cum[N];
            int32_t u = 0;
            while (u < N && (double)cum[u + 1] <= want) u++;
            if (u < N && (double)cum[u + 1] - want < want - (double)cum[u]) u++;
            slot[i] = u; /* non-decreasing because depths are */
        }
        free(cum);
        int32_t nd = 0;
        for (int32_t u = 0; u <= N; u++) {
            /* needles whose slot is before unit u */
            while (nd < p->n_needles && slot[nd] <= u) {
                if (b.s[b.n - 1] != '\n') sb_puts(&b, " ");
                if (s) s->needle_offset[nd] = b.n;
                sb_puts(&b, p->needle[nd]);
                nd++;
            }
            if (u == N) break;
            if (b.s[b.n - 1] != '\n') sb_puts(&b, " ");
            sb_puts(&b, c->sentences[(p->sent0 + u) % c->n_sentences]);
        }
    }
    sb_puts(&b, "\n\n");
    sb_puts(&b, p->question);
    return b.s;
}

static lethe_status measure_units(const plan *p, const lethe_eval_corpus *c, int32_t N,
                                  lethe_eval_measure_fn measure, void *ctx, int32_t *tokens) {
    char *u = render(p, c, N, NULL);
    int32_t t = measure(ctx, u, p->answer_prefix);
    free(u);
    if (t < 0) return LETHE_ERR_INVALID; /* the callback set the message */
    *tokens = t;
    return LETHE_OK;
}

lethe_status lethe_eval_generate(lethe_eval_task task, const lethe_eval_corpus *c, uint64_t seed,
                                 int32_t target_tokens, lethe_eval_measure_fn measure, void *ctx,
                                 lethe_eval_sample *out) {
    memset(out, 0, sizeof(*out));
    if ((unsigned)task >= LETHE_EVAL_N_TASKS)
        return lethe_errorf(LETHE_ERR_INVALID, "eval: unknown task %d", (int)task);
    /* the task is hashed with the seed (not folded into the hash's own seed,
     * where seed 2 of one task and seed 0 of another could cancel out): every
     * (task, seed) draws an independent stream */
    uint64_t key[2] = {seed, 0x6c65746865000000ull | (uint64_t)task};
    uint64_t st = lethe_hash64(key, sizeof(key), 0);
    plan p = {.task = task};
    p.sent0 = (int32_t)rnd_below(&st, (uint32_t)c->n_sentences);
    p.max_units = c->n_sentences;
    switch (task) {
    case LETHE_EVAL_PASSKEY: plan_passkey(&p, &st); break;
    case LETHE_EVAL_NIAH_MULTIKEY: plan_niah(&p, c, &st); break;
    case LETHE_EVAL_VT: plan_vt(&p, &st); break;
    case LETHE_EVAL_CWE: plan_cwe(&p, c, &st, target_tokens); break;
    default: break;
    }
    lethe_status rc;
    int32_t t = 0, lo = 0, hi;
    if ((rc = measure_units(&p, c, 0, measure, ctx, &t)) != LETHE_OK) goto done;
    if (t > target_tokens) {
        rc = lethe_errorf(LETHE_ERR_INVALID,
                          "eval %s: the prompt without any haystack is already %d tokens (> %d)",
                          lethe_eval_task_name(task), t, target_tokens);
        goto done;
    }
    /* invariant: measure(lo) <= target; grow hi until measure(hi) > target */
    for (hi = 16;; hi *= 2) {
        if (hi >= p.max_units) {
            hi = p.max_units;
            if ((rc = measure_units(&p, c, hi, measure, ctx, &t)) != LETHE_OK) goto done;
            if (t <= target_tokens) {
                rc = lethe_errorf(LETHE_ERR_CAPACITY,
                                  "eval %s: the corpus is too small for %d tokens (all of it measures %d)",
                                  lethe_eval_task_name(task), target_tokens, t);
                goto done;
            }
            break;
        }
        if ((rc = measure_units(&p, c, hi, measure, ctx, &t)) != LETHE_OK) goto done;
        if (t > target_tokens) break;
        lo = hi;
    }
    while (hi - lo > 1) {
        int32_t mid = lo + (hi - lo) / 2;
        if ((rc = measure_units(&p, c, mid, measure, ctx, &t)) != LETHE_OK) goto done;
        if (t <= target_tokens) lo = mid;
        else hi = mid;
    }
    out->task = task;
    out->seed = seed;
    out->user = render(&p, c, lo, out);
    out->answer_prefix = lethe_xstrdup(p.answer_prefix);
    for (int i = 0; i < p.n_answers; i++) out->answers[i] = lethe_xstrdup(p.answers[i]);
    out->n_answers = p.n_answers;
    out->n_needles = p.task == LETHE_EVAL_CWE ? 0 : p.n_needles;
    for (int i = 0; i < out->n_needles; i++) out->needle_depth[i] = p.depth[i];
    out->max_new_tokens = p.max_new_tokens;
    int32_t nt = measure(ctx, out->user, out->answer_prefix);
    if (nt < 0) {
        lethe_eval_sample_free(out);
        rc = LETHE_ERR_INVALID;
        goto done;
    }
    out->n_prompt_tokens = nt;
    rc = LETHE_OK;
done:
    free(p.rare);
    return rc;
}

void lethe_eval_sample_free(lethe_eval_sample *s) {
    if (!s) return;
    free(s->user);
    free(s->answer_prefix);
    for (int i = 0; i < s->n_answers; i++) free(s->answers[i]);
    memset(s, 0, sizeof(*s));
}
