/* test_tokenizer_gguf.c - the GGUF tokenizer path for Llama-3 ("llama-bpe")
 * and Qwen2/3 ("qwen2"), and GGUF tokenizer errors.
 *
 * No small Llama-3 / Qwen3 GGUF exists to commit, so the test writes one to
 * /tmp the way llama.cpp's converter lays it out: the HF tokenizer's pieces
 * as tokenizer.ggml.tokens, control / user-defined token types for special /
 * other added tokens, merges in rank order as "a b", the pre-tokenizer name,
 * no regex and no normalizer. Loaded back through lethe_tokenizer_load, it
 * must reproduce the HF golden ids of tests/data/tokenizer/<name>.ids, which
 * proves the built-in "llama-bpe" / "qwen2" pre-tokenizers (regex,
 * ignore_merges, NFC) equal the HF tokenizer.json pipelines. */
#include <unistd.h>

#include "gguf_writer.h"
#include "tok_golden.h"
#include "tokenizer/tok_internal.h"

typedef struct merge_rec {
    int32_t rank, a, b;
} merge_rec;

static int merge_cmp(const void *x, const void *y) {
    const merge_rec *p = x, *q = y;
    return (p->rank > q->rank) - (p->rank < q->rank);
}

static void kv_arr_i32(gw *w, const char *key, const int32_t *v, int n) {
    gw_key(w, key, 9);
    gw_u32(&w->kv, 5); /* INT32 */
    gw_u64(&w->kv, (uint64_t)n);
    gw_put(&w->kv, v, (size_t)n * sizeof(int32_t));
}

/* Writes a GGUF carrying t's vocabulary and merges; returns its path. */
static char *gguf_from(const lethe_tokenizer *t, const char *pre, bool add_bos) {
    int n = t->n_vocab;
    const char **pieces = lethe_xmalloc((size_t)n * sizeof(char *));
    int32_t *types = lethe_xmalloc((size_t)n * sizeof(int32_t));
    for (int i = 0; i < n; i++) {
        pieces[i] = t->arena + t->piece_off[i];
        uint8_t a = t->attr[i];
        types[i] = !(a & TOK_ATTR_SET) ? 5 : (a & TOK_ATTR_SPECIAL) ? 3 : (a & TOK_ATTR_ADDED) ? 4 : 1;
    }
    merge_rec *m = lethe_xmalloc((size_t)t->n_merges * sizeof(merge_rec));
    int nm = 0;
    for (uint32_t h = 0; h <= t->merges.mask; h++)
        if (t->merges.keys[h] != UINT64_MAX)
            m[nm++] = (merge_rec){t->merges.rank[h], (int32_t)(t->merges.keys[h] >> 32), (int32_t)(uint32_t)t->merges.keys[h]};
    CHECK_EQ_INT(nm, t->n_merges);
    qsort(m, (size_t)nm, sizeof(merge_rec), merge_cmp);
    char **mstr = lethe_xmalloc((size_t)nm * sizeof(char *));
    for (int i = 0; i < nm; i++) {
        const char *a = t->arena + t->piece_off[m[i].a], *b = t->arena + t->piece_off[m[i].b];
        mstr[i] = lethe_xmalloc(strlen(a) + strlen(b) + 2);
        sprintf(mstr[i], "%s %s", a, b);
    }
    gw w = {0};
    gw_kv_str(&w, "general.architecture", "llama");
    gw_kv_str(&w, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(&w, "tokenizer.ggml.pre", pre);
    gw_kv_arr_str(&w, "tokenizer.ggml.tokens", pieces, n);
    kv_arr_i32(&w, "tokenizer.ggml.token_type", types, n);
    gw_kv_arr_str(&w, "tokenizer.ggml.merges", (const char *const *)mstr, nm);
    if (t->bos >= 0) gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", (uint32_t)t->bos);
    if (t->eos >= 0) gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", (uint32_t)t->eos);
    gw_kv_bool(&w, "tokenizer.ggml.add_bos_token", add_bos);
    if (t->chat_template) gw_kv_str(&w, "tokenizer.chat_template", t->chat_template);
    size_t nb;
    uint8_t *bytes = gw_build(&w, &nb);
    char *path = tmp_write(bytes, nb, ".gguf");
    free(bytes);
    gw_free(&w);
    for (int i = 0; i < nm; i++) free(mstr[i]);
    free(mstr);
    free(m);
    free(pieces);
    free(types);
    return path;
}

/* every "I" line of the golden file must encode identically with t */
static int check_encode_golden(const lethe_tokenizer *t, const char *name) {
    char path[256];
    snprintf(path, sizeof(path), GOLDEN_DIR "%s.ids", name);
    gcur c = gopen(path);
    gline(&c); /* M line */
    int n_cases = 0;
    while (!gat_end(&c)) {
        char *h = gline(&c), tname[64];
        size_t nb;
        if (h[0] == 'D' || h[0] == 'S') {
            CHECK(sscanf(h + 2, "%63s %zu", tname, &nb) == 2);
            gbytes(&c, nb);
            continue;
        }
        int ps, n, off;
        CHECK(sscanf(h, "I %63s %d %d%n", tname, &ps, &n, &off) == 3);
        const text_case *tc = find_text(tname);
        int32_t *ids, m;
        CHECK(lethe_tokenize(t, tc->text, tc->len, false, ps != 0, &ids, &m) == LETHE_OK);
        char *p = h + off;
        CHECK_MSG(m == n, "%s/%s parse_special=%d: %d ids, want %d", name, tname, ps, m, n);
        for (int i = 0; i < n; i++) CHECK_MSG(ids[i] == (int32_t)strtol(p, &p, 10), "%s/%s: id %d", name, tname, i);
        free(ids);
        n_cases++;
    }
    free(c.buf);
    return n_cases;
}

static void check_family(const char *name, const char *pre) {
    lethe_tokenizer *hf = load_named_tokenizer(name);
    char *path = gguf_from(hf, pre, true);
    lethe_tokenizer *g = NULL;
    CHECK_MSG(lethe_tokenizer_load(path, &g) == LETHE_OK, "%s", lethe_last_error());
    CHECK_EQ_INT(lethe_tokenizer_n_vocab(g), lethe_tokenizer_n_vocab(hf));
    CHECK_EQ_INT(lethe_tokenizer_eos(g), lethe_tokenizer_eos(hf));
    CHECK(lethe_tokenizer_adds_bos(g) == (lethe_tokenizer_bos(hf) >= 0));
    CHECK(strcmp(lethe_tokenizer_chat_template(g), lethe_tokenizer_chat_template(hf)) == 0);
    int n = check_encode_golden(g, name);
    CHECK(n >= 40);
    fprintf(stderr, "    %s via GGUF pre \"%s\": %d golden encodings match\n", name, pre, n);
    lethe_tokenizer_free(g);
    unlink(path);
    free(path);
    lethe_tokenizer_free(hf);
}

static void test_llama_bpe(void) { check_family("llama3", "llama-bpe"); }
static void test_qwen2(void) { check_family("qwen3", "qwen2"); }

static lethe_status load_tiny(const char *model, const char *pre, bool with_tokens) {
    gw w = {0};
    const char *toks[] = {"a", "b", "ab"}, *merges[] = {"a b"};
    gw_kv_str(&w, "tokenizer.ggml.model", model);
    if (pre) gw_kv_str(&w, "tokenizer.ggml.pre", pre);
    if (with_tokens) gw_kv_arr_str(&w, "tokenizer.ggml.tokens", toks, 3);
    gw_kv_arr_str(&w, "tokenizer.ggml.merges", merges, 1);
    size_t nb;
    uint8_t *bytes = gw_build(&w, &nb);
    char *path = tmp_write(bytes, nb, ".gguf");
    lethe_tokenizer *t = NULL;
    lethe_status st = lethe_tokenizer_load(path, &t);
    if (st == LETHE_OK) {
        int32_t *ids, n;
        CHECK(lethe_tokenize(t, "abba", 4, true, false, &ids, &n) == LETHE_OK);
        CHECK(n == 3 && ids[0] == 2 && ids[1] == 1 && ids[2] == 0); /* "ab" "b" "a"; no BOS to add */
        CHECK(!lethe_tokenizer_adds_bos(t) && lethe_tokenizer_chat_template(t) == NULL);
        free(ids);
        lethe_tokenizer_free(t);
    }
    unlink(path);
    free(path);
    free(bytes);
    gw_free(&w);
    return st;
}

static void test_gguf_errors(void) {
    CHECK_EQ_INT(load_tiny("gpt2", "gpt2", true), LETHE_OK);
    CHECK_EQ_INT(load_tiny("gpt2", NULL, true), LETHE_OK); /* no pre: GPT-2 regex */
    CHECK_EQ_INT(load_tiny("llama", "gpt2", true), LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "llama");
    CHECK_EQ_INT(load_tiny("gpt2", "deepseek-coder", true), LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "deepseek-coder");
    CHECK_EQ_INT(load_tiny("gpt2", "gpt2", false), LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "tokenizer.ggml.tokens");
}

int main(void) {
    load_texts();
    TEST_RUN(test_gguf_errors);
    TEST_RUN(test_llama_bpe);
    TEST_RUN(test_qwen2);
    free(g_texts_file.buf);
    fprintf(stderr, "test_tokenizer_gguf: all passed\n");
    return 0;
}
