/* test_eval_tasks.c - the synthetic task generators of `lethe eval`.
 *
 * Uses the small fixed corpus in tests/data/eval_corpus and a stand-in token
 * counter (one token per letter run, digit run or punctuation mark, plus a
 * fixed template overhead) so the test needs no model: the generators only
 * rely on the counter being monotone. Checks: answers sit where the sample
 * says (needle offsets and depths, the asked key's value, the variable chain,
 * the word frequencies), same seed -> same text, different seeds differ, the
 * measured length is within one haystack unit of the target, and errors for
 * targets too small or too large for the corpus. test_real_tokenizer then
 * measures with SmolLM2's own tokenizer and chat template (the model file in
 * models/, as `lethe eval` does) and checks the lengths in real tokens. */
#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "eval/eval.h"
#include "test.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

#define CORPUS "tests/data/eval_corpus"
#define OVERHEAD 20 /* stand-in for the chat template tokens */

static int32_t count_pieces(const char *s) {
    int32_t n = 0;
    const unsigned char *p = (const unsigned char *)s;
    while (*p) {
        if (isspace(*p)) { p++; continue; }
        if (isalpha(*p)) { while (isalpha(*p)) p++; }
        else if (isdigit(*p)) { while (isdigit(*p)) p++; }
        else p++;
        n++;
    }
    return n;
}

static int g_calls;
static int32_t measure(void *ctx, const char *user, const char *prefix) {
    (void)ctx;
    g_calls++;
    return OVERHEAD + count_pieces(user) + count_pieces(prefix);
}

static lethe_eval_corpus *g_c;

static void test_corpus(void) {
    CHECK_EQ_INT(lethe_eval_corpus_load(CORPUS, &g_c), LETHE_OK);
    CHECK_EQ_INT(g_c->n_docs, 3);
    CHECK(!strcmp(g_c->doc_names[0], "1863_abraham_lincoln_r.txt"));
    CHECK(g_c->n_sentences > 100);
    CHECK(g_c->n_words > 500);
    for (int32_t i = 1; i < g_c->n_words; i++) CHECK(strcmp(g_c->words[i - 1], g_c->words[i]) < 0);
    for (int32_t i = 0; i < g_c->n_sentences; i++) {
        size_t n = strlen(g_c->sentences[i]);
        CHECK(n >= 20 && n <= 400);
        CHECK(strchr(".!?", g_c->sentences[i][n - 1]) != NULL);
        CHECK(!strchr(g_c->sentences[i], '\n'));
    }
    /* a missing folder and a folder without text are errors with a message */
    lethe_eval_corpus *bad = NULL;
    CHECK_EQ_INT(lethe_eval_corpus_load("tests/data/no-such-folder", &bad), LETHE_ERR_IO);
    CHECK(bad == NULL);
    CHECK_EQ_INT(lethe_eval_corpus_load("tests", &bad), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "too little text");
}

/* start of the haystack: after the instruction paragraph; end: before the question */
static void haystack_span(const lethe_eval_sample *s, size_t *b, size_t *e) {
    const char *p = strstr(s->user, "\n\n");
    const char *q = strrchr(s->user, '\n');
    CHECK(p && q && q > p);
    *b = (size_t)(p + 2 - s->user);
    *e = (size_t)(q - 1 - s->user);
}

static void check_length(const lethe_eval_sample *s, int32_t target, int32_t tol) {
    CHECK_MSG(s->n_prompt_tokens <= target, "%s: %d > %d", lethe_eval_task_name(s->task),
              s->n_prompt_tokens, target);
    CHECK_MSG(s->n_prompt_tokens >= target - tol, "%s: %d < %d - %d", lethe_eval_task_name(s->task),
              s->n_prompt_tokens, target, tol);
    CHECK_EQ_INT(s->n_prompt_tokens, measure(NULL, s->user, s->answer_prefix));
}

static void test_passkey(void) {
    for (uint64_t seed = 1; seed <= 6; seed++) {
        lethe_eval_sample s;
        CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_PASSKEY, g_c, seed, 2000, measure, NULL, &s), LETHE_OK);
        check_length(&s, 2000, 80);
        CHECK_EQ_INT(s.n_answers, 1);
        CHECK_EQ_INT(strlen(s.answers[0]), 5);
        CHECK_EQ_INT(s.n_needles, 1);
        char want[128];
        snprintf(want, sizeof(want), "The pass key is %s. Remember it. %s is the pass key.", s.answers[0],
                 s.answers[0]);
        CHECK(!strncmp(s.user + s.needle_offset[0], want, strlen(want)));
        /* the needle appears once and nowhere else is the key written */
        CHECK(strstr(s.user, s.answers[0]) == s.user + s.needle_offset[0] + 16);
        /* its position in the haystack is the requested depth (within a sentence or two) */
        size_t b, e;
        haystack_span(&s, &b, &e);
        double frac = (double)(s.needle_offset[0] - b) / (double)(e - b);
        CHECK_MSG(fabs(frac - s.needle_depth[0]) < 0.04, "depth %g at %g", s.needle_depth[0], frac);
        CHECK_STR_CONTAINS(s.user, "What is the pass key?");
        CHECK(!strcmp(s.answer_prefix, "The pass key is"));
        CHECK(s.max_new_tokens > 0);
        lethe_eval_sample_free(&s);
    }
}

static void test_niah(void) {
    lethe_eval_sample s;
    CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_NIAH_MULTIKEY, g_c, 7, 3000, measure, NULL, &s), LETHE_OK);
    check_length(&s, 3000, 80);
    CHECK_EQ_INT(s.n_needles, 4);
    /* the asked key, from the answer prefix */
    const char *kp = strstr(s.answer_prefix, "number for ") + 11;
    char key[64];
    size_t kl = (size_t)(strchr(kp, ' ') - kp);
    memcpy(key, kp, kl);
    key[kl] = '\0';
    CHECK(strchr(key, '-'));
    int asked = 0;
    char vals[4][16];
    for (int i = 0; i < s.n_needles; i++) {
        const char *n = s.user + s.needle_offset[i];
        CHECK(!strncmp(n, "One of the special magic numbers for ", 37));
        const char *k = n + 37, *colon = strstr(k, " is: ");
        CHECK(colon);
        sscanf(colon + 5, "%15[0-9]", vals[i]);
        CHECK_EQ_INT(strlen(vals[i]), 7);
        if ((size_t)(colon - k) == kl && !strncmp(k, key, kl)) {
            asked++;
            CHECK(!strcmp(vals[i], s.answers[0]));
        }
        if (i > 0) CHECK(s.needle_offset[i] > s.needle_offset[i - 1]);
        if (i > 0) CHECK(s.needle_depth[i] >= s.needle_depth[i - 1]);
    }
    CHECK_EQ_INT(asked, 1);
    for (int i = 0; i < 4; i++)
        for (int j = i + 1; j < 4; j++) CHECK(strcmp(vals[i], vals[j]));
    lethe_eval_sample_free(&s);
}

/* follows "VAR A = 123." / "VAR B = VAR A." statements in text order */
static void test_vt(void) {
    lethe_eval_sample s;
    CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_VT, g_c, 11, 2500, measure, NULL, &s), LETHE_OK);
    check_length(&s, 2500, 80);
    CHECK_EQ_INT(s.n_needles, 10);
    CHECK_EQ_INT(s.n_answers, 5);
    unsigned asked_val = 0;
    CHECK(sscanf(strstr(s.user, "assigned the value ") + 19, "%u", &asked_val) == 1);
    char var[16][8];
    unsigned val[16];
    int n = 0;
    for (const char *p = strstr(s.user, "VAR "); p; p = strstr(p + 1, "VAR ")) {
        char a[8], b[8];
        unsigned v;
        if (sscanf(p, "VAR %5[A-Z] = VAR %5[A-Z].", a, b) == 2) {
            int src = -1;
            for (int i = 0; i < n; i++)
                if (!strcmp(var[i], b)) src = i;
            CHECK_MSG(src >= 0, "VAR %s used before it was assigned", b);
            strcpy(var[n], a);
            val[n++] = val[src];
            p += 4; /* skip the "VAR" on the right-hand side */
        } else if (sscanf(p, "VAR %5[A-Z] = %u.", a, &v) == 2) {
            strcpy(var[n], a);
            val[n++] = v;
        }
    }
    CHECK_EQ_INT(n, 10);
    int found = 0, other = 0;
    for (int i = 0; i < n; i++) {
        bool is_answer = false;
        for (int k = 0; k < s.n_answers; k++) is_answer |= !strcmp(s.answers[k], var[i]);
        if (val[i] == asked_val) {
            CHECK(is_answer);
            found++;
        } else {
            CHECK(!is_answer);
            other++;
        }
    }
    CHECK_EQ_INT(found, 5);
    CHECK_EQ_INT(other, 5); /* the distractor chain */
    lethe_eval_sample_free(&s);
}

static int count_word(char **list, int n, const char *w) {
    int k = 0;
    for (int i = 0; i < n; i++) k += !strcmp(list[i], w);
    return k;
}

static void test_cwe(void) {
    lethe_eval_sample s;
    CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_CWE, g_c, 3, 2000, measure, NULL, &s), LETHE_OK);
    check_length(&s, 2000, 12); /* one rare word = 3 entries of 3 pieces */
    CHECK_EQ_INT(s.n_answers, 10);
    /* parse "1. w 2. w ..." and check numbering */
    char *list[2000];
    int n = 0;
    const char *p = strstr(s.user, "\n\n") + 2;
    for (;;) {
        int idx, used = 0;
        char w[32];
        if (sscanf(p, "%d. %31[a-z]%n", &idx, w, &used) != 2) break;
        CHECK_EQ_INT(idx, n + 1);
        list[n++] = strdup(w);
        p += used;
        while (*p == ' ') p++;
    }
    CHECK(n > 200);
    int min_common = 1 << 30, max_rare = 0;
    for (int i = 0; i < n; i++) {
        int c = count_word(list, n, list[i]);
        bool common = false;
        for (int k = 0; k < s.n_answers; k++) common |= !strcmp(s.answers[k], list[i]);
        if (common) min_common = c < min_common ? c : min_common;
        else max_rare = c > max_rare ? c : max_rare;
    }
    for (int k = 0; k < s.n_answers; k++) CHECK(count_word(list, n, s.answers[k]) > 0);
    CHECK_EQ_INT(max_rare, 3);
    CHECK(min_common > max_rare);
    for (int i = 0; i < n; i++) free(list[i]);
    lethe_eval_sample_free(&s);
}

static void test_seeds(void) {
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) {
        lethe_eval_sample a, b, c;
        CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)t, g_c, 42, 1500, measure, NULL, &a), LETHE_OK);
        CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)t, g_c, 42, 1500, measure, NULL, &b), LETHE_OK);
        CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)t, g_c, 43, 1500, measure, NULL, &c), LETHE_OK);
        CHECK(!strcmp(a.user, b.user));
        CHECK(!strcmp(a.answer_prefix, b.answer_prefix));
        CHECK_EQ_INT(a.n_answers, b.n_answers);
        for (int i = 0; i < a.n_answers; i++) CHECK(!strcmp(a.answers[i], b.answers[i]));
        CHECK(strcmp(a.user, c.user) != 0);
        CHECK(strcmp(a.answers[0], c.answers[0]) != 0);
        lethe_eval_sample_free(&a);
        lethe_eval_sample_free(&b);
        lethe_eval_sample_free(&c);
    }
}

/* samples of different tasks and seeds are independent draws: no shared
 * numbers between passkey keys and vt values, different haystack starts */
static void test_independent_streams(void) {
    char keys[8][16], vals[8][16], start_pk[8][64], start_vt[8][64];
    for (int s = 0; s < 8; s++) {
        lethe_eval_sample a, b;
        CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_PASSKEY, g_c, (uint64_t)s, 600, measure, NULL, &a), LETHE_OK);
        CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_VT, g_c, (uint64_t)s, 600, measure, NULL, &b), LETHE_OK);
        snprintf(keys[s], sizeof(keys[s]), "%s", a.answers[0]);
        sscanf(strstr(b.user, "assigned the value ") + 19, "%15[0-9]", vals[s]);
        snprintf(start_pk[s], sizeof(start_pk[s]), "%.63s", strstr(a.user, "\n\n") + 2);
        snprintf(start_vt[s], sizeof(start_vt[s]), "%.63s", strstr(b.user, "\n\n") + 2);
        lethe_eval_sample_free(&a);
        lethe_eval_sample_free(&b);
    }
    for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) {
            CHECK_MSG(strcmp(keys[i], vals[j]) != 0, "passkey seed %d == vt seed %d value %s", i, j, keys[i]);
            CHECK_MSG(strcmp(start_pk[i], start_vt[j]) != 0, "same haystack start: passkey %d, vt %d", i, j);
        }
}

static void test_lengths(void) {
    /* several targets; the search costs O(log) measurements */
    const int32_t targets[] = {600, 1024, 4096};
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++)
        for (size_t k = 0; k < sizeof(targets) / sizeof(targets[0]); k++) {
            lethe_eval_sample s;
            g_calls = 0;
            CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)t, g_c, 5, targets[k], measure, NULL, &s),
                         LETHE_OK);
            check_length(&s, targets[k], t == LETHE_EVAL_CWE ? 12 : 80);
            CHECK_MSG(g_calls < 40, "%d measurements", g_calls);
            lethe_eval_sample_free(&s);
        }
}

static void test_errors(void) {
    lethe_eval_sample s;
    CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_PASSKEY, g_c, 1, 30, measure, NULL, &s), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "without any haystack");
    CHECK(s.user == NULL);
    CHECK_EQ_INT(lethe_eval_generate(LETHE_EVAL_PASSKEY, g_c, 1, 1 << 20, measure, NULL, &s),
                 LETHE_ERR_CAPACITY);
    CHECK_STR_CONTAINS(lethe_last_error(), "corpus is too small");
    CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)99, g_c, 1, 1000, measure, NULL, &s), LETHE_ERR_INVALID);
    CHECK_EQ_INT(lethe_eval_task_from_name("niah"), LETHE_EVAL_NIAH_MULTIKEY);
    CHECK_EQ_INT(lethe_eval_task_from_name("cwe"), LETHE_EVAL_CWE);
    CHECK_EQ_INT(lethe_eval_task_from_name("nope"), -1);
}

/* SmolLM2's tokenizer + chat template, as lethe_eval_measure_engine renders prompts */
typedef struct real_tok {
    lethe_tokenizer *t;
    lethe_chat_format f;
} real_tok;

static int32_t measure_real(void *ctx, const char *user, const char *prefix) {
    real_tok *rt = ctx;
    lethe_chat_msg m = {.role = "user", .content = user};
    char *chat = NULL;
    CHECK_EQ_INT(lethe_chat_render(rt->f, &m, 1, true, true, &chat), LETHE_OK);
    size_t a = strlen(chat), b = strlen(prefix);
    chat = realloc(chat, a + b + 1);
    memcpy(chat + a, prefix, b + 1);
    int32_t *ids = NULL, n = 0;
    CHECK_EQ_INT(lethe_tokenize(rt->t, chat, a + b, false, true, &ids, &n), LETHE_OK);
    free(ids);
    free(chat);
    return n;
}

static void test_real_tokenizer(void) {
    real_tok rt;
    CHECK_EQ_INT(lethe_tokenizer_load("models/SmolLM2-135M-Instruct.Q4_1.gguf", &rt.t), LETHE_OK);
    rt.f = lethe_chat_format_detect(rt.t);
    for (int t = 0; t < LETHE_EVAL_N_TASKS; t++) {
        lethe_eval_sample s;
        CHECK_EQ_INT(lethe_eval_generate((lethe_eval_task)t, g_c, 9, 2048 - 64, measure_real, &rt, &s), LETHE_OK);
        /* within one sentence (<= 400 bytes, ~100 tokens) or one cwe word (3 entries, ~12 tokens) */
        int32_t tol = t == LETHE_EVAL_CWE ? 16 : 100;
        CHECK_MSG(s.n_prompt_tokens <= 2048 - 64 && s.n_prompt_tokens >= 2048 - 64 - tol, "%s: %d tokens",
                  lethe_eval_task_name((lethe_eval_task)t), s.n_prompt_tokens);
        CHECK_STR_CONTAINS(s.user, s.answers[0]);
        lethe_eval_sample_free(&s);
    }
    lethe_tokenizer_free(rt.t);
}

int main(void) {
    TEST_RUN(test_corpus);
    TEST_RUN(test_passkey);
    TEST_RUN(test_niah);
    TEST_RUN(test_vt);
    TEST_RUN(test_cwe);
    TEST_RUN(test_seeds);
    TEST_RUN(test_independent_streams);
    TEST_RUN(test_lengths);
    TEST_RUN(test_errors);
    TEST_RUN(test_real_tokenizer);
    lethe_eval_corpus_free(g_c);
    return 0;
}
