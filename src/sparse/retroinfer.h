/* retroinfer.h - a read-only view of one RetroInfer request's index (tests
 * and the reference comparison; the method itself is src/sparse/retroinfer.c). */
#ifndef LETHE_SPARSE_RETROINFER_H
#define LETHE_SPARSE_RETROINFER_H

#include "sparse/sparse.h"

/* Entries are logical: entry e is the request's e-th token, counting the
 * entries the host tier offloaded (sink .. sink + n_offloaded: no longer in
 * the pool row, whose index of a later entry e is e - n_offloaded). */
typedef struct lethe_retro_head_view {
    int32_t end; /* entries [sink, end) are clustered; 0 = no index yet */
    int32_t n_offloaded; /* entries [sink, sink + n_offloaded) left the pool (host tier) */
    int32_t n_clusters;
    const int32_t
        *mbeg; /* [n_clusters + 1]: cluster c's members are members[mbeg[c] .. mbeg[c+1]) */
    const int32_t *members; /* entries, ascending within a cluster */
    const int32_t *rows;    /* [n_clusters] rows of the layer's cluster tables */
    const int64_t *host_at; /* [n_clusters] first head vector in the host store, -1 = none */
} lethe_retro_head_view;

/* The index of request `state` (a retroinfer state) for (layer, KV head);
 * false when m is not retroinfer or the request has no state. */
bool lethe_retroinfer_view(const lethe_sparse_method *m, const void *state, int32_t layer,
                           int32_t head, lethe_retro_head_view *out);
/* Cluster table row `row` of `layer` (centroid = mean key [head_dim], value
 * sum [head_dim], count) into host floats; host-memory backends only. */
bool lethe_retroinfer_table_row(const lethe_sparse_method *m, int32_t layer, int32_t row,
                                float *cent, float *vsum, float *count);
/* host-tier counters since the method was created */
typedef struct lethe_retro_counters {
    int64_t hits, misses;  /* retrieved clusters found in / copied into the device ring */
    int64_t pool_reads;    /* retrieved host-tier clusters read from the pool (no ring room) */
    int64_t demoted;       /* retrieved offloaded clusters estimated (no ring room) */
    int64_t offloaded;     /* entries dropped from the pool */
    int64_t bytes_fetched; /* host -> device ring */
} lethe_retro_counters;
void lethe_retroinfer_counters(const lethe_sparse_method *m, lethe_retro_counters *out);

#endif /* LETHE_SPARSE_RETROINFER_H */
