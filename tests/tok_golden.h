/* tok_golden.h - readers for the tokenizer / chat golden files written by
 * tests/gen/gen_tokenizer_golden.py (formats documented there), and path
 * helpers for the shared tokenizers (../shared/data/tokenizers relative to
 * the repo root, else /work/shared/data/tokenizers). Used by
 * test_tokenizer.c and test_chat_template.c. */
#ifndef LETHE_TOK_GOLDEN_H
#define LETHE_TOK_GOLDEN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/util.h"
#include "test.h"
#include "tokenizer/tokenizer.h"

#define GOLDEN_DIR "tests/data/tokenizer/"
#define SMOLLM2_GGUF "models/SmolLM2-135M-Instruct.Q4_1.gguf"

/* a cursor over a whole golden file */
typedef struct gcur {
    char *buf;
    size_t n, pos;
} gcur;

static inline gcur gopen(const char *path) {
    gcur c = {0};
    lethe_status st = lethe_read_file(path, &c.buf, &c.n);
    CHECK_MSG(st == LETHE_OK, "%s: %s", path, lethe_last_error());
    return c;
}

static inline bool gat_end(gcur *c) { return c->pos >= c->n; }

/* the next header line (without '\n'), NUL-terminated in place */
static inline char *gline(gcur *c) {
    CHECK(c->pos < c->n);
    char *s = c->buf + c->pos, *nl = memchr(s, '\n', c->n - c->pos);
    CHECK(nl != NULL);
    *nl = '\0';
    c->pos = (size_t)(nl - c->buf) + 1;
    return s;
}

/* n raw bytes followed by '\n'; returned pointer is into the buffer (not NUL-terminated) */
static inline const char *gbytes(gcur *c, size_t n) {
    CHECK(c->pos + n + 1 <= c->n && c->buf[c->pos + n] == '\n');
    const char *s = c->buf + c->pos;
    c->pos += n + 1;
    return s;
}

static inline const char *shared_tokenizer_dir(const char *name, char *buf, size_t cap) {
    struct stat sb;
    snprintf(buf, cap, "../shared/data/tokenizers/%s", name);
    if (stat(buf, &sb) == 0) return buf;
    snprintf(buf, cap, "/work/shared/data/tokenizers/%s", name);
    CHECK_MSG(stat(buf, &sb) == 0, "shared tokenizer %s not found (../shared or /work/shared)", name);
    return buf;
}

/* "smollm2" -> the default GGUF; "llama3" / "qwen3" -> the shared HF folders */
static inline lethe_tokenizer *load_named_tokenizer(const char *name) {
    char dir[512];
    const char *path = strcmp(name, "smollm2") == 0 ? SMOLLM2_GGUF : shared_tokenizer_dir(name, dir, sizeof(dir));
    lethe_tokenizer *t = NULL;
    lethe_status st = lethe_tokenizer_load(path, &t);
    CHECK_MSG(st == LETHE_OK, "loading %s (%s): %s", name, path, lethe_last_error());
    return t;
}

typedef struct text_case {
    char name[64];
    const char *text;
    size_t len;
} text_case;

static text_case g_texts[64];
static int g_n_texts;
static gcur g_texts_file;

static inline void load_texts(void) {
    g_texts_file = gopen(GOLDEN_DIR "texts.txt");
    while (!gat_end(&g_texts_file)) {
        char *h = gline(&g_texts_file);
        size_t n;
        CHECK(g_n_texts < 64);
        text_case *tc = &g_texts[g_n_texts++];
        CHECK(sscanf(h, "T %63s %zu", tc->name, &n) == 2);
        tc->text = gbytes(&g_texts_file, n);
        tc->len = n;
    }
    CHECK(g_n_texts >= 20);
}

static inline const text_case *find_text(const char *name) {
    for (int i = 0; i < g_n_texts; i++)
        if (!strcmp(g_texts[i].name, name)) return &g_texts[i];
    CHECK_MSG(0, "no text %s", name);
    return NULL;
}

#endif /* LETHE_TOK_GOLDEN_H */
