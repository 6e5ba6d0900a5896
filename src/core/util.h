/* util.h - small helpers shared by every module: checked allocation,
 * file slurping, monotonic time, hashing. */
#ifndef LETHE_UTIL_H
#define LETHE_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "core/status.h"

#define LETHE_MIN(a, b) ((a) < (b) ? (a) : (b))
#define LETHE_MAX(a, b) ((a) > (b) ? (a) : (b))
#define LETHE_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))
#define LETHE_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* Allocation that aborts on failure: for small bookkeeping whose failure
 * cannot be handled sensibly. Large, size-from-input allocations use malloc
 * and return LETHE_ERR_NOMEM instead. */
void *lethe_xmalloc(size_t n);
void *lethe_xcalloc(size_t n, size_t size);
void *lethe_xrealloc(void *p, size_t n);
char *lethe_xstrdup(const char *s);

/* Reads a whole file into a NUL-terminated buffer (caller frees). */
lethe_status lethe_read_file(const char *path, char **out, size_t *out_len);

double lethe_time_s(void); /* monotonic seconds */

uint64_t lethe_hash64(const void *data, size_t n, uint64_t seed); /* FNV-1a based mix */

/* splitmix64: deterministic PRNG for dummy weights and tests. */
static inline uint64_t lethe_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#endif /* LETHE_UTIL_H */
