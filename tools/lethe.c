/* lethe.c - the `lethe` command: dispatches to a subcommand. */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "core/env.h"

typedef struct subcommand {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
} subcommand;

static const subcommand g_cmds[] = {
    {"serve", lethe_cmd_serve, "OpenAI-compatible HTTP server (the main job)"},
    {"generate", lethe_cmd_generate, "generate from a prompt, chat interactively, or run a JSONL batch"},
    {"bench", lethe_cmd_bench, "benchmarks: engine, serve, replay, sparse, prefill, prune (lethe bench --help)"},
    {"eval", lethe_cmd_eval, "long-context quality of sparse methods against dense"},
    {"methods", lethe_cmd_methods, "list the sparse methods and their knobs"},
    {"fit", lethe_cmd_fit, "fit a sparse method's assets from the model (palu, deltakv)"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: lethe <command> [options]   (lethe <command> --help for details)\n\n"
               "lethe is a sparse-first LLM inference and serving engine.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof(g_cmds) / sizeof(g_cmds[0]); i++)
        fprintf(f, "  %-10s %s\n", g_cmds[i].name, g_cmds[i].help);
    fprintf(f, "\n");
    lethe_env_print_help(f); /* every LETHE_* variable (core/env.c) */
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (size_t i = 0; i < sizeof(g_cmds) / sizeof(g_cmds[0]); i++)
        if (!strcmp(argv[1], g_cmds[i].name)) return g_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "lethe: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
