/* json.h - JSON helpers on top of cJSON for the places where the exact text
 * matters: chat templates (Jinja's `tojson`, i.e. Python's json.dumps) and
 * tool-call arguments.
 *
 * cJSON keeps numbers as doubles, so "1.0" and "1" (a float and an int to
 * Python) print the same. lethe_json_parse keeps each number's source text in
 * the node's valuestring (cJSON frees and duplicates valuestring for every
 * node type), and the printers below use it:
 *   lethe_json_print   compact JSON (numbers as written);
 *   lethe_json_dump_py json.dumps(x, ensure_ascii=False[, indent=k]) as
 *                      Python writes it: ", " / ": " separators (","
 *                      with an indent), ints as digits, floats as repr(float)
 *                      ("1.0", "1e-05", "1e+16"), strings with only
 *                      '"' '\\' and control characters escaped (\n \r \t \b
 *                      \f, others \u00XX), a repeated key once, at its
 *                      first place, with its last value (a Python dict). */
#ifndef LETHE_CORE_JSON_H
#define LETHE_CORE_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

/* growable NUL-terminated text */
typedef struct lethe_sbuf {
    char *s;
    size_t n, cap;
} lethe_sbuf;

void lethe_sbuf_add(lethe_sbuf *b, const char *s, size_t n);
void lethe_sbuf_puts(lethe_sbuf *b, const char *s);

/* cJSON_ParseWithLength plus each number's source text (NULL if not JSON). */
cJSON *lethe_json_parse(const char *s, size_t n);
/* Stores the number texts of s into an already parsed tree of s (the same
 * text cJSON parsed). */
void lethe_json_keep_numbers(cJSON *root, const char *s, size_t n);

char *lethe_json_print(const cJSON *v); /* malloc'd */
/* indent < 0: one line */
void lethe_json_dump_py(lethe_sbuf *b, const cJSON *v, int indent);
char *lethe_json_dumps_py(const cJSON *v, int indent); /* malloc'd */

#endif /* LETHE_CORE_JSON_H */
