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

/* lethe_status (LETHE_OK, LETHE_ERR_*) and lethe_status_str are public:
 * include/lethe.h defines them, so a user of the C API can handle refusals. */
#include "lethe.h"

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
