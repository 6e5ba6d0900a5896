/* corpus.c - a folder of text files as haystack material for the eval tasks.
 *
 * Files are read in name order (so a seed means the same text on every
 * machine), whitespace runs are collapsed to one space, and the text is cut
 * into sentences at '.', '!' or '?' followed by a space. Sentences shorter
 * than 20 or longer than 400 bytes are dropped (headings, tables, run-ons) so
 * the haystack grows in small steps. The word pool (unique lower-case ASCII
 * words of 4..10 letters) feeds common-word extraction and needle keys. */
#include "eval/eval.h"

#include <ctype.h>
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/util.h"

#define MIN_SENTENCE 20
#define MAX_SENTENCE 400

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool wanted_name(const char *name) {
    size_t n = strlen(name);
    if (name[0] == '.') return false;
    return (n > 4 && !strcmp(name + n - 4, ".txt")) || (n > 3 && !strcmp(name + n - 3, ".md"));
}

/* Collapses whitespace runs to one space, trims both ends, in place. */
static size_t normalize_ws(char *s, size_t n) {
    size_t w = 0;
    bool space = false;
    for (size_t r = 0; r < n; r++) {
        unsigned char ch = (unsigned char)s[r];
        if (isspace(ch)) {
            space = w > 0;
            continue;
        }
        if (space) s[w++] = ' ';
        space = false;
        s[w++] = (char)ch;
    }
    s[w] = '\0';
    return w;
}

static void add_sentences(lethe_eval_corpus *c, const char *doc, int32_t *cap) {
    const char *start = doc;
    for (const char *p = doc; *p; p++) {
        bool end = (*p == '.' || *p == '!' || *p == '?') && (p[1] == ' ' || p[1] == '\0');
        if (!end) continue;
        size_t len = (size_t)(p + 1 - start);
        if (len >= MIN_SENTENCE && len <= MAX_SENTENCE) {
            if (c->n_sentences == *cap) {
                *cap = *cap ? *cap * 2 : 1024;
                c->sentences = lethe_xrealloc(c->sentences, (size_t)*cap * sizeof(char *));
            }
            char *s = lethe_xmalloc(len + 1);
            memcpy(s, start, len);
            s[len] = '\0';
            c->sentences[c->n_sentences++] = s;
        }
        start = p[1] ? p + 2 : p + 1;
    }
}

static void add_words(const char *doc, char ***words, size_t *n, size_t *cap) {
    const char *p = doc;
    while (*p) {
        if (!isalpha((unsigned char)*p)) {
            p++;
            continue;
        }
        const char *b = p;
        while (isalpha((unsigned char)*p)) p++;
        size_t len = (size_t)(p - b);
        /* skip words glued to digits or non-ASCII bytes ("1st", "naïve") */
        bool clean = (b == doc || (!((unsigned char)b[-1] & 0x80) && !isdigit((unsigned char)b[-1]))) &&
                     !((unsigned char)*p & 0x80) && !isdigit((unsigned char)*p);
        if (!clean || len < 4 || len > 10) continue;
        if (*n == *cap) {
            *cap = *cap ? *cap * 2 : 4096;
            *words = lethe_xrealloc(*words, *cap * sizeof(char *));
        }
        char *w = lethe_xmalloc(len + 1);
        for (size_t i = 0; i < len; i++) w[i] = (char)tolower((unsigned char)b[i]);
        w[len] = '\0';
        (*words)[(*n)++] = w;
    }
}

lethe_status lethe_eval_corpus_load(const char *dir, lethe_eval_corpus **out) {
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d) return lethe_errorf(LETHE_ERR_IO, "corpus %s: cannot open folder", dir);
    char **names = NULL;
    size_t n_names = 0, cap_names = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!wanted_name(de->d_name)) continue;
        if (n_names == cap_names) {
            cap_names = cap_names ? cap_names * 2 : 64;
            names = lethe_xrealloc(names, cap_names * sizeof(char *));
        }
        names[n_names++] = lethe_xstrdup(de->d_name);
    }
    closedir(d);
    if (n_names) qsort(names, n_names, sizeof(char *), cmp_str);

    lethe_eval_corpus *c = lethe_xcalloc(1, sizeof(*c));
    c->docs = lethe_xcalloc(n_names ? n_names : 1, sizeof(char *));
    c->doc_names = lethe_xcalloc(n_names ? n_names : 1, sizeof(char *));
    int32_t cap_sent = 0;
    char **words = NULL;
    size_t n_words = 0, cap_words = 0;
    lethe_status st = LETHE_OK;
    for (size_t i = 0; i < n_names; i++) {
        size_t plen = strlen(dir) + strlen(names[i]) + 2;
        char *path = lethe_xmalloc(plen);
        snprintf(path, plen, "%s/%s", dir, names[i]);
        struct stat sb;
        if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) {
            free(path);
            continue;
        }
        char *text = NULL;
        size_t len = 0;
        st = lethe_read_file(path, &text, &len);
        if (st != LETHE_OK) {
            free(path);
            goto fail;
        }
        if (memchr(text, '\0', len)) {
            st = lethe_errorf(LETHE_ERR_FORMAT, "corpus %s: binary data (NUL byte); not a text file",
                              path);
            free(text);
            free(path);
            goto fail;
        }
        free(path);
        len = normalize_ws(text, len);
        if (len == 0) {
            free(text);
            continue;
        }
        c->docs[c->n_docs] = text;
        c->doc_names[c->n_docs] = lethe_xstrdup(names[i]);
        c->n_docs++;
        add_sentences(c, text, &cap_sent);
        add_words(text, &words, &n_words, &cap_words);
    }
    /* unique words, sorted */
    if (n_words) qsort(words, n_words, sizeof(char *), cmp_str);
    size_t u = 0;
    for (size_t i = 0; i < n_words; i++) {
        if (u > 0 && !strcmp(words[u - 1], words[i])) {
            free(words[i]);
            continue;
        }
        words[u++] = words[i];
    }
    c->words = words;
    c->n_words = (int32_t)u;
    if (c->n_sentences < 50 || c->n_words < 100) {
        st = lethe_errorf(LETHE_ERR_INVALID,
                          "corpus %s: too little text (%d sentences, %d distinct words in %d .txt/.md "
                          "files; need at least 50 and 100)",
                          dir, c->n_sentences, c->n_words, c->n_docs);
        goto fail;
    }
    for (size_t i = 0; i < n_names; i++) free(names[i]);
    free(names);
    *out = c;
    return LETHE_OK;
fail:
    for (size_t i = 0; i < n_names; i++) free(names[i]);
    free(names);
    if (!c->words) {
        for (size_t i = 0; i < n_words; i++) free(words[i]);
        free(words);
    }
    lethe_eval_corpus_free(c);
    return st;
}

void lethe_eval_corpus_free(lethe_eval_corpus *c) {
    if (!c) return;
    for (int32_t i = 0; i < c->n_docs; i++) {
        free(c->docs[i]);
        free(c->doc_names[i]);
    }
    for (int32_t i = 0; i < c->n_sentences; i++) free(c->sentences[i]);
    for (int32_t i = 0; i < c->n_words; i++) free(c->words[i]);
    free(c->docs);
    free(c->doc_names);
    free(c->sentences);
    free(c->words);
    free(c);
}
