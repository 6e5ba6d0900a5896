/* env.h - every LETHE_* environment variable the product reads, in one table.
 *
 * The variables are diagnostics and side-by-side switches, never needed for
 * normal use: the flags of each command are the interface. Each one is read
 * through this table when the part that uses it is created (an engine, a
 * backend), never per step, and a value that does not parse is an error with
 * the variable's name (LETHE_ERR_INVALID) instead of being ignored. An unset
 * or empty variable means its default. `lethe --help` prints the table
 * (lethe_env_print_help); README.md and docs/architecture.md list it too.
 *
 * Adding a variable: one enum entry here and one table row in env.c. Test
 * harness variables (LETHE_BUILD, LETHE_BIN, LETHE_TEST_DEVICE,
 * LETHE_HF_TEST_DEVICE) belong to tests/ and scripts/, not to this table.
 *
 * Plain C, usable from the CUDA backend (.cu files include it as extern "C"). */
#ifndef LETHE_CORE_ENV_H
#define LETHE_CORE_ENV_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "core/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lethe_env_id {
    LETHE_ENV_STEP_TIMES,     /* engine_diag.c */
    LETHE_ENV_PROFILE_STEP,   /* engine_diag.c */
    LETHE_ENV_SAMPLE_ON_HOST, /* engine_sample.c */
    LETHE_ENV_MATMUL,         /* backend/cuda/backend_cuda.cu */
    LETHE_ENV_FAULT_TOKEN,    /* engine.c -> runner.c (testing) */
    LETHE_ENV_CPU_ISA,        /* backend/cpu/backend_cpu.c */
    LETHE_ENV_DUMP_SELECTIONS, /* engine_seldump.c */
    LETHE_ENV_MLA_EXPAND_MIN_Q, /* model/arch_mla.c */
    LETHE_ENV_N
} lethe_env_id;

typedef enum lethe_env_type {
    LETHE_ENV_BOOL,   /* 0 or 1 (also false/true, no/yes, off/on) */
    LETHE_ENV_UINT,   /* a decimal integer >= 0 */
    LETHE_ENV_CHOICE, /* one of `choices` */
    LETHE_ENV_PATH,   /* a file path (any text; the default "" means off) */
} lethe_env_type;

typedef struct lethe_env_var {
    const char *name; /* LETHE_... */
    lethe_env_type type;
    const char *def;     /* the value when unset or empty */
    const char *choices; /* LETHE_ENV_CHOICE: "a|b|c"; else NULL */
    const char *reader;  /* the part that reads it, for --help: "engine", "CUDA backend" */
    const char *help;    /* one sentence: what it does */
} lethe_env_var;

const lethe_env_var *lethe_env_var_of(lethe_env_id id);

/* The variable's value (its default when unset or empty); a value that does
 * not parse for the variable's type returns LETHE_ERR_INVALID naming it. The
 * getter must match the table row's type (asserted). */
lethe_status lethe_env_bool(lethe_env_id id, bool *out);
lethe_status lethe_env_uint(lethe_env_id id, int64_t *out);
lethe_status lethe_env_choice(lethe_env_id id, const char **out); /* out: the value as given */
/* LETHE_ENV_PATH: the value as given, "" when unset (never fails) */
lethe_status lethe_env_path(lethe_env_id id, const char **out);

/* The table as `--help` text: name=values (default), reader, help. */
void lethe_env_print_help(FILE *f);

#ifdef __cplusplus
}
#endif

#endif /* LETHE_CORE_ENV_H */
