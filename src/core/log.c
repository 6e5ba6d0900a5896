/* log.c - leveled logging; one fprintf per line so threads do not interleave. */
#include "core/log.h"

#include <stdarg.h>
#include <stdio.h>

static int g_level = LETHE_LOG_INFO;

void lethe_log_set_level(int level) { g_level = level; }
int lethe_log_level(void) { return g_level; }

void lethe_log(int level, const char *fmt, ...) {
    static const char *tags[] = {"error", "warn", "info", "debug"};
    if (level > g_level) return;
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    fprintf(stderr, "lethe %s: %s\n", tags[level], buf);
}
