/* transfer.c - rows of backend buffers to and from the host (backend.h
 * rows_to_host / rows_from_host; CUDA twin backend/cuda/transfer.cu). The
 * CPU backend's memory is host memory, so these are memcpy loops: the
 * reference the CUDA comparison test holds the device copies to. */
#include <string.h>

#include "backend/cpu/cpu_ops.h"

void lethe_cpu_rows_to_host(lethe_backend *be, void *host, const void *buf, size_t row_bytes,
                            const int32_t *rows, int32_t n) {
    (void)be;
    for (int32_t i = 0; i < n; i++)
        memcpy((uint8_t *)host + (size_t)i * row_bytes,
               (const uint8_t *)buf + (size_t)rows[i] * row_bytes, row_bytes);
}

void lethe_cpu_rows_from_host(lethe_backend *be, void *buf, size_t row_bytes, const int32_t *rows,
                              int32_t n, const void *host) {
    (void)be;
    for (int32_t i = 0; i < n; i++)
        memcpy((uint8_t *)buf + (size_t)rows[i] * row_bytes,
               (const uint8_t *)host + (size_t)i * row_bytes, row_bytes);
}
