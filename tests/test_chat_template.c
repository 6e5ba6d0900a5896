/* test_chat_template.c - built-in chat formats against HF apply_chat_template.
 *
 * tests/data/tokenizer/chat_golden.txt holds, per tokenizer and conversation,
 * the prompt HF rendered with the model's own template (SmolLM2: the GGUF's
 * tokenizer.chat_template; Llama-3 and Qwen3: tokenizer_config.json; plus
 * "llama3-official", the Meta Llama-3 Instruct template whose generation
 * prompt is conditional). The format is detected from the loaded tokenizer,
 * then the rendering must match byte for byte. */
#include "tok_golden.h"
#include "tokenizer/chat_template.h"

static lethe_tokenizer *g_tok[3];
static const char *const g_names[3] = {"smollm2", "llama3", "qwen3"};

static lethe_chat_format format_for(const char *name) {
    if (!strcmp(name, "llama3-official")) name = "llama3";
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, g_names[i])) return lethe_chat_format_detect(g_tok[i]);
    CHECK_MSG(0, "unknown tokenizer %s in chat golden", name);
    return LETHE_CHAT_CHATML;
}

static void test_detect(void) {
    CHECK_EQ_INT(lethe_chat_format_detect(g_tok[0]), LETHE_CHAT_SMOLLM2);
    CHECK_EQ_INT(lethe_chat_format_detect(g_tok[1]), LETHE_CHAT_LLAMA3);
    CHECK_EQ_INT(lethe_chat_format_detect(g_tok[2]), LETHE_CHAT_QWEN3);
    CHECK(!strcmp(lethe_chat_format_name(LETHE_CHAT_SMOLLM2), "smollm2"));
    CHECK(!strcmp(lethe_chat_format_name(LETHE_CHAT_LLAMA3), "llama3"));
    /* without a template (tokenizer.json alone): the special tokens decide */
    char dir[512], tj[600];
    snprintf(tj, sizeof(tj), "%s/tokenizer.json", shared_tokenizer_dir("llama3", dir, sizeof(dir)));
    lethe_tokenizer *t;
    CHECK(lethe_tokenizer_from_hf(tj, NULL, &t) == LETHE_OK);
    CHECK(lethe_tokenizer_chat_template(t) == NULL);
    CHECK_EQ_INT(lethe_chat_format_detect(t), LETHE_CHAT_LLAMA3);
    lethe_tokenizer_free(t);
    snprintf(tj, sizeof(tj), "%s/tokenizer.json", shared_tokenizer_dir("qwen3", dir, sizeof(dir)));
    CHECK(lethe_tokenizer_from_hf(tj, NULL, &t) == LETHE_OK);
    CHECK_EQ_INT(lethe_chat_format_detect(t), LETHE_CHAT_CHATML);
    lethe_tokenizer_free(t);
    CHECK_EQ_INT(lethe_chat_format_detect(NULL), LETHE_CHAT_CHATML);
}

static void test_golden(void) {
    gcur c = gopen(GOLDEN_DIR "chat_golden.txt");
    int n_cases = 0;
    while (!gat_end(&c)) {
        char tname[64], cname[64];
        int gen, n_msgs;
        CHECK(sscanf(gline(&c), "C %63s %63s %d %d", tname, cname, &gen, &n_msgs) == 4);
        lethe_chat_msg msgs[16];
        char *owned[32];
        int n_owned = 0;
        CHECK(n_msgs > 0 && n_msgs <= 16);
        for (int i = 0; i < n_msgs; i++) {
            char role[32];
            size_t nb;
            CHECK(sscanf(gline(&c), "R %31s %zu", role, &nb) == 2);
            const char *b = gbytes(&c, nb);
            char *r = lethe_xstrdup(role), *content = lethe_xmalloc(nb + 1);
            memcpy(content, b, nb);
            content[nb] = '\0';
            owned[n_owned++] = r;
            owned[n_owned++] = content;
            msgs[i] = (lethe_chat_msg){.role = r, .content = content};
        }
        size_t nb;
        CHECK(sscanf(gline(&c), "E %zu", &nb) == 1);
        const char *want = gbytes(&c, nb);
        lethe_chat_format f = format_for(tname);
        char *out;
        CHECK(lethe_chat_render(f, msgs, (size_t)n_msgs, gen != 0, true, &out) == LETHE_OK);
        CHECK_MSG(strlen(out) == nb && memcmp(out, want, nb) == 0, "%s/%s gen=%d (%s):\n--- got\n%s\n--- want\n%.*s", tname,
                  cname, gen, lethe_chat_format_name(f), out, (int)nb, want);
        free(out);
        /* include_bos=false renders the same without the BOS text (Llama-3's only) */
        CHECK(lethe_chat_render(f, msgs, (size_t)n_msgs, gen != 0, false, &out) == LETHE_OK);
        const char *bos = "<|begin_of_text|>";
        size_t skip = (f == LETHE_CHAT_LLAMA3) ? strlen(bos) : 0;
        if (skip) CHECK(strncmp(want, bos, skip) == 0);
        CHECK(strlen(out) == nb - skip && memcmp(out, want + skip, nb - skip) == 0);
        free(out);
        for (int i = 0; i < n_owned; i++) free(owned[i]);
        n_cases++;
    }
    CHECK(n_cases >= 40);
    fprintf(stderr, "    %d golden conversations\n", n_cases);
    free(c.buf);
}

static void test_render_edges(void) {
    char *out;
    /* no messages: only the generation prompt (SmolLM2's default system prompt is per-conversation) */
    CHECK(lethe_chat_render(LETHE_CHAT_SMOLLM2, NULL, 0, true, true, &out) == LETHE_OK);
    CHECK(strcmp(out, "<|im_start|>assistant\n") == 0);
    free(out);
    CHECK(lethe_chat_render(LETHE_CHAT_LLAMA3, NULL, 0, false, false, &out) == LETHE_OK);
    CHECK(strcmp(out, "") == 0);
    free(out);
    /* a plain ChatML model has no default system prompt */
    lethe_chat_msg m = {.role = "user", .content = "hi"};
    CHECK(lethe_chat_render(LETHE_CHAT_CHATML, &m, 1, true, true, &out) == LETHE_OK);
    CHECK(strcmp(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == 0);
    free(out);
    lethe_chat_msg bad = {.role = "user", .content = NULL};
    CHECK_EQ_INT(lethe_chat_render(LETHE_CHAT_CHATML, &bad, 1, true, true, &out), LETHE_ERR_INVALID);
    CHECK(out == NULL);
    CHECK_EQ_INT(lethe_chat_render((lethe_chat_format)99, &m, 1, true, true, &out), LETHE_ERR_INVALID);
    /* the rendered prompt tokenizes into the model's control tokens */
    CHECK(lethe_chat_render(LETHE_CHAT_SMOLLM2, &m, 1, true, true, &out) == LETHE_OK);
    int32_t *ids, n;
    CHECK(lethe_tokenize(g_tok[0], out, strlen(out), false, true, &ids, &n) == LETHE_OK);
    CHECK_EQ_INT(ids[0], lethe_tokenizer_find_token(g_tok[0], "<|im_start|>"));
    int n_end = 0;
    for (int i = 0; i < n; i++) n_end += ids[i] == lethe_tokenizer_find_token(g_tok[0], "<|im_end|>");
    CHECK_EQ_INT(n_end, 2);
    free(ids);
    free(out);
}

int main(void) {
    for (int i = 0; i < 3; i++) g_tok[i] = load_named_tokenizer(g_names[i]);
    TEST_RUN(test_detect);
    TEST_RUN(test_golden);
    TEST_RUN(test_render_edges);
    for (int i = 0; i < 3; i++) lethe_tokenizer_free(g_tok[i]);
    fprintf(stderr, "test_chat_template: all passed\n");
    return 0;
}
