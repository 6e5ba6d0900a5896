/* chat_template.c - the built-in chat formats, rendered exactly as the
 * models' own Jinja templates render them through HF apply_chat_template
 * (golden outputs in tests/data/tokenizer/chat_golden.txt).
 *
 *   ChatML   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n]
 *   SmolLM2  ChatML; when messages[0] is not a system message, the template
 *            first emits "<|im_start|>system\nYou are a helpful AI assistant
 *            named SmolLM, trained by Hugging Face<|im_end|>\n"
 *   Qwen3    ChatML with Qwen3's rules: a system message counts only first;
 *            assistant content has "...</think>" reasoning split off; after
 *            the last real user query an assistant turn that is last or has
 *            reasoning gets "<think>\n{reasoning}\n</think>\n\n"; tool messages
 *            are "<tool_response>" blocks grouped in one user turn; other
 *            roles are dropped (as the template does)
 *   Llama-3  [<|begin_of_text|>]<|start_header_id|>{role}<|end_header_id|>\n\n
 *            {content stripped of whitespace (Jinja trim)}<|eot_id|> ...
 *            [<|start_header_id|>assistant<|end_header_id|>\n\n]
 *            (the Llama-3.0 Instruct format: no default system prompt)
 * Detection reads the template text stored in the model, else the special
 * tokens present. */
#include "tokenizer/chat_template.h"

#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "tokenizer/tokenizer.h"

lethe_chat_format lethe_chat_format_detect(const lethe_tokenizer *t) {
    const char *tmpl = t ? lethe_tokenizer_chat_template(t) : NULL;
    if (tmpl) {
        if (strstr(tmpl, "<|start_header_id|>")) return LETHE_CHAT_LLAMA3;
        if (strstr(tmpl, "<|im_start|>")) {
            if (strstr(tmpl, "You are a helpful AI assistant named SmolLM")) return LETHE_CHAT_SMOLLM2;
            if (strstr(tmpl, "</think>") || strstr(tmpl, "reasoning_content")) return LETHE_CHAT_QWEN3;
            return LETHE_CHAT_CHATML;
        }
    }
    if (t && lethe_tokenizer_find_token(t, "<|start_header_id|>") >= 0) return LETHE_CHAT_LLAMA3;
    return LETHE_CHAT_CHATML;
}

const char *lethe_chat_format_name(lethe_chat_format f) {
    switch (f) {
    case LETHE_CHAT_CHATML: return "chatml";
    case LETHE_CHAT_LLAMA3: return "llama3";
    case LETHE_CHAT_SMOLLM2: return "smollm2";
    case LETHE_CHAT_QWEN3: return "qwen3";
    }
    return "unknown";
}

typedef struct sbuf {
    char *s;
    size_t n, cap;
} sbuf;

static void put(sbuf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->s = lethe_xrealloc(b->s, b->cap);
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}
static void puts_(sbuf *b, const char *s) { put(b, s, strlen(s)); }

/* Python str.isspace() for the code point starting at s (its byte length in *len), 0 if not */
static int py_space_at(const unsigned char *s, size_t n) {
    if (n >= 1 && ((s[0] >= 0x09 && s[0] <= 0x0D) || (s[0] >= 0x1C && s[0] <= 0x20))) return 1;
    if (n >= 2 && s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0)) return 2;
    if (n >= 3 && s[0] == 0xE1 && s[1] == 0x9A && s[2] == 0x80) return 3; /* U+1680 */
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x80 &&
        (s[2] <= 0x8A || s[2] == 0xA8 || s[2] == 0xA9 || s[2] == 0xAF)) return 3; /* U+2000-200A, 2028, 2029, 202F */
    if (n >= 3 && s[0] == 0xE2 && s[1] == 0x81 && s[2] == 0x9F) return 3; /* U+205F */
    if (n >= 3 && s[0] == 0xE3 && s[1] == 0x80 && s[2] == 0x80) return 3; /* U+3000 */
    return 0;
}

/* Jinja's trim (Python str.strip()): [*b, *e) shrinks to the stripped range */
static void py_strip(const char **b, const char **e) {
    int k;
    while (*b < *e && (k = py_space_at((const unsigned char *)*b, (size_t)(*e - *b))) > 0) *b += k;
    for (;;) {
        const char *p = *e;
        bool found = false;
        for (int back = 1; back <= 3 && p - back >= *b; back++) {
            k = py_space_at((const unsigned char *)(p - back), (size_t)back);
            if (k == back) {
                *e -= back;
                found = true;
                break;
            }
        }
        if (!found) return;
    }
}

static void strip_nl(const char **b, const char **e, bool left, bool right) {
    while (left && *b < *e && **b == '\n') (*b)++;
    while (right && *e > *b && (*e)[-1] == '\n') (*e)--;
}

/* last occurrence of needle in [b, e), or NULL */
static const char *find_last(const char *b, const char *e, const char *needle) {
    size_t n = strlen(needle);
    for (const char *p = e - n; p >= b && e - b >= (ptrdiff_t)n; p--)
        if (memcmp(p, needle, n) == 0) return p;
    return NULL;
}

static bool has_prefix(const char *s, const char *p) { return strncmp(s, p, strlen(p)) == 0; }
static bool has_suffix(const char *s, const char *x) {
    size_t n = strlen(s), m = strlen(x);
    return n >= m && memcmp(s + n - m, x, m) == 0;
}

static void render_chatml(sbuf *b, const lethe_chat_msg *m, size_t n, bool smollm) {
    if (smollm && n > 0 && strcmp(m[0].role, "system") != 0)
        puts_(b, "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n");
    for (size_t i = 0; i < n; i++) {
        puts_(b, "<|im_start|>");
        puts_(b, m[i].role);
        puts_(b, "\n");
        puts_(b, m[i].content);
        puts_(b, "<|im_end|>\n");
    }
}

static void render_qwen3_assistant(sbuf *b, const char *content, bool after_last_query, bool last) {
    const char *cb = content, *ce = content + strlen(content);
    const char *rb = ce, *re = ce; /* reasoning: empty */
    const char *close = strstr(content, "</think>");
    if (close) {
        /* content.split('</think>')[-1].lstrip('\n') */
        cb = find_last(content, ce, "</think>") + strlen("</think>");
        strip_nl(&cb, &ce, true, false);
        /* content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') */
        rb = content;
        re = close;
        strip_nl(&rb, &re, false, true);
        const char *open = find_last(rb, re, "<think>");
        if (open) rb = open + strlen("<think>");
        strip_nl(&rb, &re, true, false);
    }
    puts_(b, "<|im_start|>assistant\n");
    if (after_last_query && (last || re > rb)) {
        puts_(b, "<think>\n");
        strip_nl(&rb, &re, true, true);
        put(b, rb, (size_t)(re - rb));
        puts_(b, "\n</think>\n\n");
        strip_nl(&cb, &ce, true, false);
    }
    put(b, cb, (size_t)(ce - cb));
}

static void render_qwen3(sbuf *b, const lethe_chat_msg *m, size_t n) {
    if (n > 0 && !strcmp(m[0].role, "system")) {
        puts_(b, "<|im_start|>system\n");
        puts_(b, m[0].content);
        puts_(b, "<|im_end|>\n");
    }
    /* the last user message that is not a wrapped tool response */
    size_t last_query = n ? n - 1 : 0;
    for (size_t k = n; k-- > 0;) {
        if (!strcmp(m[k].role, "user") &&
            !(has_prefix(m[k].content, "<tool_response>") && has_suffix(m[k].content, "</tool_response>"))) {
            last_query = k;
            break;
        }
    }
    for (size_t i = 0; i < n; i++) {
        const char *role = m[i].role;
        if (!strcmp(role, "user") || (!strcmp(role, "system") && i > 0)) {
            puts_(b, "<|im_start|>");
            puts_(b, role);
            puts_(b, "\n");
            puts_(b, m[i].content);
            puts_(b, "<|im_end|>\n");
        } else if (!strcmp(role, "assistant")) {
            render_qwen3_assistant(b, m[i].content, i > last_query, i + 1 == n);
            puts_(b, "<|im_end|>\n");
        } else if (!strcmp(role, "tool")) {
            if (i == 0 || strcmp(m[i - 1].role, "tool") != 0) puts_(b, "<|im_start|>user");
            puts_(b, "\n<tool_response>\n");
            puts_(b, m[i].content);
            puts_(b, "\n</tool_response>");
            if (i + 1 == n || strcmp(m[i + 1].role, "tool") != 0) puts_(b, "<|im_end|>\n");
        }
    }
}

static void render_llama3(sbuf *b, const lethe_chat_msg *m, size_t n, bool include_bos) {
    if (include_bos) puts_(b, "<|begin_of_text|>");
    for (size_t i = 0; i < n; i++) {
        puts_(b, "<|start_header_id|>");
        puts_(b, m[i].role);
        puts_(b, "<|end_header_id|>\n\n");
        const char *cb = m[i].content, *ce = cb + strlen(cb);
        py_strip(&cb, &ce);
        put(b, cb, (size_t)(ce - cb));
        puts_(b, "<|eot_id|>");
    }
}

lethe_status lethe_chat_render(lethe_chat_format f, const lethe_chat_msg *msgs, size_t n,
                               bool add_generation_prompt, bool include_bos, char **out) {
    *out = NULL;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return lethe_errorf(LETHE_ERR_INVALID, "chat message %zu has no %s", i, msgs[i].role ? "content" : "role");
    sbuf b = {0};
    put(&b, "", 0);
    switch (f) {
    case LETHE_CHAT_CHATML:
    case LETHE_CHAT_SMOLLM2:
        render_chatml(&b, msgs, n, f == LETHE_CHAT_SMOLLM2);
        if (add_generation_prompt) puts_(&b, "<|im_start|>assistant\n");
        break;
    case LETHE_CHAT_QWEN3:
        render_qwen3(&b, msgs, n);
        if (add_generation_prompt) puts_(&b, "<|im_start|>assistant\n");
        break;
    case LETHE_CHAT_LLAMA3:
        render_llama3(&b, msgs, n, include_bos);
        if (add_generation_prompt) puts_(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
        break;
    default:
        free(b.s);
        return lethe_errorf(LETHE_ERR_INVALID, "unknown chat format %d", (int)f);
    }
    *out = b.s;
    return LETHE_OK;
}
