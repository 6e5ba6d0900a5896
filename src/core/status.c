/* status.c - status strings, the thread-local last-error buffer, asserts. */
#include "core/status.h"

#include <stdarg.h>

static _Thread_local char g_err[1024];

const char *lethe_status_str(lethe_status s) {
    switch (s) {
    case LETHE_OK: return "ok";
    case LETHE_ERR_INVALID: return "invalid argument";
    case LETHE_ERR_IO: return "i/o error";
    case LETHE_ERR_FORMAT: return "format error";
    case LETHE_ERR_UNSUPPORTED: return "unsupported";
    case LETHE_ERR_NOMEM: return "out of memory";
    case LETHE_ERR_BACKEND: return "backend error";
    case LETHE_ERR_CAPACITY: return "capacity exceeded";
    case LETHE_ERR_NOT_FOUND: return "not found";
    case LETHE_ERR_BUSY: return "busy";
    }
    return "unknown status";
}

lethe_status lethe_errorf(lethe_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof(g_err), fmt, ap);
    va_end(ap);
    return s;
}

const char *lethe_last_error(void) { return g_err; }
void lethe_clear_error(void) { g_err[0] = '\0'; }

_Noreturn void lethe_assert_fail_(const char *expr, const char *file, int line) {
    fprintf(stderr, "lethe: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}
