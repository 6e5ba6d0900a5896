/* server.h - the OpenAI-compatible HTTP server behind `lethe serve`.
 *
 * lethe_server_run() starts the HTTP listener first (so /health answers 503
 * while the model loads), then creates the engine, starts its thread and
 * serves until SIGINT/SIGTERM. Threads:
 *   - the HTTP loop (conn.c): one epoll thread owns every socket, reads
 *     requests within deadlines and writes responses, formatting token
 *     events into SSE chunks or whole responses as the engine wakes it;
 *   - HTTP workers (conn.c, --http-workers): route, authenticate, parse the
 *     request (openai.c), tokenize and submit it to the engine (http.c);
 *   - the engine thread (lethe_engine_start): owns all engine state and
 *     pushes events into the per-request queues from the engine callback;
 *   - a loader thread that builds the engine while HTTP already answers.
 * Module map: conn.c (HTTP/1.1 connections, limits, timeouts, worker pool),
 * http.c (routes, auth, tenancy, generation responses, startup),
 * openai.c (request JSON -> lethe_request_params, response JSON), req.c
 * (per-request event queues), metrics.c (Prometheus text). */
#ifndef LETHE_SERVER_H
#define LETHE_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "lethe.h"

typedef struct lethe_server_config {
    lethe_engine_params engine;
    const char *host;              /* default "127.0.0.1" */
    int32_t port;                  /* default 8000; 0 = any free port (printed) */
    /* API keys ("Authorization: Bearer KEY" on /v1 and /tokenize), NULL-terminated, and/or a
     * file of keys (one a line); none: no auth. A key is also its holder's tenant. */
    const char *api_keys[LETHE_MAX_STOP];
    const char *api_key_file;
    /* with no keys: a request header naming the tenant (set by an authenticating proxy) */
    const char *tenant_header;
    bool metrics_require_key;      /* /metrics needs a key too */
    bool replica;                  /* one replica of several behind a balancer: an unknown chain id
                                    * is 410 chain_gone (recreate it), not 404 (docs/deploy.md) */
    const char *served_model_name; /* NULL: the model file's base name */
    size_t max_body_bytes;         /* larger request bodies get 413; default 8 MiB */
    int32_t max_queued_requests;   /* in flight beyond max_num_seqs before 503; default 1024 */
    int32_t load_delay_ms;         /* testing: wait this long before loading (observe 503) */
    /* connection layer (conn.h) */
    int32_t max_connections;       /* open connections in all (default 8192; capped by RLIMIT_NOFILE) */
    int32_t max_connections_per_client; /* per peer address; 0 = no limit (default 256) */
    int32_t http_workers;          /* handler threads (default 4) */
    float header_timeout_s;        /* request line + headers complete within (default 10) */
    float body_timeout_s;          /* body complete within, after the headers (default 60) */
    float idle_timeout_s;          /* idle keep-alive connections close after (default 30) */
    float write_timeout_s;         /* a client reading nothing this long is dropped (default 60) */
    const char *tool_call_parser;  /* NULL / "auto": the chat template's; "hermes", "llama3_json", "glm45" */
    bool no_ui;                    /* no dashboard at GET / (404) */
} lethe_server_config;

void lethe_server_default_config(lethe_server_config *c);

/* Runs until SIGINT/SIGTERM. Returns a process exit code (0 on clean stop,
 * non-zero when the listener or the model failed to start). */
int lethe_server_run(const lethe_server_config *c);

#endif /* LETHE_SERVER_H */
