/* vocab_hf.c - loading an HF tokenizer.json (+ tokenizer_config.json).
 *
 * Supported (byte-level BPE as used by GPT-2, SmolLM2, Llama-3, Qwen2/3):
 *   model:          BPE: vocab {piece: id}, merges as "a b" strings or
 *                   [a, b] pairs, ignore_merges, unk_token
 *   added_tokens:   id, content, special, lstrip, rstrip
 *   normalizer:     null, NFC (or a Sequence of NFC)
 *   pre_tokenizer:  Sequence of Split(Regex|String, Isolated), Digits,
 *                   ByteLevel(use_regex, add_prefix_space as first step)
 *   post_processor: TemplateProcessing whose "single" starts with a special
 *                   token -> that token is BOS and is added (Llama-3);
 *                   ByteLevel / Sequence are walked
 * tokenizer_config.json: bos_token, eos_token (string or {content}),
 * add_bos_token, chat_template (string, or a list -> the "default" one).
 * Anything else (WordPiece, Metaspace, byte_fallback, ...) is rejected with
 * LETHE_ERR_UNSUPPORTED naming the field. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "tokenizer/tok_internal.h"

static const char *jstr(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool jbool(const cJSON *o, const char *key, bool dflt) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : dflt;
}

/* bos_token / eos_token: "..." or {"content": "..."} */
static const char *token_name(const cJSON *cfg, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) return jstr(v, "content");
    return NULL;
}

static lethe_status parse_json(const char *path, cJSON **out) {
    char *buf;
    size_t n;
    lethe_status st = lethe_read_file(path, &buf, &n);
    if (st != LETHE_OK) return st;
    *out = cJSON_ParseWithLength(buf, n);
    free(buf);
    if (!*out) return lethe_errorf(LETHE_ERR_FORMAT, "%s: not valid JSON", path);
    return LETHE_OK;
}

static lethe_status add_pre(lethe_tokenizer *t, const cJSON *p, bool first, bool *byte_level, const char *path) {
    const char *type = jstr(p, "type");
    if (!type) return lethe_errorf(LETHE_ERR_FORMAT, "%s: pre_tokenizer without \"type\"", path);
    if (!strcmp(type, "Sequence")) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
        const cJSON *e;
        int i = 0;
        cJSON_ArrayForEach(e, arr) {
            lethe_status st = add_pre(t, e, first && i == 0, byte_level, path);
            if (st != LETHE_OK) return st;
            i++;
        }
        return LETHE_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        *byte_level = true;
        if (jbool(p, "add_prefix_space", false)) {
            if (!first)
                return lethe_errorf(LETHE_ERR_UNSUPPORTED,
                                    "%s: ByteLevel add_prefix_space is supported only as the first pre-tokenizer", path);
            t->prefix_space = true;
        }
        return jbool(p, "use_regex", true) ? tok_add_pre_regex(t, TOK_RE_GPT2) : LETHE_OK;
    }
    if (!strcmp(type, "Digits")) return tok_add_pre_regex(t, jbool(p, "individual_digits", false) ? "\\p{N}" : "\\p{N}+");
    if (!strcmp(type, "Split")) {
        const char *beh = jstr(p, "behavior");
        if (!beh || strcmp(beh, "Isolated") != 0 || jbool(p, "invert", false))
            return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: Split pre-tokenizer with behavior \"%s\"%s is not supported",
                                path, beh ? beh : "?", jbool(p, "invert", false) ? " (inverted)" : "");
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const char *re = jstr(pat, "Regex");
        if (re) return tok_add_pre_regex(t, re);
        const char *lit = jstr(pat, "String");
        if (!lit) return lethe_errorf(LETHE_ERR_FORMAT, "%s: Split pre-tokenizer without a pattern", path);
        /* a literal: quote every non-alphanumeric character */
        size_t n = strlen(lit);
        char *q = lethe_xmalloc(2 * n + 1), *o = q;
        for (size_t i = 0; i < n; i++) {
            unsigned char ch = (unsigned char)lit[i];
            if (ch < 0x80 && !((ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z'))) *o++ = '\\';
            *o++ = (char)ch;
        }
        *o = '\0';
        lethe_status st = tok_add_pre_regex(t, q);
        free(q);
        return st;
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: pre-tokenizer type \"%s\" is not supported", path, type);
}

static lethe_status add_normalizer(lethe_tokenizer *t, const cJSON *n, const char *path) {
    if (!n || cJSON_IsNull(n)) return LETHE_OK;
    const char *type = jstr(n, "type");
    if (type && !strcmp(type, "NFC")) {
        t->norm = TOK_NORM_NFC;
        return LETHE_OK;
    }
    if (type && !strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(n, "normalizers")) {
            lethe_status st = add_normalizer(t, e, path);
            if (st != LETHE_OK) return st;
        }
        return LETHE_OK;
    }
    return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (only NFC)", path,
                        type ? type : "?");
}

/* TemplateProcessing: "single": [{"SpecialToken": {"id": "<|begin_of_text|>"}}, {"Sequence": ...}] */
static void read_post(lethe_tokenizer *t, const cJSON *p) {
    const char *type = jstr(p, "type");
    if (!type) return;
    if (!strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(p, "processors")) read_post(t, e);
        return;
    }
    if (strcmp(type, "TemplateProcessing") != 0) return;
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(p, "single");
    const cJSON *first = cJSON_GetArrayItem(single, 0);
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(first, "SpecialToken");
    const char *name = jstr(sp, "id");
    if (!name) return;
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(p, "special_tokens"), name);
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(st, "ids");
    int32_t id = cJSON_IsNumber(cJSON_GetArrayItem(ids, 0)) ? (int32_t)cJSON_GetArrayItem(ids, 0)->valuedouble
                                                             : lethe_tokenizer_find_token(t, name);
    if (id >= 0 && id < t->n_vocab) {
        t->bos = id;
        t->add_bos = true;
    }
}

static lethe_status load_merges(lethe_tokenizer *t, const cJSON *merges, const char *path) {
    int n = cJSON_GetArraySize(merges);
    lethe_status st = tok_reserve_merges(t, (size_t)n);
    if (st != LETHE_OK) return st;
    int32_t rank = 0, skipped = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, merges) {
        if (cJSON_IsString(m)) {
            const char *s = m->valuestring, *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' '))
                return lethe_errorf(LETHE_ERR_FORMAT, "%s: merge %d \"%s\" is not two pieces", path, rank, s);
            tok_add_merge(t, s, (size_t)(sp - s), sp + 1, strlen(sp + 1), rank, &skipped);
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(cJSON_GetArrayItem(m, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(m, 1))) {
            const char *a = cJSON_GetArrayItem(m, 0)->valuestring, *b = cJSON_GetArrayItem(m, 1)->valuestring;
            tok_add_merge(t, a, strlen(a), b, strlen(b), rank, &skipped);
        } else {
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: model.merges[%d] is neither \"a b\" nor [a, b]", path, rank);
        }
        rank++;
    }
    if (skipped) LOG_WARN("%s: %d merges name pieces missing from the vocabulary; ignored", path, skipped);
    return LETHE_OK;
}

static lethe_status from_json(const cJSON *j, const cJSON *cfg, const char *path, lethe_tokenizer **out) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(j, "model");
    const char *mtype = jstr(model, "type");
    if (!cJSON_IsObject(model) || (mtype && strcmp(mtype, "BPE") != 0))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: tokenizer model \"%s\" is not supported (only BPE)", path,
                            mtype ? mtype : "?");
    if (jbool(model, "byte_fallback", false))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: BPE byte_fallback (SentencePiece-style) is not supported", path);
    const char *cont = jstr(model, "continuing_subword_prefix"), *eow = jstr(model, "end_of_word_suffix");
    if ((cont && *cont) || (eow && *eow))
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: BPE subword prefixes/suffixes are not supported", path);
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(j, "added_tokens");
    if (!cJSON_IsObject(vocab)) return lethe_errorf(LETHE_ERR_FORMAT, "%s: model.vocab missing", path);

    double max_id = -1;
    int32_t n_ids = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 24))
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: model.vocab[\"%s\"] is not a valid id", path, e->string);
        if (e->valuedouble > max_id) max_id = e->valuedouble;
        n_ids++;
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= (1 << 24) || !jstr(e, "content"))
            return lethe_errorf(LETHE_ERR_FORMAT, "%s: added_tokens entry without a valid id/content", path);
        if (id->valuedouble > max_id) max_id = id->valuedouble;
        n_ids++;
    }
    /* the token tables are indexed by id: a few tokens with a huge id would allocate and
     * walk tables of that size (a 1 KB file, hundreds of MB and seconds); real
     * vocabularies are dense (ids 0 .. n-1, a few holes at most) */
    if (max_id + 1 > 2.0 * n_ids + 1024)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: token ids up to %.0f for %d tokens: the vocabulary is not dense",
                            path, max_id, n_ids);
    lethe_tokenizer *t;
    lethe_status st = tok_create((int32_t)max_id + 1, &t);
    if (st != LETHE_OK) return st;
    snprintf(t->pre_name, sizeof(t->pre_name), "hf");
    cJSON_ArrayForEach(e, vocab) tok_set_token(t, (int32_t)e->valuedouble, e->string, strlen(e->string), TOK_ATTR_BPE);
    cJSON_ArrayForEach(e, added) {
        int32_t id = (int32_t)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
        const char *content = jstr(e, "content");
        uint8_t attr = TOK_ATTR_ADDED;
        if (jbool(e, "special", false)) attr |= TOK_ATTR_SPECIAL;
        if (jbool(e, "lstrip", false)) attr |= TOK_ATTR_LSTRIP;
        if (jbool(e, "rstrip", false)) attr |= TOK_ATTR_RSTRIP;
        /* keep it in the BPE vocabulary if the model has the same piece at this id */
        if ((t->attr[id] & TOK_ATTR_BPE) && t->piece_len[id] == strlen(content) &&
            memcmp(t->arena + t->piece_off[id], content, strlen(content)) == 0)
            attr |= TOK_ATTR_BPE;
        tok_set_token(t, id, content, strlen(content), attr);
    }
    if ((st = tok_build_maps(t)) != LETHE_OK) goto fail;
    if ((st = load_merges(t, cJSON_GetObjectItemCaseSensitive(model, "merges"), path)) != LETHE_OK) goto fail;
    t->ignore_merges = jbool(model, "ignore_merges", false);
    const char *unk = jstr(model, "unk_token");
    if (unk) t->unk_id = lethe_tokenizer_find_token(t, unk);

    if ((st = add_normalizer(t, cJSON_GetObjectItemCaseSensitive(j, "normalizer"), path)) != LETHE_OK) goto fail;
    bool byte_level = false;
    const cJSON *pre = cJSON_GetObjectItemCaseSensitive(j, "pre_tokenizer");
    if (pre && !cJSON_IsNull(pre) && (st = add_pre(t, pre, true, &byte_level, path)) != LETHE_OK) goto fail;
    if (!byte_level) {
        st = lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: not a byte-level BPE tokenizer (no ByteLevel pre-tokenizer)", path);
        goto fail;
    }
    read_post(t, cJSON_GetObjectItemCaseSensitive(j, "post_processor"));

    if (cfg) {
        const char *bos = token_name(cfg, "bos_token"), *eos = token_name(cfg, "eos_token");
        if (bos) t->bos = lethe_tokenizer_find_token(t, bos);
        if (eos) t->eos = lethe_tokenizer_find_token(t, eos);
        const cJSON *ab = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
        if (cJSON_IsBool(ab)) t->add_bos = cJSON_IsTrue(ab);
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        if (cJSON_IsString(ct)) t->chat_template = lethe_xstrdup(ct->valuestring);
        else if (cJSON_IsArray(ct)) {
            cJSON_ArrayForEach(e, ct) {
                const char *name = jstr(e, "name"), *tmpl = jstr(e, "template");
                if (name && tmpl && !strcmp(name, "default")) t->chat_template = lethe_xstrdup(tmpl);
            }
        }
    }
    if (t->eos < 0) { /* no config: the conventional end-of-text names */
        static const char *const names[] = {"<|endoftext|>", "<|end_of_text|>", "</s>"};
        for (size_t i = 0; i < LETHE_ARRAY_LEN(names) && t->eos < 0; i++) t->eos = lethe_tokenizer_find_token(t, names[i]);
    }
    if ((st = tok_finalize(t)) != LETHE_OK) goto fail;
    *out = t;
    return LETHE_OK;
fail:
    lethe_tokenizer_free(t);
    return st;
}

lethe_status lethe_tokenizer_from_hf(const char *tokenizer_json_path, const char *tokenizer_config_path,
                                     lethe_tokenizer **out) {
    *out = NULL;
    cJSON *j = NULL, *cfg = NULL;
    lethe_status st = parse_json(tokenizer_json_path, &j);
    if (st == LETHE_OK && tokenizer_config_path) st = parse_json(tokenizer_config_path, &cfg);
    if (st == LETHE_OK) st = from_json(j, cfg, tokenizer_json_path, out);
    cJSON_Delete(j);
    cJSON_Delete(cfg);
    return st;
}
