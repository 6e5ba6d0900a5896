/* fuzz_chat_template.c - the chat template renderer on arbitrary
 * conversations. Input: byte 0 picks the format, byte 1 the options (the
 * generation prompt, BOS, thinking, tools in the user message); the rest is
 * split at NUL bytes into role, content, role, content, ...; a part starting
 * with '[' after an assistant role is its tool_calls JSON, and a final part
 * starting with "T[" is the tools array. Rendering either succeeds with a
 * NUL-terminated string or fails with an error; never crashes. */
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/status.h"
#include "fuzz_util.h"
#include "tokenizer/chat_template.h"

#define MAX_MSGS 32

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n) {
    if (n < 2) return 0;
    lethe_chat_format f = (lethe_chat_format)(data[0] % (LETHE_CHAT_LLAMA32 + 1));
    uint8_t bits = data[1];
    char *buf = malloc(n - 1);
    memcpy(buf, data + 2, n - 2);
    buf[n - 2] = '\0';
    char *parts[2 * MAX_MSGS + 1];
    int np = 0;
    for (char *p = buf; np < 2 * MAX_MSGS + 1;) {
        parts[np++] = p;
        char *z = memchr(p, '\0', (size_t)(buf + n - 2 - p));
        if (!z) break;
        p = z + 1;
        if (p > buf + n - 2) break;
    }
    cJSON *tools = NULL;
    if (np > 0 && parts[np - 1][0] == 'T' && parts[np - 1][1] == '[') tools = cJSON_Parse(parts[--np] + 1);
    lethe_chat_msg msgs[MAX_MSGS];
    cJSON *calls[MAX_MSGS] = {0};
    size_t nm = 0;
    for (int i = 0; i + 1 < np && nm < MAX_MSGS; i += 2) {
        msgs[nm] = (lethe_chat_msg){.role = parts[i], .content = parts[i + 1]};
        if (!strcmp(parts[i], "assistant") && parts[i + 1][0] == '[') {
            calls[nm] = cJSON_Parse(parts[i + 1]);
            msgs[nm].tool_calls = calls[nm];
            msgs[nm].content = (bits & 16) ? NULL : "";
        }
        if (bits & 32) msgs[nm].reasoning_content = parts[i + 1];
        nm++;
    }
    lethe_chat_opts o = {.add_generation_prompt = bits & 1, .include_bos = bits & 2, .tools = tools,
                         .enable_thinking = (bits >> 2) % 3 - 1, .preserve_thinking = bits & 64,
                         .date_string = (bits & 128) ? "01 Jan 2025" : NULL,
                         .tools_in_user_message = (bits & 8) ? 0 : -1};
    char *out = NULL;
    lethe_status st = lethe_chat_render_ex(f, msgs, nm, &o, &out);
    if (st == LETHE_OK) {
        FUZZ_CHECK(out != NULL);
        (void)strlen(out);
        free(out);
    } else {
        FUZZ_CHECK(out == NULL);
    }
    for (size_t i = 0; i < nm; i++) cJSON_Delete(calls[i]);
    cJSON_Delete(tools);
    free(buf);
    return 0;
}
