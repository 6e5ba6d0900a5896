/* metrics.h - Prometheus metrics of the server (GET /metrics).
 *
 * Names follow vLLM's under a `lethe:` prefix with a model_name label, so a
 * vLLM dashboard works by changing the prefix. Gauges and token counters come
 * from lethe_engine_get_stats() at scrape time; the latency histograms (TTFT,
 * inter-token, end-to-end) and finished-request counters are recorded here by
 * the engine callback as events arrive. */
#ifndef LETHE_SERVER_METRICS_H
#define LETHE_SERVER_METRICS_H

#include <pthread.h>
#include <stdint.h>

#include "lethe.h"

#define SRV_HIST_MAX_BUCKETS 32

typedef struct srv_histogram {
    const double *bounds;       /* upper bounds, ascending; +Inf implied */
    int n_bounds;
    uint64_t counts[SRV_HIST_MAX_BUCKETS]; /* per bucket (not cumulative) + one for +Inf */
    double sum;
    uint64_t count;
} srv_histogram;

enum { SRV_HIST_TTFT = 0, SRV_HIST_ITL, SRV_HIST_E2E, SRV_HIST_N };

typedef struct srv_metrics {
    pthread_mutex_t mu;
    srv_histogram hist[SRV_HIST_N];
    uint64_t finished[LETHE_FINISH_ERROR + 1]; /* by lethe_finish_reason */
    uint64_t
        chain_refused[LETHE_CHAIN_ENGINE_BUSY + 1]; /* refused chain turns, by lethe_chain_code */
} srv_metrics;

void srv_metrics_init(srv_metrics *m);
void srv_metrics_destroy(srv_metrics *m);
void srv_metrics_observe(srv_metrics *m, int hist, double seconds);
void srv_metrics_finished(srv_metrics *m, lethe_finish_reason r);
void srv_metrics_chain_refused(srv_metrics *m, lethe_chain_code c);
/* A copy of m->chain_refused (out[LETHE_CHAIN_ENGINE_BUSY + 1]). */
void srv_metrics_chain_refusals(srv_metrics *m, uint64_t *out);

/* Prometheus text exposition (version 0.0.4), malloc'd. st may be NULL while
 * the model loads (engine gauges are then omitted). */
char *srv_metrics_render(srv_metrics *m, const lethe_engine_stats *st, const char *model_name);

#endif /* LETHE_SERVER_METRICS_H */
