/* options.h - one table-driven option parser for every `lethe` subcommand.
 *
 * A subcommand lists its options as lethe_opt rows; the same rows drive
 * parsing, range checks and --help, so help text cannot drift from what is
 * accepted. Engine options shared by generate/serve/bench/eval come from
 * lethe_opts_engine(), so a flag is spelled the same everywhere (vLLM style:
 * --max-model-len, --gpu-memory-utilization, --max-num-seqs, ...). */
#ifndef LETHE_TOOLS_OPTIONS_H
#define LETHE_TOOLS_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "lethe.h"

typedef enum lethe_opt_kind {
    LETHE_OPT_STR,    /* const char ** */
    LETHE_OPT_INT,    /* int32_t * */
    LETHE_OPT_U64,    /* uint64_t * */
    LETHE_OPT_FLOAT,  /* float * */
    LETHE_OPT_BOOL,   /* bool *; flag without value, "--no-NAME" sets false */
    LETHE_OPT_BYTES,  /* size_t *; accepts 512M, 4G, ... */
    LETHE_OPT_STRLIST,/* const char ** array of LETHE_MAX_STOP, appended (repeatable flag) */
} lethe_opt_kind;

typedef struct lethe_opt {
    const char *name;      /* "--max-model-len" */
    const char *alias;     /* "-m" or NULL */
    lethe_opt_kind kind;
    void *dst;
    const char *metavar;   /* "N" */
    const char *help;      /* one line; the default is printed from *dst */
    double min, max;       /* numeric bounds (min > max: unchecked) */
} lethe_opt;

#define LETHE_OPTS_MAX 96

/* Parses argv[1..]. Positional arguments are returned in pos (pointers into
 * argv). Returns 0 on success, 1 if --help was printed, -1 on error (message
 * already printed to stderr with the flag name and the accepted range). */
int lethe_opts_parse(const lethe_opt *opts, int n_opts, int argc, char **argv,
                     const char *usage, const char *summary, const char **pos, int *n_pos,
                     int pos_max);
void lethe_opts_help(FILE *f, const lethe_opt *opts, int n_opts, const char *usage,
                     const char *summary);

/* Appends the engine options (model, load format, device, threads, limits,
 * KV budget, prefix caching, sparse method, seed) bound to *p; returns the
 * number of rows written into rows[] (at most 24). */
int lethe_opts_engine(lethe_opt *rows, lethe_engine_params *p);
/* Appends sampling options (--temperature, --top-k, ..., --stop, --seed) bound to *s. */
int lethe_opts_sampling(lethe_opt *rows, lethe_sampling_params *s);

#endif /* LETHE_TOOLS_OPTIONS_H */
