/* test_server_input.c - strict request-body parsing (json_in.c) and the
 * sanitizing of client text in error bodies: trailing data, invalid UTF-8,
 * NUL bytes and \u0000 escapes are refused with a 400 that names where; error
 * bodies stay valid UTF-8 JSON whatever the message quotes. */
#include <cjson/cJSON.h>

#include "server/openai.h"
#include "test.h"

static int parse(const char *s, size_t n, srv_error *err) {
    cJSON *root = NULL;
    memset(err, 0, sizeof(*err));
    int rc = srv_json_parse(s, n, &root, err);
    if (rc == 0) {
        CHECK(root != NULL);
        cJSON_Delete(root);
    } else {
        CHECK(root == NULL);
        CHECK_EQ_INT(err->status, 400);
    }
    return rc;
}

static void test_accepts(void) {
    srv_error e;
    const char *ok[] = {"{}", " {\"a\": 1}\n\t ", "[1,2]", "{\"s\": \"\\\\u0000 is text\"}",
                        "{\"s\": \"caf\xc3\xa9 \xf0\x9f\x98\x80\"}", "{\"s\": \"\\u00e9\\u0001\"}"};
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
        CHECK_MSG(parse(ok[i], strlen(ok[i]), &e) == 0, "%s: %s", ok[i], e.message);
}

static void test_refuses(void) {
    srv_error e;
    CHECK(parse("{\"a\": 1} garbage", 16, &e) != 0);
    CHECK_STR_CONTAINS(e.message, "unexpected data after the JSON value (byte offset 9)");
    CHECK(parse("{\"a\": 1}{}", 10, &e) != 0);
    CHECK_STR_CONTAINS(e.message, "after the JSON value");
    CHECK(parse("{\"a\": ", 6, &e) != 0);
    CHECK_STR_CONTAINS(e.message, "not valid JSON");
    CHECK(parse("", 0, &e) != 0);
    /* invalid UTF-8: a lone continuation byte, an overlong encoding, a surrogate, a truncated sequence */
    const char *bad[] = {"{\"m\": \"\x80\"}", "{\"m\": \"\xc0\xaf\"}", "{\"m\": \"\xed\xa0\x80\"}", "{\"m\": \"\xe2\x82\"}"};
    for (size_t i = 0; i < 4; i++) {
        CHECK(parse(bad[i], strlen(bad[i]), &e) != 0);
        CHECK_STR_CONTAINS(e.message, "not valid UTF-8 (byte offset 7)");
    }
    CHECK(parse("{\"m\": \"a\0b\"}", 12, &e) != 0);
    CHECK_STR_CONTAINS(e.message, "NUL byte (byte offset 8)");
    /* \u0000 in a value names the field; in a key says so */
    const char *nul = "{\"model\": \"x\", \"messages\": [{\"role\": \"us\\u0000er\"}]}";
    CHECK(parse(nul, strlen(nul), &e) != 0);
    CHECK_STR_CONTAINS(e.message, "'role' contains a NUL character");
    CHECK(!strcmp(e.param, "role"));
    const char *nulkey = "{\"mo\\u0000del\": 1}";
    CHECK(parse(nulkey, strlen(nulkey), &e) != 0);
    CHECK_STR_CONTAINS(e.message, "a field name contains a NUL");
    const char *top = "[\"\\u0000\"]";
    CHECK(parse(top, strlen(top), &e) != 0);
    CHECK_STR_CONTAINS(e.message, "a string contains a NUL");
    /* lone surrogate escapes are refused by the parser */
    CHECK(parse("{\"a\": \"\\ud800\"}", 15, &e) != 0);
}

static void test_clip_and_error_json(void) {
    char buf[16];
    CHECK(!strcmp(srv_clip("short", buf, sizeof(buf)), "short"));
    CHECK(!strcmp(srv_clip("0123456789abcdefXYZ", buf, sizeof(buf)), "0123456789ab..."));
    /* never cuts inside a UTF-8 sequence: 10 ASCII + 3-byte euro sign straddling the cut */
    CHECK(!strcmp(srv_clip("0123456789\xe2\x82\xac tail", buf, sizeof(buf)), "0123456789..."));
    srv_error e = {.status = 404};
    snprintf(e.message, sizeof(e.message), "no route GET /\xff\xfe\x01x");
    char *j = srv_error_json(&e);
    for (const char *p = j; *p; p++) CHECK((unsigned char)*p != 0xff && (unsigned char)*p != 0x01);
    cJSON *root = NULL;
    srv_error e2;
    CHECK_MSG(srv_json_parse(j, strlen(j), &root, &e2) == 0, "%s", j);
    const cJSON *m = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "error"), "message");
    CHECK_STR_CONTAINS(m->valuestring, "no route GET /\xef\xbf\xbd\xef\xbf\xbd\x01x");
    cJSON_Delete(root);
    free(j);
}

/* regression (fuzz_openai): /detokenize of a token whose text is empty built its
 * reply from a sanitized buffer that was never NUL-terminated */
static void test_sanitize_empty(void) {
    char *a = srv_utf8_sanitize("", 0), *b = srv_utf8_sanitize("\0\0\0", 3), *c = srv_utf8_sanitize("x\xff", 2);
    CHECK(!strcmp(a, "") && !strcmp(b, "") && !strcmp(c, "x\xef\xbf\xbd"));
    free(a);
    free(b);
    free(c);
}

int main(void) {
    test_sanitize_empty();
    test_accepts();
    test_refuses();
    test_clip_and_error_json();
    printf("test_server_input: all passed\n");
    return 0;
}
