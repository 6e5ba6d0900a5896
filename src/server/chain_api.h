/* chain_api.h - Chain Cache request fields, responses, errors and metrics
 * of the OpenAI server (chain_api.c has the rules). */
#ifndef LETHE_SERVER_CHAIN_API_H
#define LETHE_SERVER_CHAIN_API_H

#include <cjson/cJSON.h>

#include "server/buf.h"
#include "server/openai.h"

#define SRV_CHAIN_ID_HEADER "X-Lethe-Chain-Id"
#define SRV_NEW_CHAIN_ID_HEADER "X-Lethe-New-Chain-Id"

/* After the prompt is parsed: reads chain_id / chain_append_start; in append
 * mode replaces g->prompt by the appended tokens. -1 + *err on bad input. */
int srv_chain_parse(const srv_api *api, const cJSON *root, srv_kind kind, srv_gen *g, srv_error *err);
/* lethe_engine_submit_chain with g's chain fields; fills g->chain_res
 * (with api->replica an unknown id becomes LETHE_CHAIN_GONE). */
int srv_chain_submit(const srv_api *api, const lethe_request_params *p, srv_gen *g, uint64_t *id);
/* The response header lines of a chain turn ("" outside chain mode):
 * X-Lethe-Chain-Id (+ X-Lethe-Chain-Status once admitted). */
void srv_chain_headers_out(const srv_gen *g, char *out, size_t cap);
/* The HTTP status of a chain turn the engine refused (g->chain_res.code),
 * 0 when g is not a refused chain turn. */
int srv_chain_refusal_status(const srv_gen *g);
/* Error body for a refused chain turn (g->chain_res), malloc'd. */
char *srv_chain_error_json(const srv_gen *g);
/* HTTP status and code string of a chain result (the anchor's table: 404
 * chain_not_found, 409 chain_busy | chain_prefix_mismatch |
 * chain_fingerprint_mismatch, 410 chain_gone, 503 chain_capacity_unavailable,
 * 400 chain_invalid_request | chain_mode_disabled). */
int srv_chain_http_status(lethe_chain_code c);
const char *srv_chain_code_name(lethe_chain_code c);
/* Adds chain_id / chain_status to a response or chunk object. */
void srv_chain_annotate(const srv_gen *g, cJSON *root);
/* lethe:chain_cache_* series and lethe:chain_turns_refused_total from
 * refused[lethe_chain_code] (nothing outside chain mode). */
void srv_chain_metrics(lethe_engine *e, const uint64_t *refused, const char *model, srv_buf *b);

#endif /* LETHE_SERVER_CHAIN_API_H */
