/* bench_serve.h - the parts of `lethe bench serve` that do not touch the network.
 *
 * tools/bench_serve.c drives HTTP (libcurl multi interface, one thread);
 * everything it computes lives here so it can be unit tested:
 *  - an incremental Server-Sent-Events parser (bytes arrive in arbitrary
 *    pieces; each complete event's data is handed to a callback),
 *  - parsing of one OpenAI streaming chunk (text / delta content, usage,
 *    finish reason, error),
 *  - the workload: input/output lengths (random within a range ratio, fixed,
 *    or from a JSONL dataset), prompts of single-token words with an
 *    optional shared prefix, and Poisson arrival times,
 *  - the report: vLLM `bench serve` metrics (request / token throughput and
 *    mean, median, std and percentiles of TTFT, TPOT, ITL, E2EL in ms).
 * Metric definitions (serving-conventions §6.1): TTFT = send -> first
 * content chunk; TPOT = (E2EL - TTFT) / (output tokens - 1); ITL = gaps
 * between successive content chunks; E2EL = send -> end of the response. */
#ifndef LETHE_EVAL_BENCH_SERVE_H
#define LETHE_EVAL_BENCH_SERVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/status.h"

/* ---- SSE ---------------------------------------------------------------- */

typedef struct lethe_sse {
    char *line;          /* current partial line */
    size_t n, cap;
    char *data;          /* data lines of the current event, joined by '\n' */
    size_t n_data, cap_data;
    bool has_data;
    bool last_cr;        /* the previous byte was \r (a \n right after it is skipped) */
} lethe_sse;

/* called with the event's data (NUL-terminated), once per event */
typedef void (*lethe_sse_fn)(void *user, const char *data, size_t len);

void lethe_sse_init(lethe_sse *s);
void lethe_sse_free(lethe_sse *s);
/* Feeds bytes; lines end in \n, \r\n or \r; "data:" fields accumulate and a
 * blank line dispatches the event; comments (":...") and other fields are
 * ignored. */
void lethe_sse_feed(lethe_sse *s, const char *bytes, size_t n, lethe_sse_fn fn, void *user);

/* ---- one streamed chunk ---------------------------------------------------- */

typedef struct lethe_bs_chunk {
    bool done;               /* "[DONE]" */
    bool parsed;             /* valid JSON object */
    size_t content_bytes;    /* bytes of choices[0].text or choices[0].delta.content */
    bool has_usage;          /* a usage object (not null) */
    int32_t prompt_tokens, completion_tokens, cached_tokens;
    bool finished;           /* choices[0].finish_reason is a string */
    char error[200];         /* an "error" object's message, else "" */
} lethe_bs_chunk;

void lethe_bs_parse_chunk(const char *data, size_t len, lethe_bs_chunk *out);

/* ---- workload ------------------------------------------------------------ */

typedef struct lethe_bs_item {
    char *prompt;            /* text (malloc'd); for chat: the user message */
    char *messages_json;     /* dataset chat messages as a JSON array (malloc'd) or NULL */
    int32_t input_len;       /* requested (words ~ tokens); dataset: -1 if unknown */
    int32_t output_len;      /* max_tokens sent (ignore_eos makes it exact) */
    double arrival_s;        /* send time relative to the start */
} lethe_bs_item;

typedef struct lethe_bs_workload_params {
    int32_t num_prompts;
    int32_t input_len, output_len;
    float range_ratio;       /* lengths uniform in [L(1-r), L(1+r)]; 0 = fixed */
    int32_t shared_prefix_len; /* words every prompt starts with */
    double request_rate;     /* requests/s, Poisson arrivals; <= 0 or inf: all at t = 0 */
    uint64_t seed;
    const char *dataset;     /* JSONL path or NULL (random) */
} lethe_bs_workload_params;

/* Builds num_prompts items. A dataset line is {"prompt": str} or
 * {"messages": [...]}, with optional "output_len" (or "max_tokens"); lines
 * are used in order, cycling when num_prompts exceeds them. Errors name the
 * file and line. */
lethe_status lethe_bs_workload_make(const lethe_bs_workload_params *p, lethe_bs_item **items);
void lethe_bs_workload_free(lethe_bs_item *items, int32_t n);

/* The word list random prompts are drawn from: each word with a leading
 * space is a single token in the SmolLM2, Llama-3 and Qwen3 vocabularies, so
 * a prompt of N words is close to N tokens. */
extern const char *const lethe_bs_words[];
extern const int32_t lethe_bs_n_words;

/* ---- report -------------------------------------------------------------- */

typedef struct lethe_bs_record {
    bool ok;                 /* HTTP 200 and a complete stream */
    double t_start, t_first, t_end; /* seconds, same clock; t_first < 0: no content */
    double *itl;             /* [n_itl] seconds between successive content chunks */
    int32_t n_itl;
    int32_t n_chunks;        /* content chunks received */
    int32_t prompt_tokens;   /* from usage, or -1 */
    int32_t output_tokens;   /* usage.completion_tokens, else n_chunks */
    int32_t cached_tokens;
    char error[256];
} lethe_bs_record;

/* Adds the vLLM-style metrics of records[0..n) to obj: completed, failed,
 * total_input_tokens, total_output_tokens, request_throughput,
 * output_throughput, total_token_throughput, and for ttft / tpot / itl /
 * e2el: mean_X_ms, median_X_ms, std_X_ms and pNN_X_ms for each pcts[i]. */
void lethe_bs_report(cJSON *obj, const lethe_bs_record *records, int32_t n, double duration_s,
                     const double *pcts, int n_pcts);

/* Sum of the samples in a Prometheus text exposition whose metric name is
 * `suffix` or "<prefix>:" + suffix (any labels), e.g. "time_to_first_token_seconds_sum" matches
 * "lethe:time_to_first_token_seconds_sum{model_name=...}". Returns false
 * when no sample matches. */
bool lethe_bs_prom_sum(const char *text, const char *suffix, double *out);

#endif /* LETHE_EVAL_BENCH_SERVE_H */
