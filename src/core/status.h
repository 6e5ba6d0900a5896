/* status.h - the error vocabulary of lethe.
 *
 * Operating errors (bad files, bad requests, unsupported models, allocation
 * failure at init) are returned as lethe_status and carry a message set with
 * lethe_errorf() at the point of detection. Programmer errors (broken
 * invariants) are LETHE_ASSERT, which stays on in release builds. */
#ifndef LETHE_STATUS_H
#define LETHE_STATUS_H

#include <stdio.h>
#include <stdlib.h>

typedef enum lethe_status {
    LETHE_OK = 0,
    LETHE_ERR_INVALID,      /* bad argument, flag or user input */
    LETHE_ERR_IO,           /* open/read/mmap/socket failed */
    LETHE_ERR_FORMAT,       /* malformed GGUF, safetensors, tokenizer or JSON */
    LETHE_ERR_UNSUPPORTED,  /* well-formed but not handled: dtype, arch, method */
    LETHE_ERR_NOMEM,        /* host or device allocation failed */
    LETHE_ERR_BACKEND,      /* device / library call failed outside the hot path */
    LETHE_ERR_CAPACITY,     /* does not fit (KV, queue): a scheduling outcome at boundaries */
    LETHE_ERR_NOT_FOUND,    /* unknown id / name */
    LETHE_ERR_BUSY,         /* resource in use */
} lethe_status;

const char *lethe_status_str(lethe_status s);

/* Thread-local "last error" message. lethe_errorf() formats it and returns
 * `s` so that a detection site reads: return lethe_errorf(LETHE_ERR_FORMAT, "...") */
lethe_status lethe_errorf(lethe_status s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *lethe_last_error(void);
void lethe_clear_error(void);

/* Assertions stay on in every build: a broken invariant aborts with file:line. */
#define LETHE_ASSERT(c)                                                          \
    do {                                                                         \
        if (!(c)) lethe_assert_fail_(#c, __FILE__, __LINE__);                    \
    } while (0)
_Noreturn void lethe_assert_fail_(const char *expr, const char *file, int line);

#endif /* LETHE_STATUS_H */
