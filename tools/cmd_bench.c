/* cmd_bench.c - `lethe bench [engine|serve|replay|sparse|prefill|prune] ...`: dispatch to one file per benchmark. */
#include <stdio.h>
#include <string.h>

#include "commands.h"

int lethe_cmd_bench(int argc, char **argv) {
    static const struct {
        const char *name;
        int (*fn)(int, char **);
        const char *help;
    } kinds[] = {
        {"engine", lethe_bench_engine,
         "offline engine throughput vs the measured roofline (default)"},
        {"serve", lethe_bench_serve,
         "serving benchmark client against an OpenAI-compatible server"},
        {"replay", lethe_bench_replay, "agent-trace replay against a server (chain cache)"},
        {"sparse", lethe_bench_sparse,
         "sparse methods vs dense: largest batch and decode tokens/s"},
        {"prefill", lethe_bench_prefill,
         "prefill-axis methods vs dense: prefill time of one long prompt"},
        {"prune", lethe_bench_prune, "prefix-cache pruning quality: KL and top-1 vs unpruned"},
    };
    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) ) {
        printf("usage: lethe bench [KIND] [options]   (lethe bench KIND --help)\n\nkinds:\n");
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
            printf("  %-8s %s\n", kinds[i].name, kinds[i].help);
        return 0;
    }
    if (argc >= 2 && argv[1][0] != '-') {
        for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++)
            if (!strcmp(argv[1], kinds[i].name)) return kinds[i].fn(argc - 1, argv + 1);
        fprintf(stderr, "lethe bench: unknown kind '%s' (engine, serve, replay, sparse, prefill, prune)\n",
                argv[1]);
        return 2;
    }
    return lethe_bench_engine(argc, argv);
}
