/* server.h - the OpenAI-compatible HTTP server behind `lethe serve`.
 *
 * lethe_server_run() starts the HTTP listener first (so /health answers 503
 * while the model loads), then creates the engine, starts its thread and
 * serves until SIGINT/SIGTERM. Threads:
 *   - libmicrohttpd: one thread per connection; it parses the request
 *     (openai.c), tokenizes, submits to the engine and formats the answer,
 *     blocking on its request's event queue (req.c) between tokens;
 *   - the engine thread (lethe_engine_start): owns all engine state and
 *     pushes events into the per-request queues from the engine callback;
 *   - a loader thread that builds the engine while HTTP already answers.
 * Module map: http.c (libmicrohttpd glue, routing, auth, SSE, disconnects),
 * openai.c (request JSON -> lethe_request_params, response JSON), req.c
 * (per-request event queues), metrics.c (Prometheus text). */
#ifndef LETHE_SERVER_H
#define LETHE_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "lethe.h"

typedef struct lethe_server_config {
    lethe_engine_params engine;
    const char *host;              /* default "127.0.0.1" */
    int32_t port;                  /* default 8000; 0 = any free port (printed) */
    const char *api_key;           /* NULL: no auth; else "Authorization: Bearer KEY" on /v1 */
    const char *served_model_name; /* NULL: the model file's base name */
    size_t max_body_bytes;         /* larger request bodies get 413; default 8 MiB */
    int32_t max_queued_requests;   /* in flight beyond max_num_seqs before 503; default 1024 */
    int32_t load_delay_ms;         /* testing: wait this long before loading (observe 503) */
} lethe_server_config;

void lethe_server_default_config(lethe_server_config *c);

/* Runs until SIGINT/SIGTERM. Returns a process exit code (0 on clean stop,
 * non-zero when the listener or the model failed to start). */
int lethe_server_run(const lethe_server_config *c);

#endif /* LETHE_SERVER_H */
