/* runinfo.h - conditions recorded with every result (commit, date, machine) and a progress bar. */
#ifndef LETHE_EVAL_RUNINFO_H
#define LETHE_EVAL_RUNINFO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

void lethe_runinfo_commit(char *out, size_t cap);  /* "1a2b3c4d5e6f[+dirty]" or "unknown" */
void lethe_runinfo_date(char *out, size_t cap);    /* ISO 8601, UTC */
void lethe_runinfo_machine(char *out, size_t cap); /* "host: CPU model, N cores" */

typedef struct lethe_progress {
    char what[64];
    int64_t total, done;
    double t0;
    bool enabled, tty;
    int last_pct;
} lethe_progress;

void lethe_progress_init(lethe_progress *p, const char *what, int64_t total, bool enabled);
/* done units so far; detail is a short label of the current unit (may be NULL) */
void lethe_progress_update(lethe_progress *p, int64_t done, const char *detail);
void lethe_progress_done(lethe_progress *p);

#endif /* LETHE_EVAL_RUNINFO_H */
