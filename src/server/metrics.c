/* metrics.c - Prometheus text exposition of the server's metrics.
 *
 * Bucket bounds are vLLM's (vllm/v1/metrics/loggers.py), with two finer TTFT
 * / inter-token buckets at the low end because small models on CPU produce
 * tokens in a few milliseconds. Counters and gauges that the engine keeps
 * (tokens, prefix cache, KV usage, running/waiting) are read from
 * lethe_engine_stats at scrape time, so there is one source of truth. */
#include "server/metrics.h"

#include <stdlib.h>
#include <string.h>

#include "core/util.h"
#include "server/buf.h"

static const double k_ttft_bounds[] = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                       0.75,  1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0,
                                       160.0, 640.0, 2560.0};
static const double k_itl_bounds[] = {0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                      0.4,   0.5,   0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0,
                                      80.0};
static const double k_e2e_bounds[] = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,    10.0,  15.0,
                                      20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
                                      7680.0};

static void hist_init(srv_histogram *h, const double *b, int n) {
    LETHE_ASSERT(n < SRV_HIST_MAX_BUCKETS);
    memset(h, 0, sizeof(*h));
    h->bounds = b;
    h->n_bounds = n;
}

void srv_metrics_init(srv_metrics *m) {
    memset(m, 0, sizeof(*m));
    pthread_mutex_init(&m->mu, NULL);
    hist_init(&m->hist[SRV_HIST_TTFT], k_ttft_bounds, (int)LETHE_ARRAY_LEN(k_ttft_bounds));
    hist_init(&m->hist[SRV_HIST_ITL], k_itl_bounds, (int)LETHE_ARRAY_LEN(k_itl_bounds));
    hist_init(&m->hist[SRV_HIST_E2E], k_e2e_bounds, (int)LETHE_ARRAY_LEN(k_e2e_bounds));
}

void srv_metrics_destroy(srv_metrics *m) { pthread_mutex_destroy(&m->mu); }

void srv_metrics_observe(srv_metrics *m, int hist, double seconds) {
    LETHE_ASSERT(hist >= 0 && hist < SRV_HIST_N);
    if (seconds < 0) seconds = 0;
    pthread_mutex_lock(&m->mu);
    srv_histogram *h = &m->hist[hist];
    int i = 0;
    while (i < h->n_bounds && seconds > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += seconds;
    h->count++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_finished(srv_metrics *m, lethe_finish_reason r) {
    if ((int)r < 0 || r > LETHE_FINISH_ERROR) return;
    pthread_mutex_lock(&m->mu);
    m->finished[r]++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_chain_refused(srv_metrics *m, lethe_chain_code c) {
    if ((int)c <= LETHE_CHAIN_OK || c > LETHE_CHAIN_ENGINE_BUSY) return;
    pthread_mutex_lock(&m->mu);
    m->chain_refused[c]++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_chain_refusals(srv_metrics *m, uint64_t *out) {
    pthread_mutex_lock(&m->mu);
    memcpy(out, m->chain_refused, sizeof(m->chain_refused));
    pthread_mutex_unlock(&m->mu);
}

/* Label values are escaped per the exposition format (\\, \", \n). */
static void put_label(srv_buf *b, const char *v) {
    for (const char *p = v; *p; p++) {
        if (*p == '\\') srv_buf_puts(b, "\\\\");
        else if (*p == '"') srv_buf_puts(b, "\\\"");
        else if (*p == '\n') srv_buf_puts(b, "\\n");
        else srv_buf_add(b, p, 1);
    }
}

static void head(srv_buf *b, const char *name, const char *type, const char *help) {
    srv_buf_printf(b, "# HELP lethe:%s %s\n# TYPE lethe:%s %s\n", name, help, name, type);
}

static void sample(srv_buf *b, const char *name, const char *model, const char *extra, double v) {
    srv_buf_printf(b, "lethe:%s{model_name=\"", name);
    put_label(b, model);
    srv_buf_printf(b, "\"%s} %.17g\n", extra ? extra : "", v);
}

static void gauge(srv_buf *b, const char *name, const char *help, const char *model, double v) {
    head(b, name, "gauge", help);
    sample(b, name, model, NULL, v);
}

static void counter(srv_buf *b, const char *name, const char *help, const char *model, double v) {
    head(b, name, "counter", help);
    sample(b, name, model, NULL, v);
}

static void histogram(srv_buf *b, const char *name, const char *help, const char *model,
                      const srv_histogram *h) {
    head(b, name, "histogram", help);
    char bucket[96], extra[64];
    snprintf(bucket, sizeof(bucket), "%s_bucket", name);
    uint64_t cum = 0;
    for (int i = 0; i <= h->n_bounds; i++) {
        cum += h->counts[i];
        if (i < h->n_bounds) snprintf(extra, sizeof(extra), ",le=\"%g\"", h->bounds[i]);
        else snprintf(extra, sizeof(extra), ",le=\"+Inf\"");
        sample(b, bucket, model, extra, (double)cum);
    }
    char sum[96], cnt[96];
    snprintf(sum, sizeof(sum), "%s_sum", name);
    snprintf(cnt, sizeof(cnt), "%s_count", name);
    sample(b, sum, model, NULL, h->sum);
    sample(b, cnt, model, NULL, (double)h->count);
}

char *srv_metrics_render(srv_metrics *m, const lethe_engine_stats *st, const char *model) {
    srv_buf b = {0};
    if (st) {
        gauge(&b, "num_requests_running", "Number of requests in model execution batches.",
              model, st->n_running);
        gauge(&b, "num_requests_waiting", "Number of requests waiting to be processed.", model,
              st->n_waiting);
        gauge(&b, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", model,
              st->kv_usage);
        gauge(&b, "kv_cache_used_slots", "KV slots in use, summed over slot spaces.", model,
              (double)st->kv_slots_used);
        gauge(&b, "kv_cache_total_slots", "KV slots in all, summed over slot spaces.", model,
              (double)st->kv_slots_total);
        counter(&b, "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.", model,
                (double)st->prefix_queries_tokens);
        counter(&b, "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                model, (double)st->prefix_hit_tokens);
        counter(&b, "prefix_cache_inflight_waits_total",
                "Admissions put off to attach a shared prefix another request was computing.",
                model, (double)st->prefix_inflight_waits);
        counter(&b, "prompt_tokens_total", "Number of prefill tokens processed.", model,
                (double)st->prompt_tokens_total);
        counter(&b, "generation_tokens_total", "Number of generation tokens processed.", model,
                (double)st->generation_tokens_total);
        counter(&b, "prefill_tokens_computed_total",
                "Prompt tokens that went through the forward (prefix-cache hits excluded, "
                "recomputation after preemption included).",
                model, (double)st->prefill_tokens_computed);
        counter(&b, "num_preemptions_total", "Cumulative number of preemptions.", model,
                (double)st->n_preemptions);
        counter(&b, "engine_failed_steps_total",
                "Engine steps whose model forward failed; their requests ended with HTTP 500.",
                model, (double)st->n_failed_steps);
        gauge(
            &b, "kv_resident_slots",
            "KV slots holding KV (running requests and the prefix cache), summed over slot spaces.",
            model, (double)st->kv_slots_resident);
        gauge(&b, "kv_resident_tokens",
              "KV held per layer, in tokens: kv_resident_slots over the slot spaces (one shared "
              "space, or one per layer when a method compacts layers apart).",
              model, (double)st->kv_tokens_resident);
        counter(&b, "prefix_cache_prune_jobs_total", "Prefix-cache prune jobs committed.", model,
                (double)st->prune_jobs);
        counter(&b, "prefix_cache_pruned_slots_total",
                "KV slots per slot space freed by prefix-cache pruning.", model,
                (double)st->prune_freed_slots);
        gauge(&b, "host_cache_capacity_bytes", "Host-memory tier budget (--host-cache-bytes).",
              model, (double)st->host_cache_capacity_bytes);
        gauge(&b, "host_cache_used_bytes", "Host-memory tier bytes held by demoted blocks.", model,
              (double)st->host_cache_used_bytes);
        gauge(&b, "host_cache_entries", "Blobs (demoted prefix blocks) in the host-memory tier.",
              model, (double)st->host_cache_entries);
        counter(&b, "host_cache_demoted_blocks_total",
                "Prefix blocks demoted from the KV cache to host memory.", model,
                (double)st->host_cache_demoted_blocks);
        counter(&b, "host_cache_promoted_blocks_total",
                "Prefix blocks restored from host memory on a hit.", model,
                (double)st->host_cache_promoted_blocks);
        counter(&b, "host_cache_promoted_tokens_total",
                "Prompt tokens restored from host memory instead of recomputed.", model,
                (double)st->host_cache_promoted_tokens);
        counter(&b, "host_cache_demoted_bytes_total",
                "KV payload bytes copied from the KV cache to host memory (demotions).", model,
                (double)st->host_cache_demoted_bytes);
        counter(&b, "host_cache_demote_seconds_total",
                "Wall seconds of those copies (synchronous).", model, st->host_cache_demote_seconds);
        counter(&b, "host_cache_restored_bytes_total",
                "KV payload bytes copied from host memory back into the KV cache (restores).",
                model, (double)st->host_cache_restored_bytes);
        counter(&b, "host_cache_restore_seconds_total",
                "Wall seconds of those copies (synchronous).", model, st->host_cache_restore_seconds);
        gauge(&b, "host_cache_copy_bytes_per_second",
              "One large raw host -> KV-memory copy measured at start-up (the restores' ceiling).",
              model, st->host_cache_copy_bytes_per_s);
        counter(&b, "host_cache_evicted_total",
                "Blobs dropped from the host-memory tier to stay within its budget (LRU).", model,
                (double)st->host_cache_evicted);
        gauge(&b, "state_snapshots",
              "Hybrid models: linear-attention state snapshots the prefix cache holds (radix: "
              "snapshots; chain mode: idle chains' states).",
              model, (double)st->state_snapshots);
        gauge(&b, "state_snapshot_bytes", "Hybrid models: bytes of those states.", model,
              (double)st->state_snapshot_bytes);
        gauge(&b, "state_snapshot_capacity_bytes",
              "Hybrid models: the prefix cache's state budget (--state-snapshot-bytes).", model,
              (double)st->state_snapshot_capacity_bytes);
        counter(&b, "state_snapshots_taken_total",
                "Hybrid models, radix: state snapshots taken at prompt snapshot points.", model,
                (double)st->state_snapshots_taken);
        counter(&b, "state_snapshot_hits_total",
                "Hybrid models, radix: prefix hits resumed from a state snapshot.", model,
                (double)st->state_snapshot_hits);
        counter(&b, "state_snapshot_recomputed_tokens_total",
                "Hybrid models, radix: matched prompt tokens after the snapshot a hit resumed "
                "from, recomputed.",
                model, (double)st->state_snapshot_recomputed_tokens);
        counter(&b, "state_snapshots_evicted_total",
                "Hybrid models, radix: state snapshots dropped to stay within their budget (LRU).",
                model, (double)st->state_snapshots_evicted);
        counter(&b, "state_snapshots_demoted_total",
                "Hybrid models, radix: state snapshots moved to the host-memory tier with their "
                "blocks.",
                model, (double)st->state_snapshots_demoted);
        counter(&b, "state_snapshots_restored_total",
                "Hybrid models, radix: state snapshots restored from the host-memory tier on a hit.",
                model, (double)st->state_snapshots_restored);
    }
    pthread_mutex_lock(&m->mu);
    static const char *const reasons[] = {"none", "stop", "length", "abort", "error"};
    head(&b, "request_success_total", "counter", "Count of finished requests by finish reason.");
    for (int r = LETHE_FINISH_STOP; r <= LETHE_FINISH_ERROR; r++) {
        char extra[64];
        snprintf(extra, sizeof(extra), ",finished_reason=\"%s\"", reasons[r]);
        sample(&b, "request_success_total", model, extra, (double)m->finished[r]);
    }
    histogram(&b, "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              model, &m->hist[SRV_HIST_TTFT]);
    histogram(&b, "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              model, &m->hist[SRV_HIST_ITL]);
    histogram(&b, "e2e_request_latency_seconds",
              "Histogram of end to end request latency in seconds.", model,
              &m->hist[SRV_HIST_E2E]);
    pthread_mutex_unlock(&m->mu);
    return b.data;
}
