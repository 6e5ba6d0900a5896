/* test_tokenizer.c - byte-level BPE against HF tokenizers goldens.
 *
 * For SmolLM2 (from the GGUF in models/), Llama-3 and Qwen3 (tokenizer.json
 * in ../shared/data/tokenizers): every text of tests/data/tokenizer/texts.txt
 * must encode to exactly the ids HF produced, with and without special-token
 * parsing; decoding must give HF's decode (the text itself except where NFC
 * changed it); the streaming detokenizer must emit the same text in valid
 * UTF-8 chunks. Plus: byte map, invalid UTF-8 input and output, loading by
 * path (GGUF, folder, dummy config.json), malformed files, long inputs and
 * the speed of tokenizing a whole speech. */
#include <math.h>
#include <unistd.h>

#include "tok_golden.h"
#include "tokenizer/tok_internal.h"

static bool valid_utf8(const char *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        int k = tok_utf8_get(s + i, n - i, &cp);
        if (k <= 0) return false;
        i += (size_t)k;
    }
    return true;
}

/* streams ids through lethe_detok; checks every chunk is whole UTF-8; returns the text */
static char *stream_decode(const lethe_tokenizer *t, const int32_t *ids, int32_t n, bool skip, int *n_held) {
    size_t cap = 3 * (lethe_tokenizer_max_token_bytes(t) + 4) + 1;
    char *chunk = malloc(cap), *all = malloc((size_t)n * cap + cap);
    size_t len = 0;
    lethe_detok d;
    lethe_detok_init(&d, t, skip);
    *n_held = 0;
    for (int32_t i = 0; i < n; i++) {
        size_t k = lethe_detok_push(&d, ids[i], chunk, cap);
        CHECK(k < cap && chunk[k] == '\0');
        CHECK_MSG(valid_utf8(chunk, k), "chunk after token %d is not whole UTF-8", i);
        if (d.n_pending > 0) (*n_held)++;
        memcpy(all + len, chunk, k);
        len += k;
    }
    size_t k = lethe_detok_flush(&d, chunk, cap);
    memcpy(all + len, chunk, k);
    len += k;
    all[len] = '\0';
    free(chunk);
    return all;
}

/* one tokenizer against its .ids golden file */
static void check_golden(const char *name) {
    lethe_tokenizer *t = load_named_tokenizer(name);
    char path[256];
    snprintf(path, sizeof(path), GOLDEN_DIR "%s.ids", name);
    gcur c = gopen(path);
    int n_vocab, bos, eos, adds_bos;
    CHECK(sscanf(gline(&c), "M n_vocab %d bos %d eos %d adds_bos %d", &n_vocab, &bos, &eos, &adds_bos) == 4);
    CHECK_EQ_INT(lethe_tokenizer_n_vocab(t), n_vocab);
    CHECK_EQ_INT(lethe_tokenizer_bos(t), bos);
    CHECK_EQ_INT(lethe_tokenizer_eos(t), eos);
    CHECK_EQ_INT(lethe_tokenizer_adds_bos(t), adds_bos);
    CHECK(lethe_tokenizer_is_eog(t, eos));

    int n_cases = 0, n_split_chars = 0;
    char *dec = NULL;
    const text_case *tc = NULL;
    int32_t *ids = NULL, n_ids = 0;
    while (!gat_end(&c)) {
        char *h = gline(&c);
        char tname[64];
        if (h[0] == 'I') {
            int ps, n, off;
            CHECK(sscanf(h, "I %63s %d %d%n", tname, &ps, &n, &off) == 3);
            tc = find_text(tname);
            int32_t *want = lethe_xmalloc((size_t)(n + 1) * sizeof(int32_t));
            char *p = h + off;
            for (int i = 0; i < n; i++) want[i] = (int32_t)strtol(p, &p, 10);
            free(ids);
            lethe_status st = lethe_tokenize(t, tc->text, tc->len, false, ps != 0, &ids, &n_ids);
            CHECK_MSG(st == LETHE_OK, "%s", lethe_last_error());
            int first_diff = -1;
            for (int i = 0; i < LETHE_MIN(n, n_ids) && first_diff < 0; i++)
                if (ids[i] != want[i]) first_diff = i;
            if (first_diff < 0 && n != n_ids) first_diff = LETHE_MIN(n, n_ids);
            CHECK_MSG(first_diff < 0, "%s/%s parse_special=%d: %d ids vs %d expected, first difference at %d (%d vs %d)",
                      name, tname, ps, n_ids, n, first_diff, first_diff < n_ids ? ids[first_diff] : -1,
                      first_diff < n ? want[first_diff] : -1);
            free(want);
            n_cases++;
            /* add_bos prepends BOS (when there is one) */
            int32_t *ids_b, n_b;
            CHECK(lethe_tokenize(t, tc->text, tc->len, true, ps != 0, &ids_b, &n_b) == LETHE_OK);
            CHECK_EQ_INT(n_b, n_ids + (bos >= 0));
            if (bos >= 0) CHECK_EQ_INT(ids_b[0], bos);
            free(ids_b);
            if (ps == 1) { /* decode checks follow (D / S lines are optional) */
                free(dec);
                dec = lethe_detokenize(t, ids, n_ids, false);
                char *next = gat_end(&c) ? NULL : c.buf + c.pos;
                const char *want_dec = tc->text;
                size_t want_len = tc->len;
                if (next && next[0] == 'D') {
                    size_t nb;
                    CHECK(sscanf(gline(&c), "D %63s %zu", tname, &nb) == 2);
                    want_dec = gbytes(&c, nb);
                    want_len = nb;
                }
                CHECK_MSG(strlen(dec) == want_len && memcmp(dec, want_dec, want_len) == 0, "%s/%s: decode differs", name,
                          tc->name);
                int held;
                char *streamed = stream_decode(t, ids, n_ids, false, &held);
                CHECK_MSG(strcmp(streamed, dec) == 0, "%s/%s: streamed decode differs", name, tc->name);
                n_split_chars += held;
                free(streamed);
                char *sk = lethe_detokenize(t, ids, n_ids, true);
                next = gat_end(&c) ? NULL : c.buf + c.pos;
                if (next && next[0] == 'S') {
                    size_t nb;
                    CHECK(sscanf(gline(&c), "S %63s %zu", tname, &nb) == 2);
                    const char *want_sk = gbytes(&c, nb);
                    CHECK_MSG(strlen(sk) == nb && memcmp(sk, want_sk, nb) == 0, "%s/%s: skip_special decode differs",
                              name, tc->name);
                    char *sk_stream = stream_decode(t, ids, n_ids, true, &held);
                    CHECK(strcmp(sk_stream, sk) == 0);
                    free(sk_stream);
                } else {
                    CHECK(strcmp(sk, dec) == 0);
                }
                free(sk);
            }
        } else {
            CHECK_MSG(0, "%s: unexpected line %.20s", path, h);
        }
    }
    CHECK_EQ_INT(n_cases, 2 * g_n_texts);
    /* emoji / CJK split across byte-level tokens somewhere: the streamer had to hold bytes */
    CHECK(n_split_chars > 0);
    fprintf(stderr, "    %s: %d cases, %d tokens ended inside a UTF-8 character\n", name, n_cases, n_split_chars);
    free(ids);
    free(dec);
    free(c.buf);
    lethe_tokenizer_free(t);
}

static void test_golden_smollm2(void) { check_golden("smollm2"); }
static void test_golden_llama3(void) { check_golden("llama3"); }
static void test_golden_qwen3(void) { check_golden("qwen3"); }

static void test_byte_map(void) {
    /* GPT-2 bytes_to_unicode: printable bytes map to themselves, ' ' -> U+0120 'Ġ', '\n' -> U+010A 'Ċ' */
    CHECK_EQ_INT(tok_byte_to_cp('a'), 'a');
    CHECK_EQ_INT(tok_byte_to_cp(' '), 0x120);
    CHECK_EQ_INT(tok_byte_to_cp('\n'), 0x10A);
    CHECK_EQ_INT(tok_byte_to_cp(0xAD), 0x143);
    CHECK_EQ_INT(tok_byte_to_cp(0x7F), 0x121);
    int seen[324] = {0};
    for (int b = 0; b < 256; b++) {
        uint32_t cp = tok_byte_to_cp((uint8_t)b);
        CHECK(cp < 324 && !seen[cp]);
        seen[cp] = 1;
        CHECK_EQ_INT(tok_cp_to_byte(cp), b);
    }
    CHECK_EQ_INT(tok_cp_to_byte(0x144), -1);
    CHECK_EQ_INT(tok_cp_to_byte(0xAD), -1);
}

static void test_detok_invalid_utf8(void) {
    lethe_tokenizer *t = load_named_tokenizer("qwen3");
    struct { const char *in; size_t n; const char *out; } cases[] = {
        {"\xE2\x82" "A", 3, "\xEF\xBF\xBD" "A"},                         /* truncated sequence, then ASCII */
        {"\xC0\x80", 2, "\xEF\xBF\xBD\xEF\xBF\xBD"},                    /* overlong: two ill-formed bytes */
        {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},    /* surrogate */
        {"ok\xF0\x9F\x98", 5, "ok\xEF\xBF\xBD"},                         /* cut at the end: flush gives one U+FFFD */
        {"\xF0\x9F\x98\x80", 4, "\xF0\x9F\x98\x80"},                     /* complete emoji */
        {"a\xFF" "b", 3, "a\xEF\xBF\xBD" "b"},
    };
    for (size_t i = 0; i < LETHE_ARRAY_LEN(cases); i++) {
        int32_t *ids, n;
        CHECK(lethe_tokenize(t, cases[i].in, cases[i].n, false, false, &ids, &n) == LETHE_OK);
        /* invalid bytes survive encoding: full decode gives them back as they were */
        char *raw = lethe_detokenize(t, ids, n, false);
        CHECK(strlen(raw) == cases[i].n && memcmp(raw, cases[i].in, cases[i].n) == 0);
        /* push one byte-token at a time to exercise holding */
        int32_t *bids = lethe_xmalloc(cases[i].n * sizeof(int32_t));
        for (size_t k = 0; k < cases[i].n; k++) bids[k] = t->byte_id[(uint8_t)cases[i].in[k]];
        int held;
        char *s1 = stream_decode(t, ids, n, false, &held);
        char *s2 = stream_decode(t, bids, (int32_t)cases[i].n, false, &held);
        CHECK_MSG(strcmp(s1, cases[i].out) == 0 && strcmp(s2, cases[i].out) == 0, "case %zu", i);
        free(s1);
        free(s2);
        free(bids);
        free(raw);
        free(ids);
    }
    /* a 4-byte character split over byte tokens is held until complete */
    lethe_detok d;
    lethe_detok_init(&d, t, false);
    char out[64];
    const char *emoji = "\xF0\x9F\x98\x80";
    for (int k = 0; k < 3; k++) CHECK_EQ_INT(lethe_detok_push(&d, t->byte_id[(uint8_t)emoji[k]], out, sizeof(out)), 0);
    CHECK_EQ_INT(lethe_detok_push(&d, t->byte_id[(uint8_t)emoji[3]], out, sizeof(out)), 4);
    CHECK(strcmp(out, emoji) == 0);
    /* skip_special drops control tokens, keeps text */
    lethe_detok_init(&d, t, true);
    CHECK_EQ_INT(lethe_detok_push(&d, lethe_tokenizer_find_token(t, "<|im_end|>"), out, sizeof(out)), 0);
    lethe_detok_init(&d, t, false);
    CHECK_EQ_INT(lethe_detok_push(&d, lethe_tokenizer_find_token(t, "<|im_end|>"), out, sizeof(out)), 10);
    CHECK(strcmp(out, "<|im_end|>") == 0);
    /* out-of-range ids are ignored */
    CHECK_EQ_INT(lethe_detok_push(&d, -5, out, sizeof(out)), 0);
    CHECK_EQ_INT(lethe_detok_push(&d, 1 << 30, out, sizeof(out)), 0);
    CHECK(lethe_token_bytes(t, -1, NULL) == NULL);
    lethe_tokenizer_free(t);
}

static void test_special_ids(void) {
    lethe_tokenizer *s = load_named_tokenizer("smollm2");
    CHECK_EQ_INT(lethe_tokenizer_find_token(s, "<|im_end|>"), 2);
    CHECK(lethe_tokenizer_is_eog(s, 2) && lethe_tokenizer_is_eog(s, 0) && !lethe_tokenizer_is_eog(s, 1));
    CHECK_STR_CONTAINS(lethe_tokenizer_chat_template(s), "named SmolLM");
    CHECK_EQ_INT(lethe_tokenizer_find_token(s, "no such piece"), -1);
    lethe_tokenizer_free(s);
    lethe_tokenizer *l = load_named_tokenizer("llama3");
    CHECK(lethe_tokenizer_is_eog(l, lethe_tokenizer_find_token(l, "<|eot_id|>")));
    CHECK(lethe_tokenizer_is_eog(l, lethe_tokenizer_find_token(l, "<|end_of_text|>")));
    CHECK(!lethe_tokenizer_is_eog(l, lethe_tokenizer_find_token(l, "<|begin_of_text|>")));
    CHECK_EQ_INT(lethe_tokenizer_find_token(l, "Ġthe"), 279);
    lethe_tokenizer_free(l);
    lethe_tokenizer *q = load_named_tokenizer("qwen3");
    CHECK(lethe_tokenizer_is_eog(q, lethe_tokenizer_find_token(q, "<|im_end|>")));
    CHECK(lethe_tokenizer_is_eog(q, lethe_tokenizer_find_token(q, "<|endoftext|>")));
    CHECK(!lethe_tokenizer_adds_bos(q) && lethe_tokenizer_bos(q) == -1);
    lethe_tokenizer_free(q);
}

static void write_file(const char *path, const char *s) {
    FILE *f = fopen(path, "w");
    CHECK(f);
    fputs(s, f);
    fclose(f);
}

static void test_load_paths(void) {
    char dir[] = "/tmp/lethe_tok_XXXXXX", p[512], sdir[512], shared[600];
    CHECK(mkdtemp(dir) != NULL);
    lethe_tokenizer *t = NULL;
    /* dummy weights: config.json without a tokenizer */
    snprintf(p, sizeof(p), "%s/config.json", dir);
    write_file(p, "{\"architectures\": [\"LlamaForCausalLM\"]}");
    CHECK_EQ_INT(lethe_tokenizer_load(p, &t), LETHE_ERR_NOT_FOUND);
    CHECK_STR_CONTAINS(lethe_last_error(), "token ids");
    CHECK_EQ_INT(lethe_tokenizer_load(dir, &t), LETHE_ERR_NOT_FOUND);
    CHECK(t == NULL);
    /* with tokenizer.json beside it (no tokenizer_config.json) */
    snprintf(p, sizeof(p), "%s/tokenizer.json", dir);
    snprintf(shared, sizeof(shared), "%s/tokenizer.json", shared_tokenizer_dir("qwen3", sdir, sizeof(sdir)));
    char abs_shared[1024];
    CHECK(realpath(shared, abs_shared) != NULL);
    CHECK(symlink(abs_shared, p) == 0);
    snprintf(p, sizeof(p), "%s/config.json", dir);
    CHECK_MSG(lethe_tokenizer_load(p, &t) == LETHE_OK, "%s", lethe_last_error());
    CHECK(lethe_tokenizer_chat_template(t) == NULL);
    CHECK_EQ_INT(lethe_tokenizer_eos(t), lethe_tokenizer_find_token(t, "<|endoftext|>"));
    lethe_tokenizer_free(t);
    CHECK(lethe_tokenizer_load(dir, &t) == LETHE_OK);
    lethe_tokenizer_free(t);
    /* malformed files */
    snprintf(p, sizeof(p), "%s/bad.json", dir);
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_FORMAT);
    write_file(p, "{\"model\": {\"type\": \"WordPiece\", \"vocab\": {\"a\": 0}}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_UNSUPPORTED);
    CHECK_STR_CONTAINS(lethe_last_error(), "WordPiece");
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -3}, \"merges\": []}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_FORMAT);
    /* sparse ids (found by fuzz_tokenizer_json: 12M-entry tables from a 1 KB file) */
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 12222239}, \"merges\": []}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "token ids up to 12222239 for 2 tokens");
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a\"]}, "
                  "\"pre_tokenizer\": {\"type\": \"ByteLevel\"}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_FORMAT);
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, "
                  "\"pre_tokenizer\": {\"type\": \"Metaspace\"}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_UNSUPPORTED);
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}, \"pre_tokenizer\": "
                  "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}, \"behavior\": \"Isolated\"}}");
    CHECK_EQ_INT(lethe_tokenizer_from_hf(p, NULL, &t), LETHE_ERR_FORMAT);
    CHECK_STR_CONTAINS(lethe_last_error(), "regex");
    /* a minimal valid byte-level tokenizer: ByteLevel prefix space, literal Split, merges as pairs */
    write_file(p, "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"Ġ\": 0, \"a\": 1, \"b\": 2, \"Ġa\": 3, \"Ġab\": 4, "
                  "\"-\": 5}, \"merges\": [[\"Ġ\", \"a\"], \"Ġa b\"]}, \"pre_tokenizer\": {\"type\": \"Sequence\", "
                  "\"pretokenizers\": [{\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"use_regex\": false}, "
                  "{\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, \"behavior\": \"Isolated\"}]}, "
                  "\"added_tokens\": [{\"id\": 6, \"content\": \"<x>\", \"special\": true, \"rstrip\": true}]}");
    CHECK_MSG(lethe_tokenizer_from_hf(p, NULL, &t) == LETHE_OK, "%s", lethe_last_error());
    int32_t *ids, n;
    CHECK(lethe_tokenize(t, "ab-<x>  ab", 10, false, true, &ids, &n) == LETHE_OK);
    /* " ab" (prefix space) "-" | <x> eats the spaces after it | " ab" (prefix space again) */
    int32_t want[] = {4, 5, 6, 4};
    CHECK_EQ_INT(n, 4);
    for (int i = 0; i < 4; i++) CHECK_EQ_INT(ids[i], want[i]);
    free(ids);
    /* bytes with no piece and no unk token are refused, never dropped (HF drops them): a text
     * made only of them is not "empty", and one inside a word is named */
    CHECK_EQ_INT(lethe_tokenize(t, "zz", 2, false, true, &ids, &n), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "byte 0x7a has no token");
    CHECK(ids == NULL && n == 0);
    CHECK_EQ_INT(lethe_tokenize(t, "abza", 4, false, true, &ids, &n), LETHE_ERR_INVALID);
    CHECK_EQ_INT(lethe_tokenize(t, "\xff", 1, false, true, &ids, &n), LETHE_ERR_INVALID);
    CHECK_STR_CONTAINS(lethe_last_error(), "byte 0xff");
    lethe_tokenizer_free(t);
    CHECK_EQ_INT(lethe_tokenizer_load("/nonexistent/model.gguf", &t), LETHE_ERR_IO);
    unlink(p);
    snprintf(p, sizeof(p), "%s/tokenizer.json", dir);
    unlink(p);
    snprintf(p, sizeof(p), "%s/config.json", dir);
    unlink(p);
    rmdir(dir);
}

static void test_long_inputs(void) {
    lethe_tokenizer *t = load_named_tokenizer("llama3");
    size_t n = 200000;
    char *s = lethe_xmalloc(n + 1);
    const char *fills[] = {" ", "a", "\n", "9", "é"};
    for (size_t f = 0; f < LETHE_ARRAY_LEN(fills); f++) {
        size_t fl = strlen(fills[f]), len = (n / fl) * fl;
        for (size_t i = 0; i < len; i += fl) memcpy(s + i, fills[f], fl);
        s[len] = '\0';
        int32_t *ids, m;
        double t0 = lethe_time_s();
        CHECK_MSG(lethe_tokenize(t, s, len, false, true, &ids, &m) == LETHE_OK, "%s", lethe_last_error());
        double dt = lethe_time_s() - t0;
        char *d = lethe_detokenize(t, ids, m, false);
        CHECK(strlen(d) == len && memcmp(d, s, len) == 0);
        CHECK_MSG(dt < 2.0, "%zu bytes of '%s' took %.2f s", len, fills[f], dt);
        free(d);
        free(ids);
    }
    free(s);
    lethe_tokenizer_free(t);
}

/* one tokenizer shared by several threads (the server tokenizes on request threads) */
static void test_concurrent(void) {
    lethe_tokenizer *t = load_named_tokenizer("qwen3");
    int32_t *ref_ids[64], ref_n[64];
    for (int i = 0; i < g_n_texts; i++)
        CHECK(lethe_tokenize(t, g_texts[i].text, g_texts[i].len, false, true, &ref_ids[i], &ref_n[i]) == LETHE_OK);
    int bad = 0;
#pragma omp parallel for num_threads(4) schedule(dynamic) reduction(+ : bad)
    for (int k = 0; k < 8 * g_n_texts; k++) {
        int i = k % g_n_texts;
        int32_t *ids, n;
        if (lethe_tokenize(t, g_texts[i].text, g_texts[i].len, false, true, &ids, &n) != LETHE_OK) {
            bad++;
            continue;
        }
        bad += n != ref_n[i] || memcmp(ids, ref_ids[i], (size_t)n * sizeof(int32_t)) != 0;
        free(ids);
    }
    CHECK_EQ_INT(bad, 0);
    for (int i = 0; i < g_n_texts; i++) free(ref_ids[i]);
    lethe_tokenizer_free(t);
}

static void test_speed_whole_speech(void) {
    char path[512];
    struct stat sb;
    snprintf(path, sizeof(path), "../shared/data/sotu/1946_harry_s_truman_d.txt");
    if (stat(path, &sb) != 0) snprintf(path, sizeof(path), "/work/shared/data/sotu/1946_harry_s_truman_d.txt");
    char *text;
    size_t len;
    CHECK_MSG(lethe_read_file(path, &text, &len) == LETHE_OK, "%s", lethe_last_error());
    const char *names[] = {"smollm2", "llama3", "qwen3"};
    for (int k = 0; k < 3; k++) {
        lethe_tokenizer *t = load_named_tokenizer(names[k]);
        int32_t *ids, n;
        double t0 = lethe_time_s();
        CHECK(lethe_tokenize(t, text, len, false, false, &ids, &n) == LETHE_OK);
        double dt = lethe_time_s() - t0;
        char *d = lethe_detokenize(t, ids, n, false);
        CHECK(strlen(d) == len && memcmp(d, text, len) == 0);
        fprintf(stderr, "    %s: %zu bytes -> %d tokens in %.1f ms (%.0f tokens/s)\n", names[k], len, n, dt * 1e3,
                n / dt);
        CHECK(n > 30000);
        CHECK_MSG(dt < 1.0, "tokenizing a whole speech took %.2f s", dt);
        free(d);
        free(ids);
        lethe_tokenizer_free(t);
    }
    free(text);
}

int main(void) {
    load_texts();
    TEST_RUN(test_byte_map);
    TEST_RUN(test_golden_smollm2);
    TEST_RUN(test_golden_llama3);
    TEST_RUN(test_golden_qwen3);
    TEST_RUN(test_detok_invalid_utf8);
    TEST_RUN(test_special_ids);
    TEST_RUN(test_load_paths);
    TEST_RUN(test_long_inputs);
    TEST_RUN(test_concurrent);
    TEST_RUN(test_speed_whole_speech);
    free(g_texts_file.buf);
    fprintf(stderr, "test_tokenizer: all passed\n");
    return 0;
}
