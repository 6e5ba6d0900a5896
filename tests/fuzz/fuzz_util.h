/* fuzz_util.h - helpers shared by the libFuzzer harnesses (tests/fuzz).
 *
 * The readers under test open files by path (they mmap them), so an input
 * is written to a memfd and opened as /proc/self/fd/N: no disk, no races
 * between parallel runs. FUZZ_CHECK aborts (a crash libFuzzer reports and
 * saves) when a property the harness asserts does not hold. */
#ifndef LETHE_FUZZ_UTIL_H
#define LETHE_FUZZ_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define FUZZ_CHECK(c)                                                              \
    do {                                                                           \
        if (!(c)) {                                                                \
            fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed\n", __FILE__, __LINE__, #c); \
            abort();                                                               \
        }                                                                          \
    } while (0)

/* Writes data to a fresh memfd; fills path ("/proc/self/fd/N"); returns the fd (close it after). */
static inline int fuzz_memfile(const uint8_t *data, size_t n, char *path, size_t cap) {
    int fd = memfd_create("lethe-fuzz", MFD_CLOEXEC);
    FUZZ_CHECK(fd >= 0);
    size_t off = 0;
    while (off < n) {
        ssize_t w = write(fd, data + off, n - off);
        FUZZ_CHECK(w > 0);
        off += (size_t)w;
    }
    snprintf(path, cap, "/proc/self/fd/%d", fd);
    return fd;
}

/* The default model (make model fetches it), for harnesses that need a real tokenizer. */
static inline const char *fuzz_model_path(void) {
    const char *p = getenv("LETHE_FUZZ_MODEL");
    return p ? p : "models/SmolLM2-135M-Instruct.Q4_1.gguf";
}

#endif /* LETHE_FUZZ_UTIL_H */
