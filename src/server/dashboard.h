/* dashboard.h - the live dashboard of `lethe serve` (GET /, off with
 * --no-ui): one static page embedded in the binary (dashboard.html), and the
 * /metrics series its panels draw that the OpenAI-style metrics lack: the
 * engine's identity, KV use per slot space, attention reads vs resident KV
 * and evictions (per step from the step counter), each chain's resident vs
 * logical tokens. */
#ifndef LETHE_SERVER_DASHBOARD_H
#define LETHE_SERVER_DASHBOARD_H

#include "lethe.h"
#include "server/buf.h"

/* the page, NUL-terminated (malloc'd: the connection layer owns bodies) */
char *srv_dashboard_page(void);

/* Appends the dashboard's series to a /metrics body. method / config /
 * device: the engine parameters the server was started with. */
void srv_dashboard_metrics(lethe_engine *e, const char *model, const lethe_engine_params *p,
                           srv_buf *b);

#endif /* LETHE_SERVER_DASHBOARD_H */
