/* prefix_api.h - /v1/prefix_cache/... routes (prefix_api.c): pruning jobs and
 * radix control, answered on an HTTP worker thread. */
#ifndef LETHE_SERVER_PREFIX_API_H
#define LETHE_SERVER_PREFIX_API_H

#include <stdbool.h>
#include <stddef.h>

#include "server/openai.h"

#define SRV_PREFIX_CACHE_ROUTE "/v1/prefix_cache/"

/* The prune jobs the server remembers for GET prune/{id} (thread-safe). */
typedef struct srv_prune_jobs srv_prune_jobs;
srv_prune_jobs *srv_prune_jobs_new(void);
void srv_prune_jobs_free(srv_prune_jobs *j); /* after the engine is gone (no callback pending) */

/* path starts with SRV_PREFIX_CACHE_ROUTE; returns the JSON body (malloc'd)
 * with *status (200, or 202 for a queued prune), or NULL with *err. */
char *srv_prefix_cache_route(srv_prune_jobs *jobs, const srv_api *api, bool post, const char *path,
                             const char *body, size_t len, int *status, srv_error *err);

#endif /* LETHE_SERVER_PREFIX_API_H */
