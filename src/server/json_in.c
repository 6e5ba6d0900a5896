/* json_in.c - strict parsing of request bodies, and client text in error
 * messages.
 *
 * cJSON alone is lenient where a server must not be: it accepts bytes after
 * the JSON value ({"a":1} garbage), passes invalid UTF-8 through into
 * strings (and so into error bodies, which then are not valid JSON), and
 * keeps strings NUL-terminated, so "ab\u0000cd" silently becomes "ab" (a
 * role, a model name, a chain id or a prompt cut short). srv_json_parse
 * checks the raw body first - valid UTF-8, no NUL byte, no \u0000 escape in
 * any string (no field of the API can carry NUL through lethe's C strings,
 * so it is refused, naming the field) - then parses it and refuses any
 * non-whitespace after the value. Every refusal is a 400 with the byte
 * offset. srv_clip bounds client text quoted back in a message. */
#include <stdio.h>
#include <string.h>

#include "core/json.h"
#include "server/openai.h"

static bool json_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* The \u0000 escape check: walks the strings of a body already known to be
 * UTF-8 without NUL bytes. Returns the offset of the first \u0000 (or len) and
 * names the field it belongs to: the string itself when it is an object key,
 * else the last key seen before it. */
static size_t find_nul_escape(const char *b, size_t len, char *key, size_t key_cap, bool *is_key) {
    char last[64] = "";
    size_t i = 0;
    while (i < len) {
        if (b[i] != '"') {
            i++;
            continue;
        }
        size_t start = ++i, nul = len;
        while (i < len && b[i] != '"') {
            if (b[i] == '\\' && i + 1 < len) {
                if (b[i + 1] == 'u' && i + 5 < len && !memcmp(b + i + 2, "0000", 4) && nul == len) nul = i;
                i += 2;
            } else {
                i++;
            }
        }
        size_t end = i < len ? i : len; /* closing quote */
        i = end + 1;
        size_t j = i;
        while (j < len && json_ws(b[j])) j++;
        bool key_here = j < len && b[j] == ':';
        if (nul < len) {
            *is_key = key_here;
            snprintf(key, key_cap, "%s", key_here ? "" : last);
            return nul;
        }
        if (key_here) {
            size_t n = end - start < sizeof(last) - 1 ? end - start : sizeof(last) - 1;
            memcpy(last, b + start, n);
            last[n] = '\0';
        }
    }
    return len;
}

int srv_json_parse(const char *body, size_t len, cJSON **out, srv_error *err) {
    *out = NULL;
    for (size_t i = 0; i < len;) {
        if (body[i] == '\0')
            return srv_errorf(err, 400, NULL, "request body contains a NUL byte (byte offset %zu)", i);
        size_t k = srv_utf8_seq((const unsigned char *)body + i, len - i);
        if (k == 0) return srv_errorf(err, 400, NULL, "request body is not valid UTF-8 (byte offset %zu)", i);
        i += k;
    }
    char key[64];
    bool is_key = false;
    size_t nul = find_nul_escape(body, len, key, sizeof(key), &is_key);
    if (nul < len) {
        if (is_key)
            return srv_errorf(err, 400, NULL, "a field name contains a NUL character (\\u0000, byte offset %zu)",
                              nul);
        char clip[80];
        return srv_errorf(err, 400, key[0] ? key : NULL,
                          "%s%s%s contains a NUL character (\\u0000, byte offset %zu), which lethe does not "
                          "accept in any field",
                          key[0] ? "'" : "a string", key[0] ? srv_clip(key, clip, sizeof(clip)) : "",
                          key[0] ? "'" : "", nul);
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, false);
    if (!root) {
        size_t at = end && end >= body && end <= body + len ? (size_t)(end - body) : 0;
        return srv_errorf(err, 400, NULL, "request body is not valid JSON (near byte offset %zu)", at);
    }
    size_t at = (size_t)(end - body);
    while (at < len && json_ws(body[at])) at++;
    if (at < len) {
        cJSON_Delete(root);
        return srv_errorf(err, 400, NULL, "unexpected data after the JSON value (byte offset %zu)", at);
    }
    lethe_json_keep_numbers(root, body, len); /* chat templates print numbers as written */
    *out = root;
    return 0;
}

const char *srv_clip(const char *s, char *buf, size_t cap) {
    if (!s) s = "";
    size_t n = strlen(s);
    if (n < cap) {
        memcpy(buf, s, n + 1);
        return buf;
    }
    /* cut at a UTF-8 boundary and mark the cut */
    size_t k = cap > 4 ? cap - 4 : 0;
    while (k > 0 && ((unsigned char)s[k] & 0xc0) == 0x80) k--;
    memcpy(buf, s, k);
    memcpy(buf + k, "...", 4);
    return buf;
}
