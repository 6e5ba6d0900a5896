/* json.c - number-preserving parse and the two printers of json.h. */
#include "core/json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/util.h"

void lethe_sbuf_add(lethe_sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = LETHE_MAX(b->n + n + 1, 2 * b->cap + 64);
        b->s = lethe_xrealloc(b->s, b->cap);
    }
    if (n) memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

void lethe_sbuf_puts(lethe_sbuf *b, const char *s) { lethe_sbuf_add(b, s, strlen(s)); }

/* ---- number texts: a scan of the source in document order, beside the tree ---- */

typedef struct scan {
    const char *p, *end;
} scan;

static void skip_ws(scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) s->p++;
}

static void skip_string(scan *s) {
    s->p++; /* opening quote */
    while (s->p < s->end && *s->p != '"') s->p += (*s->p == '\\') ? 2 : 1;
    s->p++;
}

static void scan_value(scan *s, cJSON *node) {
    skip_ws(s);
    if (s->p >= s->end || !node) return;
    const char c = *s->p;
    if (c == '{' || c == '[') {
        s->p++;
        for (cJSON *ch = node->child; ch; ch = ch->next) {
            skip_ws(s);
            if (c == '{') {
                skip_string(s);
                skip_ws(s);
                s->p++; /* ':' */
            }
            scan_value(s, ch);
            skip_ws(s);
            if (s->p < s->end && *s->p == ',') s->p++;
        }
        skip_ws(s);
        s->p++; /* closing bracket */
    } else if (c == '"') {
        skip_string(s);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
        const char *b = s->p;
        while (s->p < s->end && (strchr("+-.eE", *s->p) || (*s->p >= '0' && *s->p <= '9'))) s->p++;
        if (cJSON_IsNumber(node) && !node->valuestring) {
            node->valuestring = lethe_xmalloc((size_t)(s->p - b) + 1);
            memcpy(node->valuestring, b, (size_t)(s->p - b));
            node->valuestring[s->p - b] = '\0';
        }
    } else { /* true false null */
        while (s->p < s->end && *s->p >= 'a' && *s->p <= 'z') s->p++;
    }
}

void lethe_json_keep_numbers(cJSON *root, const char *text, size_t n) {
    scan s = {text, text + n};
    if (n >= 3 && !memcmp(text, "\xef\xbb\xbf", 3)) s.p += 3; /* cJSON skips a UTF-8 BOM */
    scan_value(&s, root);
}

cJSON *lethe_json_parse(const char *s, size_t n) {
    cJSON *root = cJSON_ParseWithLength(s, n);
    if (root) lethe_json_keep_numbers(root, s, n);
    return root;
}

/* ---- printers ---- */

/* repr(float) of Python (shortest round-trip digits; exponent form when the
 * decimal point is more than 16 digits right or 4 left of the first digit) */
static void py_float(lethe_sbuf *b, double d) {
    if (isnan(d)) return lethe_sbuf_puts(b, "NaN");
    if (isinf(d)) return lethe_sbuf_puts(b, d < 0 ? "-Infinity" : "Infinity");
    char e[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof(e), "%.*e", prec - 1, d);
        if (strtod(e, NULL) == d) break;
    }
    const char *p = e;
    if (*p == '-') lethe_sbuf_puts(b, "-"), p++;
    char digits[24];
    int nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9') digits[nd++] = *p;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    const int decpt = atoi(p + 1) + 1; /* value = 0.d1d2.. * 10^decpt */
    char out[64];
    int k = 0;
    if (d == 0) {
        lethe_sbuf_puts(b, "0.0");
        return;
    }
    if (decpt <= -4 || decpt > 16) {
        out[k++] = digits[0];
        if (nd > 1) {
            out[k++] = '.';
            for (int i = 1; i < nd; i++) out[k++] = digits[i];
        }
        k += snprintf(out + k, sizeof(out) - (size_t)k, "e%c%02d", decpt - 1 < 0 ? '-' : '+',
                      abs(decpt - 1));
    } else if (decpt <= 0) {
        out[k++] = '0';
        out[k++] = '.';
        for (int i = 0; i < -decpt; i++) out[k++] = '0';
        for (int i = 0; i < nd; i++) out[k++] = digits[i];
    } else {
        for (int i = 0; i < LETHE_MAX(nd, decpt); i++) {
            if (i == decpt) out[k++] = '.';
            out[k++] = i < nd ? digits[i] : '0';
        }
        if (decpt >= nd) out[k++] = '.', out[k++] = '0';
    }
    lethe_sbuf_add(b, out, (size_t)k);
}

static void put_number(lethe_sbuf *b, const cJSON *v, bool py) {
    const char *raw = v->valuestring;
    if (raw && !strpbrk(raw, ".eE")) { /* an int: its digits ("-0" is the int 0) */
        lethe_sbuf_puts(b, strcmp(raw, "-0") ? raw : "0");
        return;
    }
    if (raw && !py) {
        lethe_sbuf_puts(b, raw);
        return;
    }
    const double d = v->valuedouble;
    if (!raw && d == floor(d) && fabs(d) < 1e16) { /* built in code: integral means int */
        char t[32];
        snprintf(t, sizeof(t), "%.0f", d == 0 ? 0.0 : d);
        lethe_sbuf_puts(b, t);
        return;
    }
    if (!py && !isfinite(d)) return lethe_sbuf_puts(b, "null");
    py_float(b, d);
}

static void put_string(lethe_sbuf *b, const char *s) {
    lethe_sbuf_puts(b, "\"");
    const char *run = s;
    for (const unsigned char *p = (const unsigned char *)s;; p++) {
        const unsigned char c = *p;
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        lethe_sbuf_add(b, run, (size_t)((const char *)p - run));
        if (!c) break;
        char esc[8];
        switch (c) {
        case '"': lethe_sbuf_puts(b, "\\\""); break;
        case '\\': lethe_sbuf_puts(b, "\\\\"); break;
        case '\n': lethe_sbuf_puts(b, "\\n"); break;
        case '\r': lethe_sbuf_puts(b, "\\r"); break;
        case '\t': lethe_sbuf_puts(b, "\\t"); break;
        case '\b': lethe_sbuf_puts(b, "\\b"); break;
        case '\f': lethe_sbuf_puts(b, "\\f"); break;
        default:
            snprintf(esc, sizeof(esc), "\\u%04x", c);
            lethe_sbuf_puts(b, esc);
        }
        run = (const char *)p + 1;
    }
    lethe_sbuf_puts(b, "\"");
}

static void newline(lethe_sbuf *b, int indent, int depth) {
    lethe_sbuf_puts(b, "\n");
    for (int i = 0; i < indent * depth; i++) lethe_sbuf_puts(b, " ");
}

/* the member a Python dict keeps for ch's key: the last one of that name,
 * or NULL when an earlier member has the same key (already printed) */
static const cJSON *dict_member(const cJSON *obj, const cJSON *ch) {
    for (const cJSON *o = obj->child; o != ch; o = o->next)
        if (!strcmp(o->string, ch->string)) return NULL;
    const cJSON *last = ch;
    for (const cJSON *o = ch->next; o; o = o->next)
        if (!strcmp(o->string, ch->string)) last = o;
    return last;
}

static void dump(lethe_sbuf *b, const cJSON *v, bool py, int indent, int depth) {
    switch (v->type & 0xff) {
    case cJSON_NULL: lethe_sbuf_puts(b, "null"); return;
    case cJSON_True: lethe_sbuf_puts(b, "true"); return;
    case cJSON_False: lethe_sbuf_puts(b, "false"); return;
    case cJSON_Number: put_number(b, v, py); return;
    case cJSON_String: put_string(b, v->valuestring ? v->valuestring : ""); return;
    case cJSON_Raw: lethe_sbuf_puts(b, v->valuestring ? v->valuestring : "null"); return;
    default: break;
    }
    const bool obj = cJSON_IsObject(v);
    if (!v->child) return lethe_sbuf_puts(b, obj ? "{}" : "[]");
    lethe_sbuf_puts(b, obj ? "{" : "[");
    bool first = true;
    for (const cJSON *ch = v->child; ch; ch = ch->next) {
        const cJSON *val = ch;
        if (obj && py && !(val = dict_member(v, ch))) continue;
        if (!first) lethe_sbuf_puts(b, py && indent < 0 ? ", " : ",");
        first = false;
        if (py && indent >= 0) newline(b, indent, depth + 1);
        if (obj) {
            put_string(b, ch->string ? ch->string : "");
            lethe_sbuf_puts(b, py ? ": " : ":");
        }
        dump(b, val, py, indent, depth + 1);
    }
    if (py && indent >= 0) newline(b, indent, depth);
    lethe_sbuf_puts(b, obj ? "}" : "]");
}

char *lethe_json_print(const cJSON *v) {
    lethe_sbuf b = {0};
    lethe_sbuf_add(&b, "", 0);
    dump(&b, v, false, -1, 0);
    return b.s;
}

void lethe_json_dump_py(lethe_sbuf *b, const cJSON *v, int indent) { dump(b, v, true, indent, 0); }

char *lethe_json_dumps_py(const cJSON *v, int indent) {
    lethe_sbuf b = {0};
    lethe_sbuf_add(&b, "", 0);
    dump(&b, v, true, indent, 0);
    return b.s;
}
