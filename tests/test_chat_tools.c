/* test_chat_tools.c - tools, tool calls, tool results and reasoning in the
 * built-in chat formats against HF apply_chat_template.
 *
 * tests/data/tokenizer/chat_tools_golden.jsonl (tests/gen/gen_chat_tools_golden.py)
 * holds per template and conversation the prompt transformers rendered with
 * the model's own template, or the template's exception. The format is
 * detected from the template text (the Qwen3 tokenizer_config, the .jinja
 * files of tests/data/tokenizer/templates); the rendering must match byte
 * for byte. Also: Python json.dumps formatting of the JSON helpers, the
 * unsupported-format error, preserve_thinking, Llama-3.2's date. */
#include <time.h>

#include "core/json.h"
#include "tok_golden.h"
#include "tokenizer/chat_template.h"

static char *read_text(const char *path) {
    char *s;
    size_t n;
    CHECK_MSG(lethe_read_file(path, &s, &n) == LETHE_OK, "%s: %s", path, lethe_last_error());
    return s;
}

static lethe_chat_format format_of(const char *tname) {
    char *tmpl = NULL, path[600];
    if (!strcmp(tname, "qwen3")) {
        char dir[512];
        snprintf(path, sizeof(path), "%s/tokenizer_config.json", shared_tokenizer_dir("qwen3", dir, sizeof(dir)));
        char *cfg = read_text(path);
        cJSON *j = cJSON_Parse(cfg);
        tmpl = lethe_xstrdup(cJSON_GetObjectItem(j, "chat_template")->valuestring);
        cJSON_Delete(j);
        free(cfg);
    } else {
        snprintf(path, sizeof(path), GOLDEN_DIR "templates/%s.jinja", tname);
        tmpl = read_text(path);
    }
    bool exact = false;
    lethe_chat_format f = lethe_chat_format_detect_text(tmpl, &exact);
    free(tmpl);
    CHECK_MSG(exact, "%s: template not recognized exactly", tname);
    CHECK_MSG(!strcmp(lethe_chat_format_name(f), tname), "%s detected as %s", tname, lethe_chat_format_name(f));
    return f;
}

static const char *str_or_null(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void test_golden(void) {
    char *all = read_text(GOLDEN_DIR "chat_tools_golden.jsonl");
    int n_cases = 0, n_errors = 0;
    for (char *line = all, *nl; *line; line = nl + 1) {
        nl = strchr(line, '\n');
        CHECK(nl);
        cJSON *rec = lethe_json_parse(line, (size_t)(nl - line));
        CHECK(rec);
        const char *tname = str_or_null(rec, "template"), *cname = str_or_null(rec, "case");
        lethe_chat_format f = format_of(tname);
        const cJSON *msgs = cJSON_GetObjectItem(rec, "messages"), *kw = cJSON_GetObjectItem(rec, "kwargs");
        lethe_chat_msg m[16];
        int n = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, msgs) {
            CHECK(n < 16);
            const cJSON *tc = cJSON_GetObjectItem(it, "tool_calls");
            m[n++] = (lethe_chat_msg){str_or_null(it, "role"), str_or_null(it, "content"), tc,
                                      str_or_null(it, "reasoning_content")};
        }
        lethe_chat_opts o = {.add_generation_prompt = cJSON_IsTrue(cJSON_GetObjectItem(rec, "add_generation_prompt")),
                             .include_bos = true, .enable_thinking = -1, .tools_in_user_message = -1,
                             .date_string = str_or_null(kw, "date_string")};
        const cJSON *tools = cJSON_GetObjectItem(rec, "tools");
        o.tools = cJSON_IsArray(tools) ? tools : NULL;
        const cJSON *et = cJSON_GetObjectItem(kw, "enable_thinking"), *tu = cJSON_GetObjectItem(kw, "tools_in_user_message");
        if (cJSON_IsBool(et)) o.enable_thinking = cJSON_IsTrue(et);
        if (cJSON_IsBool(tu)) o.tools_in_user_message = cJSON_IsTrue(tu);
        char *out = NULL;
        lethe_status st = lethe_chat_render_ex(f, m, (size_t)n, &o, &out);
        const char *want = str_or_null(rec, "expected"), *err = str_or_null(rec, "error");
        if (err) {
            CHECK_MSG(st == LETHE_ERR_INVALID && !out, "%s/%s: expected the template's error '%s'", tname, cname, err);
            CHECK_STR_CONTAINS(lethe_last_error(), err);
            n_errors++;
        } else {
            CHECK_MSG(st == LETHE_OK, "%s/%s: %s", tname, cname, lethe_last_error());
            CHECK_MSG(!strcmp(out, want), "%s/%s gen=%d:\n--- got\n%s\n--- want\n%s", tname, cname,
                      o.add_generation_prompt, out, want);
            /* an empty content next to tool calls may come as null: the same prompt */
            for (int i = 0; i < n; i++)
                if (m[i].tool_calls && m[i].content && !m[i].content[0]) m[i].content = NULL;
            char *out2 = NULL;
            CHECK(lethe_chat_render_ex(f, m, (size_t)n, &o, &out2) == LETHE_OK && !strcmp(out2, want));
            free(out2);
        }
        free(out);
        cJSON_Delete(rec);
        n_cases++;
    }
    CHECK(n_cases >= 100 && n_errors >= 8);
    fprintf(stderr, "    %d golden conversations (%d template errors)\n", n_cases, n_errors);
    free(all);
}

static void check_py(const char *json, int indent, const char *want) {
    cJSON *v = lethe_json_parse(json, strlen(json));
    CHECK(v);
    char *got = lethe_json_dumps_py(v, indent);
    CHECK_MSG(!strcmp(got, want), "dumps(%s): got %s want %s", json, got, want);
    free(got);
    cJSON_Delete(v);
}

static void test_json(void) {
    /* what Python's json.dumps(json.loads(x)) writes */
    check_py("[1, 1.0, -0, -0.0, 1E2, 1e-7, 0.1, 1e16, 1e15, 123456789012345678901234567890, 2.5e-4, 1e400]", -1,
             "[1, 1.0, 0, -0.0, 100.0, 1e-07, 0.1, 1e+16, 1000000000000000.0, 123456789012345678901234567890, "
             "0.00025, Infinity]");
    check_py("{\"a\":1,\"b\":{},\"a\":[2,{}],\"c\":[]}", -1, "{\"a\": [2, {}], \"b\": {}, \"c\": []}");
    check_py("{\"k\":[true,null,\"x\"]}", 2, "{\n  \"k\": [\n    true,\n    null,\n    \"x\"\n  ]\n}");
    check_py("\"q\\\" b\\\\ \\n\\t\\u0001\\u007f é \\ud83d\\ude00 /\"", -1, "\"q\\\" b\\\\ \\n\\t\\u0001\x7f é 😀 /\"");
    /* the compact printer keeps numbers as written */
    const char *src = " {\"x\" : [1.50, -0, 2e3 ,\"s\"], \"y\":{\"z\":1e-2}} ";
    cJSON *v = lethe_json_parse(src, strlen(src));
    char *p = lethe_json_print(v);
    CHECK(!strcmp(p, "{\"x\":[1.50,0,2e3,\"s\"],\"y\":{\"z\":1e-2}}"));
    free(p);
    /* numbers survive cJSON_Duplicate (chat messages are copied) */
    cJSON *d = cJSON_Duplicate(v, true);
    p = lethe_json_dumps_py(d, -1);
    CHECK(!strcmp(p, "{\"x\": [1.5, 0, 2000.0, \"s\"], \"y\": {\"z\": 0.01}}"));
    free(p);
    cJSON_Delete(d);
    cJSON_Delete(v);
    CHECK(lethe_json_parse("{", 1) == NULL);
}

static void test_unsupported_and_options(void) {
    const char *tj = "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}]";
    cJSON *tools = lethe_json_parse(tj, strlen(tj));
    lethe_chat_msg u = {"user", "hi", NULL, NULL};
    lethe_chat_opts o = {.add_generation_prompt = true, .include_bos = true, .enable_thinking = -1,
                         .tools_in_user_message = -1, .tools = tools};
    char *out = NULL;
    /* formats without a tool format refuse tools and tool calls with a clear error */
    const lethe_chat_format none[] = {LETHE_CHAT_CHATML, LETHE_CHAT_SMOLLM2, LETHE_CHAT_LLAMA3};
    for (size_t i = 0; i < 3; i++) {
        CHECK_EQ_INT(lethe_chat_render_ex(none[i], &u, 1, &o, &out), LETHE_ERR_UNSUPPORTED);
        CHECK(!out);
        CHECK_STR_CONTAINS(lethe_last_error(), "has no tool-calling format");
        CHECK_EQ_INT(lethe_chat_tool_style(none[i]), LETHE_TOOLS_NONE);
    }
    CHECK_EQ_INT(lethe_chat_tool_style(LETHE_CHAT_QWEN3), LETHE_TOOLS_HERMES);
    CHECK_EQ_INT(lethe_chat_tool_style(LETHE_CHAT_LLAMA31), LETHE_TOOLS_LLAMA_JSON);
    const char *cj = "[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{}}}]";
    cJSON *calls = lethe_json_parse(cj, strlen(cj));
    lethe_chat_msg conv[2] = {{"user", "hi", NULL, NULL}, {"assistant", NULL, calls, NULL}};
    o.tools = NULL;
    CHECK_EQ_INT(lethe_chat_render_ex(LETHE_CHAT_SMOLLM2, conv, 2, &o, &out), LETHE_ERR_UNSUPPORTED);
    /* a null content without calls is invalid */
    lethe_chat_msg bad = {"assistant", NULL, NULL, NULL};
    CHECK_EQ_INT(lethe_chat_render_ex(LETHE_CHAT_QWEN3, &bad, 1, &o, &out), LETHE_ERR_INVALID);

    /* Qwen3 preserve_thinking: an earlier turn keeps its reasoning (the model's own output) */
    lethe_chat_msg hist[3] = {{"user", "a", NULL, NULL}, {"assistant", "B", NULL, "r1"}, {"user", "c", NULL, NULL}};
    o.add_generation_prompt = false;
    CHECK(lethe_chat_render_ex(LETHE_CHAT_QWEN3, hist, 3, &o, &out) == LETHE_OK);
    CHECK(!strcmp(out, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"));
    free(out);
    o.preserve_thinking = true;
    CHECK(lethe_chat_render_ex(LETHE_CHAT_QWEN3, hist, 3, &o, &out) == LETHE_OK);
    CHECK(!strcmp(out, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nB<|im_end|>\n"
                       "<|im_start|>user\nc<|im_end|>\n"));
    free(out);
    /* a turn without reasoning is unchanged by preserve_thinking */
    hist[1].reasoning_content = NULL;
    CHECK(lethe_chat_render_ex(LETHE_CHAT_QWEN3, hist, 3, &o, &out) == LETHE_OK);
    CHECK(!strcmp(out, "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n<|im_start|>user\nc<|im_end|>\n"));
    free(out);

    /* Llama-3.2 without date_string: today's date, as strftime_now("%d %b %Y") */
    o = (lethe_chat_opts){.add_generation_prompt = true, .include_bos = false, .enable_thinking = -1,
                          .tools_in_user_message = -1};
    char today[32], want[96];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    strftime(today, sizeof(today), "%d %b %Y", &tm);
    snprintf(want, sizeof(want), "Today Date: %s\n\n", today);
    CHECK(lethe_chat_render_ex(LETHE_CHAT_LLAMA32, &u, 1, &o, &out) == LETHE_OK);
    CHECK_STR_CONTAINS(out, want);
    CHECK(strncmp(out, "<|start_header_id|>system", 25) == 0); /* include_bos = false: no BOS text */
    free(out);
    CHECK(lethe_chat_render_ex(LETHE_CHAT_LLAMA31, &u, 1, &o, &out) == LETHE_OK);
    CHECK_STR_CONTAINS(out, "Today Date: 26 Jul 2024\n\n");
    free(out);
    cJSON_Delete(tools);
    cJSON_Delete(calls);
}

static void test_detect(void) {
    bool exact = true;
    CHECK_EQ_INT(lethe_chat_format_detect_text(NULL, &exact), LETHE_CHAT_CHATML);
    CHECK(!exact);
    /* an unknown ChatML template with tools is only a guess */
    CHECK_EQ_INT(lethe_chat_format_detect_text("<|im_start|>{% if tools %}..{% endif %}", &exact), LETHE_CHAT_CHATML);
    CHECK(!exact);
    CHECK_EQ_INT(lethe_chat_format_detect_text("{{ '<|im_start|>' + m.role }}", &exact), LETHE_CHAT_CHATML);
    CHECK(exact);
}

int main(void) {
    TEST_RUN(test_json);
    TEST_RUN(test_detect);
    TEST_RUN(test_golden);
    TEST_RUN(test_unsupported_and_options);
    fprintf(stderr, "test_chat_tools: all passed\n");
    return 0;
}
