/* vocab_gguf.c - loading a byte-level BPE tokenizer from GGUF metadata.
 *
 * Keys (llama.cpp conventions):
 *   tokenizer.ggml.model          must be "gpt2" (byte-level BPE)
 *   tokenizer.ggml.pre            pre-tokenizer name (pretokenize.c); absent -> gpt2
 *   tokenizer.ggml.tokens         [n_vocab] pieces in byte-level form
 *   tokenizer.ggml.token_type     [n_vocab] 1 normal, 2 unknown, 3 control,
 *                                 4 user-defined, 5 unused, 6 byte
 *   tokenizer.ggml.merges         ["a b", ...] in rank order
 *   tokenizer.ggml.{bos,eos,eot,eom}_token_id, tokenizer.ggml.add_bos_token
 *   tokenizer.chat_template
 * Control tokens are special added tokens (matched with parse_special),
 * user-defined ones are added tokens matched always, as HF does for
 * non-special added tokens. Everything is copied: the GGUF may be closed
 * after loading. */
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "core/util.h"
#include "model/gguf.h"
#include "tokenizer/tok_internal.h"

static int64_t arr_int(const lethe_gguf_kv *kv, uint64_t i) {
    const char *p = kv->arr_data;
    switch (kv->arr_type) {
    case LETHE_GGUF_INT8: { int8_t v; memcpy(&v, p + i, 1); return v; }
    case LETHE_GGUF_UINT8: { uint8_t v; memcpy(&v, p + i, 1); return v; }
    case LETHE_GGUF_INT16: { int16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case LETHE_GGUF_UINT16: { uint16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case LETHE_GGUF_INT32: { int32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case LETHE_GGUF_UINT32: { uint32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case LETHE_GGUF_INT64: case LETHE_GGUF_UINT64: { int64_t v; memcpy(&v, p + 8 * i, 8); return v; }
    default: return 1;
    }
}

static int32_t get_id(const lethe_gguf *g, const char *key, int32_t n_vocab) {
    int64_t v;
    if (lethe_gguf_get_int(g, key, &v) != LETHE_OK || v < 0 || v >= n_vocab) return -1;
    return (int32_t)v;
}

lethe_status lethe_tokenizer_from_gguf(const lethe_gguf *g, lethe_tokenizer **out) {
    *out = NULL;
    const char *path = g->path ? g->path : "gguf";
    lethe_gguf_str model;
    if (lethe_gguf_get_str(g, "tokenizer.ggml.model", &model) != LETHE_OK)
        return lethe_errorf(LETHE_ERR_NOT_FOUND, "%s: no tokenizer.ggml.model", path);
    if (model.len != 4 || memcmp(model.data, "gpt2", 4) != 0)
        return lethe_errorf(LETHE_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model \"%.*s\" is not supported (only gpt2, "
                            "byte-level BPE)", path, (int)LETHE_MIN(model.len, 64), model.data);
    const lethe_gguf_kv *toks = lethe_gguf_find(g, "tokenizer.ggml.tokens");
    if (!toks || toks->type != LETHE_GGUF_ARRAY || toks->arr_type != LETHE_GGUF_STRING)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tokenizer.ggml.tokens is not an array of strings", path);
    const lethe_gguf_kv *types = lethe_gguf_find(g, "tokenizer.ggml.token_type");
    if (types && (types->type != LETHE_GGUF_ARRAY || types->arr_n != toks->arr_n ||
                  types->arr_type == LETHE_GGUF_STRING || types->arr_type == LETHE_GGUF_ARRAY ||
                  types->arr_type == LETHE_GGUF_FLOAT32 || types->arr_type == LETHE_GGUF_FLOAT64 ||
                  types->arr_type == LETHE_GGUF_BOOL))
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tokenizer.ggml.token_type is not an integer array of %llu",
                            path, (unsigned long long)toks->arr_n);
    const lethe_gguf_kv *merges = lethe_gguf_find(g, "tokenizer.ggml.merges");
    if (!merges || merges->type != LETHE_GGUF_ARRAY || merges->arr_type != LETHE_GGUF_STRING)
        return lethe_errorf(LETHE_ERR_FORMAT, "%s: tokenizer.ggml.merges is missing or not an array of strings", path);
    if (toks->arr_n > (1u << 24)) return lethe_errorf(LETHE_ERR_FORMAT, "%s: %llu tokens", path, (unsigned long long)toks->arr_n);

    lethe_tokenizer *t;
    lethe_status st = tok_create((int32_t)toks->arr_n, &t);
    if (st != LETHE_OK) return st;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        lethe_gguf_str s = lethe_gguf_arr_str(g, toks, (uint64_t)id);
        int64_t type = types ? arr_int(types, (uint64_t)id) : 1;
        uint8_t attr = 0;
        switch (type) {
        case 1: case 6: attr = TOK_ATTR_BPE; break;               /* normal, byte */
        case 3: attr = TOK_ATTR_ADDED | TOK_ATTR_SPECIAL; break;  /* control */
        case 4: attr = TOK_ATTR_ADDED; break;                     /* user defined */
        case 2: attr = TOK_ATTR_SPECIAL; break;                   /* unknown */
        default: attr = 0; break;                                 /* unused */
        }
        tok_set_token(t, id, s.data, (size_t)s.len, attr);
    }
    if ((st = tok_build_maps(t)) != LETHE_OK) goto fail;
    if ((st = tok_reserve_merges(t, (size_t)merges->arr_n)) != LETHE_OK) goto fail;
    int32_t skipped = 0;
    for (uint64_t i = 0; i < merges->arr_n; i++) {
        lethe_gguf_str m = lethe_gguf_arr_str(g, merges, i);
        const char *sp = memchr(m.data, ' ', (size_t)m.len);
        if (!sp) {
            st = lethe_errorf(LETHE_ERR_FORMAT, "%s: tokenizer.ggml.merges[%llu] has no space", path, (unsigned long long)i);
            goto fail;
        }
        size_t alen = (size_t)(sp - m.data);
        tok_add_merge(t, m.data, alen, sp + 1, (size_t)m.len - alen - 1, (int32_t)i, &skipped);
    }
    if (skipped) LOG_WARN("%s: %d merges name pieces missing from the vocabulary; ignored", path, skipped);

    lethe_gguf_str pre;
    char pre_name[64] = "gpt2";
    if (lethe_gguf_get_str(g, "tokenizer.ggml.pre", &pre) == LETHE_OK)
        snprintf(pre_name, sizeof(pre_name), "%.*s", (int)LETHE_MIN(pre.len, 63), pre.data);
    else
        LOG_WARN("%s: no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer", path);
    if ((st = tok_set_pre_by_name(t, pre_name)) != LETHE_OK) {
        char msg[512];
        snprintf(msg, sizeof(msg), "%s", lethe_last_error());
        st = lethe_errorf(st, "%s: %s", path, msg);
        goto fail;
    }

    t->bos = get_id(g, "tokenizer.ggml.bos_token_id", t->n_vocab);
    t->eos = get_id(g, "tokenizer.ggml.eos_token_id", t->n_vocab);
    tok_add_eog(t, get_id(g, "tokenizer.ggml.eot_token_id", t->n_vocab));
    tok_add_eog(t, get_id(g, "tokenizer.ggml.eom_token_id", t->n_vocab));
    const lethe_gguf_kv *ab = lethe_gguf_find(g, "tokenizer.ggml.add_bos_token");
    /* absent: Llama-3 adds BOS, the other byte-level families do not */
    t->add_bos = (ab && ab->type == LETHE_GGUF_BOOL) ? ab->v.u64 != 0 : (strcmp(pre_name, "llama-bpe") == 0);
    lethe_gguf_str tmpl;
    if (lethe_gguf_get_str(g, "tokenizer.chat_template", &tmpl) == LETHE_OK) {
        t->chat_template = lethe_xmalloc((size_t)tmpl.len + 1);
        memcpy(t->chat_template, tmpl.data, (size_t)tmpl.len);
        t->chat_template[tmpl.len] = '\0';
    }
    if ((st = tok_finalize(t)) != LETHE_OK) goto fail;
    *out = t;
    return LETHE_OK;
fail:
    lethe_tokenizer_free(t);
    return st;
}
